// The cost of checkpoint checksums (issue 30): a checkpoint's manifest keeps each file's XXH64, computed
// while the file is written (no second pass) and verified by load_state before anything is loaded (one read
// of every file). Side by side, per GiB of tensor data:
//   write: a safetensors file written as save_state writes it (hashing each buffer on its way to the file)
//          vs the same bytes written with plain fwrite (no hash);
//   hash:  XXH64 over the bytes in memory (the added CPU work);
//   verify: digest_file of the written file (what load_state adds; the page cache is warm right after the
//          write, as when a run resumes from a checkpoint it just saved).
//   bench_checksum [--mib 1024] [--repeats 3] [--dir /tmp]
#include "bench_args.hpp"

#include <accel/checkpoint/safetensors.hpp>

#include "checkpoint/safetensors_write.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Plain writes of the same bytes in the same pieces, fsync-free like the writer (the commit fsyncs later).
void write_plain(const std::string& path, const std::vector<float>& data) {
  std::FILE* f = std::fopen(path.c_str(), "wb");
  const std::size_t piece = std::size_t{64} << 20;
  const auto* bytes = reinterpret_cast<const char*>(data.data());
  const std::size_t total = data.size() * sizeof(float);
  for (std::size_t off = 0; off < total; off += piece)
    std::fwrite(bytes + off, 1, std::min(piece, total - off), f);
  std::fclose(f);
}

}  // namespace

int main(int argc, char** argv) {
  std::size_t mib = 1024;
  int repeats = 3;
  std::string dir = std::filesystem::temp_directory_path().string();
  bench::Flags().add("--mib", mib).add("--repeats", repeats).add("--dir", dir).parse(argc, argv);
  const std::size_t floats = mib * (std::size_t{1} << 20) / sizeof(float);
  std::vector<float> data(floats);
  for (std::size_t i = 0; i < floats; ++i)
    data[i] = static_cast<float>(i % 9973) * 0.5f;
  // 16 tensors of 1/16 each, like a model's layers.
  std::vector<accel::safetensors::TensorView> views(16);
  for (std::size_t t = 0; t < views.size(); ++t) {
    views[t].name = "layer_" + std::to_string(t) + ".weight";
    views[t].shape = {static_cast<std::int64_t>(floats / 16)};
    views[t].data = data.data() + t * (floats / 16);
    views[t].nbytes = floats / 16 * sizeof(float);
  }
  const std::string hashed_path = dir + "/bench_checksum_hashed.safetensors";
  const std::string plain_path = dir + "/bench_checksum_plain.bin";
  double best_hashed = 1e30, best_plain = 1e30, best_hash = 1e30, best_verify = 1e30;
  std::uint64_t digest = 0, verified = 0;
  for (int r = 0; r < repeats; ++r) {
    auto t0 = std::chrono::steady_clock::now();
    write_plain(plain_path, data);
    best_plain = std::min(best_plain, seconds_since(t0));
    t0 = std::chrono::steady_clock::now();
    digest = accel::detail::write_safetensors(hashed_path, views).xxh64;
    best_hashed = std::min(best_hashed, seconds_since(t0));
    t0 = std::chrono::steady_clock::now();
    accel::detail::Xxh64 h;
    h.update(data.data(), floats * sizeof(float));
    best_hash = std::min(best_hash, seconds_since(t0));
    t0 = std::chrono::steady_clock::now();
    verified = accel::detail::digest_file(hashed_path).xxh64;
    best_verify = std::min(best_verify, seconds_since(t0));
  }
  std::filesystem::remove(hashed_path);
  std::filesystem::remove(plain_path);
  const double gib = static_cast<double>(mib) / 1024.0;
  std::printf("checkpoint checksums, %zu MiB of tensor data in %s, best of %d\n", mib, dir.c_str(), repeats);
  std::printf("  write, plain fwrite (no hash)      %7.3f s/GiB\n", best_plain / gib);
  std::printf("  write, save_state's writer (XXH64) %7.3f s/GiB   ratio %.2fx\n", best_hashed / gib,
              best_hashed / best_plain);
  std::printf("  XXH64 alone, in memory             %7.3f s/GiB   (%.1f GiB/s)\n", best_hash / gib,
              gib / best_hash);
  std::printf("  load_state's verification (read)   %7.3f s/GiB   (%.1f GiB/s, page cache warm)\n",
              best_verify / gib, gib / best_verify);
  std::printf("  the written file's digest %s the verification's\n",
              digest == verified ? "equals" : "DIFFERS FROM");
  return digest == verified ? 0 : 1;
}
