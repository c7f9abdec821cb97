// ZeRO-Infinity on this machine (issue 28): step time and peak resident memory per rank of ZeRO-3 with the
// optimizer state in memory or on disk (offload_optimizer_device: nvme), run under accel-launch; the disk's
// O_DIRECT bandwidth is measured first, so the step can be compared with the I/O bound. bench/nvme_bench.sh
// runs it with and without a memory cap (a cgroup) and prints the ratios.
//
//   accel-launch launch --cpu --num_processes 2 build/bench/bench_nvme_offload --width 2048 --layers 8
//     --steps 6 --nvme_path /var/tmp/accel-nvme            (no --nvme_path: the state stays in memory)
#include <accel/accelerator/accelerator.hpp>

#include "bench_args.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>

namespace bench_nvme_offload {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// A line of /proc/self/status in bytes ("VmRSS", "VmHWM").
std::uint64_t status_bytes(const std::string& key) {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(key + ":", 0) == 0)
      return std::strtoull(line.c_str() + key.size() + 1, nullptr, 10) * 1024;
  }
  return 0;
}

// O_DIRECT write then read of `bytes` in `dir` (one file, 4 MiB requests): bytes per second each way.
std::pair<double, double> disk_bandwidth(const std::string& dir, std::int64_t bytes) {
  const std::string path = (std::filesystem::path(dir) / "accel_bandwidth_probe").string();
  constexpr std::int64_t kChunk = 4 << 20;
  void* raw = nullptr;
  if (::posix_memalign(&raw, 4096, kChunk) != 0) return {0, 0};
  std::memset(raw, 7, kChunk);
  auto* buf = static_cast<char*>(raw);
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_DIRECT, 0600);
  const bool direct = fd >= 0;
  if (!direct) fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  auto t = Clock::now();
  for (std::int64_t done = 0; done < bytes; done += kChunk) {
    if (::pwrite(fd, buf, kChunk, done) != kChunk) break;
  }
  ::fsync(fd);
  ::close(fd);
  const double write = static_cast<double>(bytes) / seconds_since(t);
  fd = ::open(path.c_str(), O_RDONLY | (direct ? O_DIRECT : 0));
  t = Clock::now();
  for (std::int64_t done = 0; done < bytes; done += kChunk) {
    if (::pread(fd, buf, kChunk, done) != kChunk) break;
  }
  ::close(fd);
  const double read = static_cast<double>(bytes) / seconds_since(t);
  std::remove(path.c_str());
  std::free(raw);
  return {write, read};
}

int run(int argc, char** argv) try {
  int steps = 6, warmup = 1, layers = 8, stage = 3;
  std::int64_t width = 2048, sub_group = 4000000;
  std::string nvme_path;
  int params_too = 0;  // --param_nvme 1
  bench::Flags()
      .add("--steps", steps)
      .add("--warmup", warmup)
      .add("--width", width)
      .add("--layers", layers)
      .add("--stage", stage)
      .add("--sub_group_size", sub_group)
      .add("--nvme_path", nvme_path)
      .add("--param_nvme", params_too)
      .parse(argc, argv);
  const std::uint64_t baseline = status_bytes("VmRSS");
  accel::CpuMemoryCounter::install();  // LibTorch's own CPU allocations, beside the resident size
  accel::Config config;
  config.backend = "zero";
  config.use_cpu = true;
  config.zero.stage = stage;
  config.zero.sub_group_size = static_cast<std::uint64_t>(sub_group);
  if (!nvme_path.empty()) {
    config.zero.offload_optimizer_device = accel::OffloadDevice::Nvme;
    config.zero.offload_optimizer_nvme_path = nvme_path;
    if (params_too) {  // ZeRO-Infinity whole: the parameter shards on disk too (stage 3)
      config.zero.offload_param_device = accel::OffloadDevice::Nvme;
      config.zero.offload_param_nvme_path = nvme_path;
    }
  }
  accel::Accelerator accelerator(accel::AcceleratorOptions().config(config));
  const int n = accelerator.num_processes();
  double write_bw = 0, read_bw = 0;
  if (!nvme_path.empty() && accelerator.is_main_process()) {
    std::filesystem::create_directories(nvme_path);
    std::tie(write_bw, read_bw) = disk_bandwidth(nvme_path, 512ll << 20);
  }
  accelerator.wait_for_everyone();
  torch::manual_seed(0);
  torch::nn::Sequential model;
  for (int l = 0; l < layers; ++l) {
    model->push_back(torch::nn::Linear(torch::nn::LinearOptions(width, width).bias(false)));
    model->push_back(torch::nn::Tanh());
  }
  std::int64_t params = 0;
  for (const auto& p : model->parameters())
    params += p.numel();
  torch::optim::Adam optimizer(model->parameters(), torch::optim::AdamOptions(1e-4));
  accelerator.prepare(model, optimizer);
  const std::int64_t batch = 8;
  const auto x = torch::randn({batch, width});
  Clock::time_point start;
  std::uint64_t setup_peak = 0;
  for (int step = 0; step < steps + warmup; ++step) {
    if (step == warmup) {
      accelerator.wait_for_everyone();
      // The peak so far is building the model whole and sharding it; from here on, training's own.
      setup_peak = status_bytes("VmHWM");
      std::ofstream("/proc/self/clear_refs") << "5";  // resets VmHWM to the current resident size
      accel::CpuMemoryCounter::reset_peak();
      start = Clock::now();
    }
    optimizer.zero_grad();
    accelerator.backward(model->forward(x).pow(2).mean());
    optimizer.step();
  }
  accelerator.wait_for_everyone();
  const double step_s = seconds_since(start) / steps;
  const std::uint64_t peak = status_bytes("VmHWM");  // the timed steps' peak
  // Per rank: the peaks over the baseline of a process that has LibTorch loaded but no model.
  const double torch_peak = static_cast<double>(accel::CpuMemoryCounter::peak());
  auto peaks = accelerator.gather(torch::tensor(
      {static_cast<double>(peak - baseline), static_cast<double>(setup_peak - baseline), torch_peak},
      torch::kFloat64));
  if (accelerator.is_main_process()) {
    const double state_per_rank = 2.0 * 4.0 * static_cast<double>(params) / n;  // Adam: two fp32 moments
    std::printf("model: %lld parameters (%d x Linear(%lld, %lld)), Adam, ZeRO-%d on %d rank(s), state %s\n",
                static_cast<long long>(params), layers, static_cast<long long>(width),
                static_cast<long long>(width), stage, n,
                nvme_path.empty() ? "in memory" : (params_too ? "and parameter shards on NVMe" : "on NVMe"));
    std::printf("step_seconds=%.3f\n", step_s);
    for (int r = 0; r < n; ++r) {
      std::printf(
          "rank %d: peak_rss_over_baseline_bytes=%.0f setup_peak_rss_over_baseline_bytes=%.0f "
          "torch_peak_bytes=%.0f\n",
          r, peaks[3 * r].item<double>(), peaks[3 * r + 1].item<double>(), peaks[3 * r + 2].item<double>());
    }
    std::printf("baseline_rss_bytes=%llu adam_state_bytes_per_rank=%.0f\n",
                static_cast<unsigned long long>(baseline), state_per_rank);
    if (!nvme_path.empty()) {
      // Every step reads and writes each rank's whole state once; the ranks share the disk. With the shards
      // there too: each is read for the forward's and the backward's gathers and for the step, and written
      // after the step.
      const double shards = params_too ? 4.0 * static_cast<double>(params) / n : 0.0;
      const double bound =
          n * (state_per_rank + 3 * shards) / read_bw + n * (state_per_rank + shards) / write_bw;
      std::printf("disk_write_bytes_per_s=%.0f disk_read_bytes_per_s=%.0f io_bound_seconds_per_step=%.3f\n",
                  write_bw, read_bw, bound);
    }
  }
  // Ends here, without tearing the accelerator down: ZeRO-3's teardown gathers the whole model for code after
  // the accelerator (torch::save at the end of main), which would need the unsharded model in memory, more
  // than the capped run has (the swap files of this process are removed by the next run, or by the script).
  std::fflush(stdout);
  std::_Exit(0);
} catch (const std::exception& e) {
  std::fprintf(stderr, "bench_nvme_offload: %s\n", e.what());
  return 1;
}

}  // namespace bench_nvme_offload
