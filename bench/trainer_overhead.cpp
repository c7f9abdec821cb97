// Per-step overhead of accel::Trainer over the hand-written accelerated loop it replaces (issue 25; goal
// <= 1%): one process trains the Fashion-MNIST CNN for one epoch of `steps` batches both ways (same AdamW,
// clipping at 1.0, linear schedule with warmup, loss logged every 10 steps), interleaved in rounds so that
// machine noise hits both alike. Each run includes building its Accelerator, preparing and the epoch. Prints
// the median and the fastest wall time of each and their ratios.
//
//   build/bench/bench_trainer_overhead [--rounds 7] [--steps 60] [--batch-size 64] [--device cpu|cuda]
#include <accel/optim/schedulers.hpp>
#include <accel/trainer/trainer.hpp>

#include "bench_args.hpp"

#include <torch/cuda.h>

#include "../examples/fashion_mnist/fashion_mnist.hpp"

#include <algorithm>
#include <chrono>

namespace bench_trainer_overhead {

using Clock = std::chrono::steady_clock;

using bench::median;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

int run(int argc, char** argv) try {
  int rounds = 7, steps = 60;
  std::size_t batch_size = 64;
  std::string device = "cpu";
  bench::Flags()
      .add("--device", device)
      .add("--rounds", rounds)
      .add("--steps", steps)
      .add("--batch-size", batch_size)
      .parse(argc, argv);
  const auto limit = static_cast<std::int64_t>(steps) * static_cast<std::int64_t>(batch_size);
  const auto dir = fashion::default_data_dir();
  const auto train_set = fashion::Dataset(dir, true, limit).map(torch::data::transforms::Stack<>());
  accel::Config config;
  config.use_cpu = device == "cpu";
  if (device != "cpu" && device != "cuda")
    throw std::invalid_argument("--device " + device + ": use cpu or cuda");
  const auto sync = [&] {
    if (!config.use_cpu) torch::cuda::synchronize();
  };

  accel::TrainingArguments args;
  args.output_dir = "/tmp/accel_bench_trainer";
  args.num_train_epochs = 1;
  args.per_device_train_batch_size = static_cast<std::int64_t>(batch_size);
  args.learning_rate = 1e-3;
  args.warmup_steps = 5;
  args.logging_steps = 10;
  args.save_strategy = "no";
  args.disable_tqdm = true;
  args.seed = 0;

  auto hand = [&] {
    const auto t0 = Clock::now();
    torch::manual_seed(0);
    fashion::Net model;
    accel::Accelerator acc(accel::AcceleratorOptions().config(config));
    acc.set_seed(0);
    auto loader =
        acc.prepare_data_loader(train_set, accel::DataLoaderOptions(batch_size).shuffle(true).seed(0));
    torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-3).weight_decay(0));
    auto sched = accel::sched::linear_with_warmup(opt, 5, static_cast<std::int64_t>(loader->size()));
    acc.prepare(model, opt, *sched);
    torch::Tensor logged = torch::zeros({}, acc.device());
    int step = 0;
    for (auto& batch : *loader) {
      auto window = acc.accumulate(model);
      auto loss = torch::cross_entropy_loss(model(batch.data), batch.target);
      acc.backward(loss);
      acc.clip_grad_norm_(1.0);
      opt.step();
      sched->step();
      opt.zero_grad();
      logged += loss.detach();
      if (++step % 10 == 0) {
        acc.reduce(logged, accel::ReduceOp::Sum).item<double>();
        logged.zero_();
      }
    }
    sync();
    return seconds_since(t0);
  };
  auto trainer = [&] {
    const auto t0 = Clock::now();
    torch::manual_seed(0);
    fashion::Net model;
    accel::Trainer t(
        args, model, train_set,
        [&](auto& batch) { return torch::cross_entropy_loss(model(batch.data), batch.target); },
        accel::AcceleratorOptions().config(config));
    t.train();
    sync();
    return seconds_since(t0);
  };
  // Warm-up (allocator, thread pools), then interleaved rounds.
  hand();
  trainer();
  std::vector<double> h, t;
  for (int r = 0; r < rounds; ++r) {
    h.push_back(hand());
    t.push_back(trainer());
  }
  const double mh = median(h), mt = median(t);
  const double bh = *std::min_element(h.begin(), h.end()), bt = *std::min_element(t.begin(), t.end());
  std::cout << "trainer overhead on " << device << " (" << rounds << " rounds, " << steps
            << " steps of batch " << batch_size << ", 1 process): hand-written loop " << mh * 1000 / steps
            << " ms/step, Trainer " << mt * 1000 / steps << " ms/step, Trainer/hand " << mt / mh
            << " (median); fastest runs " << bh * 1000 / steps << " vs " << bt * 1000 / steps
            << " ms/step, Trainer/hand " << bt / bh << std::endl;
  return 0;
} catch (const std::exception& e) {
  std::cerr << "error: " << e.what() << std::endl;
  return 1;
}

}  // namespace bench_trainer_overhead
