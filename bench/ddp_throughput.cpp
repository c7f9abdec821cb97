// Data-parallel throughput of accelerate-cpp: the Fashion-MNIST CNN trained with per-rank batch B for a fixed
// number of steps, under accel-launch (any number of ranks). Rank 0 prints one JSON line that
// bench/ddp_bench.py compares with PyTorch DDP and Hugging Face Accelerate running the same model and data.
//
//   accel-launch launch --cpu --num_processes 2 build/bench/bench_ddp_throughput --steps 60 --batch-size 64
#include <accel/accelerator.hpp>

#include "bench_args.hpp"

#include "../examples/fashion_mnist/fashion_mnist.hpp"

#include <chrono>
#include <cstdio>

int main(int argc, char** argv) try {
  int steps = 60, warmup = 10;
  std::size_t batch_size = 64;
  bench::Flags()
      .add("--steps", steps)
      .add("--warmup", warmup)
      .add("--batch-size", batch_size)
      .parse(argc, argv);
  torch::manual_seed(0);
  fashion::Net model;
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
  accel::Accelerator accelerator;
  accelerator.prepare(model, optimizer);
  const auto n = static_cast<std::int64_t>((steps + warmup) * batch_size * accelerator.num_processes());
  auto loader = accelerator.prepare_data_loader<torch::data::samplers::SequentialSampler>(
      fashion::Dataset(fashion::default_data_dir(), true, n).map(torch::data::transforms::Stack<>()),
      batch_size);

  using Clock = std::chrono::steady_clock;
  Clock::time_point start;
  double first_step_unix_ms = 0;
  std::uint64_t bytes_start = 0;
  int step = 0;
  for (auto& batch : *loader) {
    optimizer.zero_grad();
    auto loss = torch::cross_entropy_loss(model(batch.data), batch.target);
    accelerator.backward(loss);
    optimizer.step();
    if (++step == 1) {
      first_step_unix_ms =
          std::chrono::duration<double, std::milli>(std::chrono::system_clock::now().time_since_epoch())
              .count();
    }
    if (step == warmup) {
      accelerator.wait_for_everyone();
      start = Clock::now();
      bytes_start = accelerator.communicator().bytes(accel::Collective::AllReduce).wire;
    }
  }
  accelerator.wait_for_everyone();
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  const int timed = step - warmup;
  std::uint64_t params = 0;
  for (const auto& p : model->parameters())
    params += p.nbytes();
  const int w = accelerator.num_processes();
  const auto wire = accelerator.communicator().bytes(accel::Collective::AllReduce).wire - bytes_start;
  if (accelerator.is_main_process()) {
    std::printf(
        "{\"impl\": \"accelerate-cpp\", \"world\": %d, \"threads\": %d, \"batch_per_rank\": %zu, \"steps\": "
        "%d, "
        "\"samples_per_s\": %.1f, \"step_ms\": %.3f, \"wire_bytes_per_step\": %.1f, "
        "\"theory_bytes_per_step\": %.1f, \"first_step_unix_ms\": %.1f}\n",
        w, torch::get_num_threads(), batch_size, timed, timed * batch_size * w / seconds,
        seconds / timed * 1e3, static_cast<double>(wire) / timed, 2.0 * params * (w - 1) / w,
        first_step_unix_ms);
  }
} catch (const std::exception& e) {
  std::fprintf(stderr, "error: %s\n", e.what());
  return 1;
}
