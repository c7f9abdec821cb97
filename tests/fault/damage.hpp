#pragma once
// The eight ways the fault campaigns damage a checkpoint file (state_io_test.cpp's one-process campaign and
// dist_worker's multi-rank one): a flipped bit, overwritten bytes, truncation, appended bytes, zeroed,
// deleted, swapped with another file of the checkpoint, replaced by another checkpoint's file.

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

namespace accel_fault {

namespace fs = std::filesystem;

inline std::string read_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// Overwrites `p` in place, then cuts it to the new size. Not O_TRUNC: on ext4, truncating a file that holds
// data to zero bytes first flushes its blocks to disk (auto_da_alloc), ~4 ms a write here, which was most of
// the fuzzers' time (the parser fuzzer 34 s -> 2 s in the suite).
inline void write_bytes(const fs::path& p, const std::string& bytes) {
  const int fd = ::open(p.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) throw std::runtime_error("cannot open " + p.string() + " to write it");
  std::size_t at = 0;
  while (at < bytes.size()) {
    const ssize_t n = ::pwrite(fd, bytes.data() + at, bytes.size() - at, static_cast<off_t>(at));
    if (n <= 0) break;
    at += static_cast<std::size_t>(n);
  }
  const bool ok = at == bytes.size() && ::ftruncate(fd, static_cast<off_t>(bytes.size())) == 0;
  ::close(fd);
  if (!ok) throw std::runtime_error("cannot write " + p.string());
}

// Damages `file` (inside `dir`) by mutation `kind`; `other` is the same file of another checkpoint. Returns
// what it did.
inline std::string damage(const fs::path& dir, const fs::path& file, const fs::path& other, int kind,
                          std::mt19937_64& rng) {
  auto pick = [&](std::size_t n) { return n == 0 ? std::size_t{0} : static_cast<std::size_t>(rng() % n); };
  std::string bytes = read_bytes(file);
  const std::size_t at = pick(bytes.size());
  switch (kind) {
    case 0:
      if (bytes.empty()) return "empty";
      bytes[at] = static_cast<char>(bytes[at] ^ (1u << pick(8)));
      write_bytes(file, bytes);
      return "bit flipped at byte " + std::to_string(at);
    case 1: {
      const std::size_t n = std::min<std::size_t>(1 + pick(16), bytes.size() - at);
      for (std::size_t k = 0; k < n; ++k)
        bytes[at + k] = static_cast<char>(pick(256));
      write_bytes(file, bytes);
      return std::to_string(n) + " bytes overwritten at " + std::to_string(at);
    }
    case 2:
      fs::resize_file(file, at);
      return "truncated to " + std::to_string(at) + " bytes";
    case 3:
      write_bytes(file, bytes + std::string(1 + pick(64), static_cast<char>(pick(256))));
      return "bytes appended";
    case 4:
      write_bytes(file, std::string(bytes.size(), '\0'));
      return "zeroed";
    case 5:
      fs::remove(file);
      return "deleted";
    case 6: {
      std::vector<fs::path> files;
      for (const auto& e : fs::directory_iterator(dir))
        if (e.path() != file) files.push_back(e.path());
      std::sort(files.begin(), files.end());
      const auto swap_with = files[pick(files.size())];
      const fs::path tmp = dir / "swap.tmp";
      fs::rename(file, tmp);
      fs::rename(swap_with, file);
      fs::rename(tmp, swap_with);
      return "swapped with " + swap_with.filename().string();
    }
    default:
      fs::copy_file(other, file, fs::copy_options::overwrite_existing);
      return "replaced by another checkpoint's";
  }
}
constexpr int kDamageKinds = 8;

}  // namespace accel_fault
