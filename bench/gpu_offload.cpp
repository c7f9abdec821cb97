// ZeRO-Offload on one GPU under a memory cap (issue 27): a model whose AdamW state does not fit a small card
// trains when the optimizer state lives on the CPU. The card is emulated with the CUDA caching allocator's
// per-process memory fraction (PyTorch's torch.cuda.set_per_process_memory_fraction), so allocations beyond
// `--cap-gib` fail as they would on a 4-8 GB card.
//   bench_gpu_offload --mode gpu|offload [--cap-gib 8] [--hidden 8192] [--layers 9] [--batch 16] [--steps 3]
// gpu: the local backend, AdamW state on the GPU; offload: backend zero, stage 2, offload_optimizer_device
// cpu (the fused CPU AdamW steps the fp32 master). --cap-gib 0: no cap. Prints one line with the peak GPU
// memory, seconds per step and samples/s, or where it ran out of memory. bench/gpu_bench.sh runs the three
// cases (gpu capped, offload capped, gpu uncapped) side by side.
#include <accel/accelerator/accelerator.hpp>
#include <accel/optim/optim.hpp>

#include <c10/cuda/CUDACachingAllocator.h>
#include <cuda_runtime_api.h>
#include <torch/cuda.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <string>

#include "bench_args.hpp"

namespace bench_gpu_offload {

double gib(std::int64_t bytes) {
  return static_cast<double>(bytes) / (1024.0 * 1024.0 * 1024.0);
}

std::int64_t peak_allocated() {
  const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(0);
  return stats.allocated_bytes[static_cast<std::size_t>(c10::CachingAllocator::StatType::AGGREGATE)].peak;
}

int run(int argc, char** argv) {
  std::string mode = "offload";
  double cap_gib = 8;
  std::int64_t hidden = 8192;
  int layers = 9, batch = 16, steps = 3;
  bench::Flags()
      .add("--mode", mode)
      .add("--cap-gib", cap_gib)
      .add("--hidden", hidden)
      .add("--layers", layers)
      .add("--batch", batch)
      .add("--steps", steps)
      .parse(argc, argv);
  if (!torch::cuda::is_available()) {
    std::fprintf(stderr, "bench_gpu_offload: no CUDA device\n");
    return 2;
  }
  torch::empty({1}, torch::kCUDA);  // initialises the caching allocator, which setMemoryFraction needs
  std::size_t free_bytes = 0, total_bytes = 0;
  cudaMemGetInfo(&free_bytes, &total_bytes);
  if (cap_gib > 0) {
    c10::cuda::CUDACachingAllocator::setMemoryFraction(
        cap_gib * 1024.0 * 1024.0 * 1024.0 / static_cast<double>(total_bytes), 0);
  }

  accel::Config config;
  config.use_cpu = false;
  if (mode == "offload") {
    config.backend = "zero";
    config.zero.stage = 2;
    config.zero.offload_optimizer_device = accel::OffloadDevice::Cpu;
  } else if (mode != "gpu") {
    std::fprintf(stderr, "bench_gpu_offload: --mode must be gpu or offload, not '%s'\n", mode.c_str());
    return 2;
  }

  torch::manual_seed(0);
  torch::nn::Sequential model;
  for (int l = 0; l < layers; ++l) {
    model->push_back(torch::nn::Linear(hidden, hidden));
    model->push_back(torch::nn::ReLU());
  }
  std::int64_t numel = 0;
  for (const auto& p : model->parameters())
    numel += p.numel();
  accel::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-4));
  const std::string what =
      mode + (cap_gib > 0 ? " cap=" + std::to_string(cap_gib).substr(0, 4) + "GiB" : " uncapped");
  int done = 0;
  try {
    accel::Accelerator acc(accel::AcceleratorOptions().config(config));
    acc.prepare(model, opt);
    const auto x = torch::randn({batch, hidden}, torch::TensorOptions().device(acc.device()));
    auto step = [&] {
      opt.zero_grad();
      acc.backward(model->forward(x).pow(2).mean());
      opt.step();
      ++done;
    };
    step();  // warm-up: creates the optimizer state
    torch::cuda::synchronize();
    const auto start = std::chrono::steady_clock::now();
    for (int s = 0; s < steps; ++s)
      step();
    torch::cuda::synchronize();
    const double per_step =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / steps;
    std::printf(
        "gpu_offload mode=%s parameters=%lld (%.2f GiB fp32; AdamW state %.2f GiB) peak_gpu=%.2fGiB "
        "s/step=%.3f samples/s=%.1f\n",
        what.c_str(), static_cast<long long>(numel), gib(numel * 4), gib(numel * 8), gib(peak_allocated()),
        per_step, batch / per_step);
  } catch (const std::exception& e) {
    // c10::OutOfMemoryError, or the library's error around it: either way the first line says what ran out.
    const std::string msg = e.what();
    const bool oom = msg.find("out of memory") != std::string::npos;
    std::printf(
        "gpu_offload mode=%s parameters=%lld (%.2f GiB fp32; AdamW state %.2f GiB) %s after %d "
        "step(s), peak_gpu=%.2fGiB: %s\n",
        what.c_str(), static_cast<long long>(numel), gib(numel * 4), gib(numel * 8),
        oom ? "OUT OF MEMORY" : "FAILED", done, gib(peak_allocated()), msg.substr(0, msg.find('\n')).c_str());
    return oom ? 0 : 1;
  }
  return 0;
}

}  // namespace bench_gpu_offload
