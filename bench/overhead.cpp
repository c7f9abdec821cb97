// Per-step overhead of the Accelerator on one process: the plain LibTorch loop and the accelerated loop train
// the same CNN on the same Fashion-MNIST batches, interleaved in rounds so that machine noise hits both
// alike. Prints the median step time of each and their ratio (goal: accelerated/plain < 1.02).
//
//   build/bench/bench_overhead [--rounds 7] [--steps 40] [--batch-size 64]
#include <accel/accelerator/accelerator.hpp>

#include "bench_args.hpp"

#include "../examples/fashion_mnist/fashion_mnist.hpp"

#include <algorithm>
#include <chrono>

namespace bench_overhead {

using Clock = std::chrono::steady_clock;
using Train = torch::data::datasets::MapDataset<fashion::Dataset, torch::data::transforms::Stack<>>;

using bench::median;

int run(int argc, char** argv) try {
  int rounds = 7, steps = 40;
  std::size_t batch_size = 64;
  bench::Flags()
      .add("--rounds", rounds)
      .add("--steps", steps)
      .add("--batch-size", batch_size)
      .parse(argc, argv);
  const auto limit = static_cast<std::int64_t>(steps * batch_size);
  const auto dir = fashion::default_data_dir();

  torch::manual_seed(0);
  fashion::Net plain_model;
  torch::optim::Adam plain_opt(plain_model->parameters(), torch::optim::AdamOptions(1e-3));
  auto plain_loader = torch::data::make_data_loader(
      fashion::Dataset(dir, true, limit).map(torch::data::transforms::Stack<>()), batch_size);

  torch::manual_seed(0);
  fashion::Net acc_model;
  torch::optim::Adam acc_opt(acc_model->parameters(), torch::optim::AdamOptions(1e-3));
  accel::Config config;
  config.use_cpu = true;
  accel::Accelerator accelerator(accel::AcceleratorOptions().config(config));
  accelerator.prepare(acc_model, acc_opt);
  auto acc_loader = accelerator.prepare_data_loader(
      fashion::Dataset(dir, true, limit).map(torch::data::transforms::Stack<>()), batch_size);

  auto plain_epoch = [&] {
    int n = 0;
    const auto t0 = Clock::now();
    for (auto& batch : *plain_loader) {
      plain_opt.zero_grad();
      auto loss = torch::cross_entropy_loss(plain_model(batch.data), batch.target);
      loss.backward();
      plain_opt.step();
      ++n;
    }
    return std::chrono::duration<double>(Clock::now() - t0).count() / n;
  };
  auto acc_epoch = [&] {
    int n = 0;
    const auto t0 = Clock::now();
    for (auto& batch : *acc_loader) {
      acc_opt.zero_grad();
      auto loss = torch::cross_entropy_loss(acc_model(batch.data), batch.target);
      accelerator.backward(loss);
      acc_opt.step();
      ++n;
    }
    return std::chrono::duration<double>(Clock::now() - t0).count() / n;
  };

  plain_epoch();  // warm-up: allocator, oneDNN kernels
  acc_epoch();
  std::vector<double> plain, acc;
  for (int r = 0; r < rounds; ++r) {
    // Alternate which loop goes first so a drift in machine speed does not favour one of them.
    if (r % 2 == 0) {
      plain.push_back(plain_epoch());
      acc.push_back(acc_epoch());
    } else {
      acc.push_back(acc_epoch());
      plain.push_back(plain_epoch());
    }
  }
  const double p = median(plain), a = median(acc);
  std::printf("threads: %d, batch %zu, %d steps x %d rounds\n", torch::get_num_threads(), batch_size, steps,
              rounds);
  std::printf("plain LibTorch step:  %.3f ms (median)\n", p * 1e3);
  std::printf("accelerate-cpp step:  %.3f ms (median)\n", a * 1e3);
  std::printf("overhead ratio accelerated/plain: %.4f (%+.2f%%)\n", a / p, (a / p - 1) * 100);
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "error: %s\n", e.what());
  return 1;
}

}  // namespace bench_overhead
