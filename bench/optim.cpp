// The optimizer step alone: torch::optim::AdamW / Adam / SGD (momentum) against accel::optim's fused ones, on
// the 21M-parameter MLP of bench/zero_memory.cpp, with one thread and with all threads. Prints ms per step,
// the ratios, and how far apart the two end after the timed steps. With --cuda 1 the same rows run on the GPU
// (ATen's fused CUDA kernels against LibTorch's per-tensor operators), timed between CUDA synchronisations.
//   bench_optim [--steps 20] [--warmup 3] [--cuda 0|1]
#include <accel/optim/optim.hpp>

#include "bench_args.hpp"

#include <ATen/Parallel.h>
#include <torch/cuda.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

namespace bench_optim {

// The parameters of bench_zero_memory's MLP: 4 x Linear(2304, 2304), then Linear(2304, 10): 21,265,930.
torch::Device device = torch::kCPU;

void sync() {
  if (device.is_cuda()) torch::cuda::synchronize();
}

std::vector<torch::Tensor> make_params() {
  torch::manual_seed(0);
  std::vector<std::vector<int64_t>> shapes;
  for (int l = 0; l < 4; ++l) {
    shapes.push_back({2304, 2304});
    shapes.push_back({2304});
  }
  shapes.push_back({10, 2304});
  shapes.push_back({10});
  std::vector<torch::Tensor> out;
  for (const auto& s : shapes)
    out.push_back(torch::randn(s).to(device).requires_grad_(true));
  return out;
}

template <typename Opt, typename Options>
double time_steps(std::vector<torch::Tensor>& params, const Options& options, int warmup, int steps) {
  torch::manual_seed(1);
  for (auto& p : params)
    p.mutable_grad() = torch::randn_like(p);
  Opt opt(params, options);
  for (int s = 0; s < warmup; ++s)
    opt.step();
  sync();
  const auto start = std::chrono::steady_clock::now();
  for (int s = 0; s < steps; ++s)
    opt.step();
  sync();
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count() / steps;
}

template <typename Lib, typename Fused, typename Options>
void row(const char* name, const Options& options, int threads, int warmup, int steps) {
  at::set_num_threads(threads);
  auto lib_params = make_params(), fused_params = make_params();
  const double lib = time_steps<Lib>(lib_params, options, warmup, steps);
  const double fused = time_steps<Fused>(fused_params, options, warmup, steps);
  double diff = 0;
  for (std::size_t k = 0; k < lib_params.size(); ++k)
    diff = std::max(diff, (lib_params[k] - fused_params[k]).abs().max().item<double>());
  std::int64_t numel = 0;
  for (const auto& p : lib_params)
    numel += p.numel();
  std::printf(
      "%-6s %s threads %d  parameters %lld  torch::optim %8.2f ms  accel::optim %8.2f ms  speed-up %.2fx  "
      "max difference after %d steps %.2e\n",
      name, device.str().c_str(), threads, static_cast<long long>(numel), lib, fused, lib / fused,
      warmup + steps, diff);
}

int run(int argc, char** argv) {
  int steps = 20, warmup = 3, cuda = 0;
  bench::Flags().add("--steps", steps).add("--warmup", warmup).add("--cuda", cuda).parse(argc, argv);
  const int all = static_cast<int>(std::thread::hardware_concurrency());
  if (cuda != 0) device = torch::Device(torch::kCUDA, 0);
  torch::NoGradGuard no_grad;
  for (int threads : device.is_cuda() ? std::vector<int>{all} : std::vector<int>{1, all}) {
    row<torch::optim::AdamW, accel::optim::AdamW>("AdamW", torch::optim::AdamWOptions(1e-3), threads, warmup,
                                                  steps);
    row<torch::optim::Adam, accel::optim::Adam>("Adam", torch::optim::AdamOptions(1e-3), threads, warmup,
                                                steps);
    row<torch::optim::SGD, accel::optim::SGD>("SGD", torch::optim::SGDOptions(1e-3).momentum(0.9), threads,
                                              warmup, steps);
  }
  return 0;
}

}  // namespace bench_optim
