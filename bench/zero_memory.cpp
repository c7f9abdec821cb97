// Step time and per-rank memory of one backend on a model large enough to matter (~21 M parameters, Adam),
// run under accel-launch; bench/zero_bench.py runs it for DDP and each ZeRO stage side by side.
//
//   accel-launch launch --config_file config_templates/zero_stage2.yaml build/bench/bench_zero_memory --steps
//   10
#include <accel/accelerator/accelerator.hpp>

#include "bench_args.hpp"

#include <torch/torch.h>

#include <chrono>
#include <cstdio>

namespace bench_zero_memory {

int run(int argc, char** argv) try {
  int steps = 10, warmup = 2;
  std::int64_t width = 2304;
  bench::Flags().add("--steps", steps).add("--warmup", warmup).add("--width", width).parse(argc, argv);
  accel::CpuMemoryCounter::install();  // peak bytes of the timed steps (parameters, activations, buffers,
                                       // data)
  torch::manual_seed(0);
  torch::nn::Sequential model;
  for (int l = 0; l < 4; ++l) {
    model->push_back(torch::nn::Linear(width, width));
    model->push_back(torch::nn::ReLU());
  }
  model->push_back(torch::nn::Linear(width, 10));
  std::int64_t params = 0;
  for (const auto& p : model->parameters())
    params += p.numel();
  torch::optim::Adam optimizer(model->parameters(), torch::optim::AdamOptions(1e-4));
  accel::Accelerator accelerator;
  accelerator.prepare(model, optimizer);
  const std::int64_t batch = 32;
  const auto n = static_cast<std::size_t>((steps + warmup) * batch * accelerator.num_processes());
  auto x = torch::randn({static_cast<std::int64_t>(n), width});
  auto y = torch::randint(0, 10, {static_cast<std::int64_t>(n)});
  auto loader = accelerator.prepare_data_loader<torch::data::samplers::SequentialSampler>(
      torch::data::datasets::TensorDataset(torch::cat({x, y.unsqueeze(1).to(torch::kFloat32)}, 1))
          .map(torch::data::transforms::Stack<torch::data::TensorExample>()),
      static_cast<std::size_t>(batch));
  using Clock = std::chrono::steady_clock;
  Clock::time_point start;
  int step = 0;
  accel::MemoryReport after_step;
  // Where the step time goes, on this rank (no barriers in between, so waiting for the peer counts where it
  // happens): forward and loss; backward, including the gradient reduction the backend does in it;
  // optimizer.step(); the parameter all-gather of ZeRO-1/2 and SHARD_GRAD_OP (otherwise done at the next
  // forward; stage 3 gathers units inside forward and backward).
  double phase_ms[4] = {0, 0, 0, 0};
  auto lap = [](Clock::time_point& t) {
    const auto now = Clock::now();
    const double ms = std::chrono::duration<double, std::milli>(now - t).count();
    t = now;
    return ms;
  };
  for (auto& b : *loader) {
    if (step == warmup) {
      accelerator.wait_for_everyone();
      accel::CpuMemoryCounter::reset_peak();
      accelerator.communicator().reset_counters();  // bytes of the timed steps
      start = Clock::now();
      for (double& p : phase_ms)
        p = 0;
    }
    const auto inputs = b.data.narrow(1, 0, width), targets = b.data.select(1, width).to(torch::kLong);
    auto t = Clock::now();
    optimizer.zero_grad();
    auto loss = torch::cross_entropy_loss(model->forward(inputs), targets);
    phase_ms[0] += lap(t);
    accelerator.backward(loss);
    phase_ms[1] += lap(t);
    optimizer.step();
    phase_ms[2] += lap(t);
    accelerator.sync_parameters();
    phase_ms[3] += lap(t);
    after_step = accelerator.memory_report();  // gradients and optimizer state both present
    ++step;
  }
  const auto& comm = accelerator.communicator();
  const double timed = step - warmup;
  // Bytes this rank sent per step (the ring volume the Communicator counts), by collective kind.
  const double all_reduce_wire = comm.bytes(accel::Collective::AllReduce).wire / timed;
  const double reduce_wire =
      (comm.bytes(accel::Collective::ReduceScatter).wire + comm.bytes(accel::Collective::Reduce).wire) /
      timed;
  const double gather_wire = comm.bytes(accel::Collective::AllGather).wire / timed;
  accelerator.wait_for_everyone();
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  if (accelerator.is_main_process()) {
    std::printf(
        "{\"bytes\": true, \"backend\": \"%s\", \"world\": %d, \"all_reduce_wire\": %.0f, "
        "\"reduce_wire\": %.0f, \"all_gather_wire\": %.0f}\n",
        accelerator.backend_name().c_str(), accelerator.num_processes(), all_reduce_wire, reduce_wire,
        gather_wire);
    std::printf(
        "{\"backend\": \"%s\", \"world\": %d, \"parameters\": %lld, \"step_ms\": %.2f, \"param_bytes\": "
        "%llu, "
        "\"grad_bytes\": %llu, \"optimizer_bytes\": %llu, \"total_bytes\": %llu, \"peak_bytes\": %llu, "
        "\"forward_ms\": %.2f, \"backward_ms\": %.2f, \"optimizer_ms\": %.2f, \"gather_ms\": %.2f}\n",
        accelerator.backend_name().c_str(), accelerator.num_processes(), static_cast<long long>(params),
        seconds / (step - warmup) * 1e3, static_cast<unsigned long long>(after_step.parameters),
        static_cast<unsigned long long>(after_step.gradients),
        static_cast<unsigned long long>(after_step.optimizer_state),
        static_cast<unsigned long long>(after_step.total()),
        static_cast<unsigned long long>(accel::CpuMemoryCounter::peak()), phase_ms[0] / (step - warmup),
        phase_ms[1] / (step - warmup), phase_ms[2] / (step - warmup), phase_ms[3] / (step - warmup));
  }
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "error: %s\n", e.what());
  return 1;
}

}  // namespace bench_zero_memory
