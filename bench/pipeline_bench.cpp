// Pipeline parallelism: the measured bubble of each stage against (p-1)/(m+p-1) and simulate(), and the
// activation memory each stage holds against the schedule's bound, for GPipe and 1F1B over several
// micro-batch counts. Run under accel-launch, one process per stage (rank r runs stage r):
//
//   OMP_NUM_THREADS=1 accel-launch launch --cpu --num_processes 2 build/bench/bench_pipeline [--json 1]
//
// (BENCHMARKS.md, "Pipeline parallelism: bubble and activation memory", has the figures for 1-4 stages.)
//
// The model is `--layers` equal blocks Linear(width, width) + ReLU, cut into stages by parameter count;
// every step runs one batch of `--batch` rows. Per stage and configuration, over `--repeats` timed steps
// (after `--warmup`), medians of: the step's wall time (from a barrier to the end of train_step, which ends
// with the loss broadcast, so every stage sees the whole pipeline's makespan), the time the stage computed
// (its layers' forward and backward, the loss on the last stage; PipelineEngine::last_step_stats) and the
// time it was blocked in receives and in its final wait on sends. Bubble = 1 - compute / step.
//
// Activation memory: the engine's peak of micro-batch boundary tensors held for backward, and the peak of
// every byte LibTorch allocated on the CPU during the step above what was allocated before it
// (CpuMemoryCounter), against the schedule's bound: live micro-batches (1F1B min(p - s, m), GPipe m) times
// one micro-batch's bytes on this stage (its input, except on stage 0 where it is part of the caller's
// batch, plus what the forward keeps for backward, measured once).
//
// Rank 0 also times the whole model in one process on the same batch (one forward and backward, no
// micro-batches) while the other ranks wait: the reference for the speedup.
#include <accel/distributed/communicator.hpp>
#include <accel/distributed/process_state.hpp>
#include <accel/monitor/memory.hpp>
#include <accel/parallel/pipeline.hpp>

#include "bench_args.hpp"

#include <fmt/format.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

namespace bench_pipeline {

using namespace accel::pipeline;
using Clock = std::chrono::steady_clock;

using bench::median;

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

torch::nn::Sequential make_model(int layers, std::int64_t width) {
  torch::manual_seed(0);
  torch::nn::Sequential model;
  for (int l = 0; l < layers; ++l) {
    model->push_back(torch::nn::Linear(width, width));
    model->push_back(torch::nn::ReLU());
  }
  return model;
}

torch::Tensor mse(const torch::Tensor& out, const torch::Tensor& y) {
  return torch::mse_loss(out, y);
}

void zero_grads(const std::vector<torch::Tensor>& params) {
  // In place: the gradients stay allocated, so the step's memory peak is activations and buffers only.
  for (const auto& p : params)
    if (p.grad().defined()) p.mutable_grad().zero_();
}

// Per stage and configuration, gathered on rank 0.
enum Field {
  kStep,
  kCompute,
  kWait,
  kPeakLive,
  kBoundaryBytes,
  kHeapBytes,
  kMicroBatchBytes,
  kBoundaryPerMicroBatch,
  kFields
};

int run(int argc, char** argv) try {
  int layers = 12, repeats = 5, warmup = 2, json = 0;
  std::int64_t width = 256, batch = 2048;
  bench::Flags()
      .add("--layers", layers)
      .add("--width", width)
      .add("--batch", batch)
      .add("--repeats", repeats)
      .add("--warmup", warmup)
      .add("--json", json)
      .parse(argc, argv);
  accel::CpuMemoryCounter::install();
  accel::CommunicatorOptions options;
  options.timeout = std::chrono::minutes(5);
  auto comm = accel::Communicator::create(accel::ProcessState::from_environment(), torch::kCPU, options);
  const int r = comm->rank(), p = comm->world_size(), last = p - 1;
  const std::vector<int> micro_batch_counts = {2, 4, 8, 16};
  for (int m : micro_batch_counts) {
    if (batch % m != 0) {
      throw std::invalid_argument(fmt::format("--batch {} must be a multiple of {}", batch, m));
    }
  }

  auto model = make_model(layers, width);
  PipelineStage stage(model, r, p);
  const auto params = stage.parameters();
  const auto x = torch::randn({batch, width}), y = torch::randn({batch, width});

  // Reference: the whole model in one process on the same batch, timed on rank 0 alone.
  double whole_s = 0;
  if (r == 0) {
    auto whole = make_model(layers, width);
    std::vector<double> times;
    for (int i = 0; i < warmup + repeats; ++i) {
      const auto t = Clock::now();
      mse(whole->forward(x), y).backward();
      if (i >= warmup) times.push_back(seconds_since(t));
    }
    whole_s = median(times);
  }
  comm->barrier();

  std::string text, json_rows;
  if (r == 0) {
    text += fmt::format(
        "pipeline bench: {} stages, {} x (Linear({}, {}) + ReLU), batch {}, {} threads per process, "
        "median of {} steps; whole model in one process: {:.1f} ms per step\n",
        p, layers, width, width, batch, torch::get_num_threads(), repeats, whole_s * 1e3);
    text += fmt::format(
        "{:<6} {:>3} {:>5} {:>9} {:>9} {:>8} {:>7} {:>7} {:>7} {:>8} {:>5} {:>5} {:>10} {:>10} "
        "{:>10} {:>10}\n",
        "sched", "m", "stage", "step ms", "busy ms", "wait ms", "bubble", "theory", "sim", "speedup", "live",
        "bound", "bndry KiB", "bound KiB", "heap KiB", "bound KiB");
  }
  for (Schedule schedule : {Schedule::GPipe, Schedule::OneFOneB}) {
    for (int m : micro_batch_counts) {
      PipelineEngine engine(stage, comm, schedule, m);
      const std::int64_t rows = batch / m;
      // One micro-batch's bytes on this stage: its input and what the forward keeps for backward.
      double micro_batch_bytes = 0;
      {
        auto in = torch::randn({rows, width}).requires_grad_(r > 0);
        const auto before = accel::CpuMemoryCounter::current();
        auto out = stage.forward(in);
        // Stage 0's input is a slice of the caller's batch, allocated before the step.
        micro_batch_bytes =
            static_cast<double>(accel::CpuMemoryCounter::current() - before + (r > 0 ? in.nbytes() : 0));
      }
      std::vector<double> step, compute, wait;
      double heap = 0;
      PipelineEngine::StepStats stats;
      for (int i = 0; i < warmup + repeats; ++i) {
        zero_grads(params);
        comm->barrier();
        const auto base = accel::CpuMemoryCounter::current();
        accel::CpuMemoryCounter::reset_peak();
        const auto t = Clock::now();
        engine.train_step(r == 0 ? x : torch::Tensor(), r == last ? y : torch::Tensor(), mse);
        const double s = seconds_since(t);
        if (i < warmup) continue;
        stats = engine.last_step_stats();
        step.push_back(s);
        compute.push_back(stats.compute_s);
        wait.push_back(stats.wait_s);
        heap = std::max(heap, static_cast<double>(accel::CpuMemoryCounter::peak() - base));
      }
      const double boundary_per_micro_batch = static_cast<double>(rows * width * 4 * 2);
      auto mine =
          torch::tensor({median(step), median(compute), median(wait), static_cast<double>(stats.peak_live),
                         static_cast<double>(stats.peak_activation_bytes), heap, micro_batch_bytes,
                         boundary_per_micro_batch},
                        torch::kFloat64);
      const auto all = comm->all_gather(mine).view({p, kFields});
      if (r != 0) continue;
      const auto sim = simulate(make_schedule(schedule, p, m));
      const double theory = static_cast<double>(p - 1) / (m + p - 1);
      const auto a = all.accessor<double, 2>();
      double makespan = 0;
      for (int s = 0; s < p; ++s)
        makespan = std::max(makespan, a[s][kStep]);
      for (int s = 0; s < p; ++s) {
        const int bound = schedule == Schedule::GPipe ? m : std::min(p - s, m);
        const double bubble = 1 - a[s][kCompute] / a[s][kStep];
        const double sim_bubble = 1 - sim.busy[static_cast<std::size_t>(s)] / sim.makespan;
        const double speedup = whole_s / makespan;
        text += fmt::format(
            "{:<6} {:>3} {:>5} {:>9.1f} {:>9.1f} {:>8.1f} {:>7.3f} {:>7.3f} {:>7.3f} {:>8.2f} {:>5} {:>5} "
            "{:>10.0f} {:>10.0f} {:>10.0f} {:>10.0f}\n",
            to_string(schedule), m, s, a[s][kStep] * 1e3, a[s][kCompute] * 1e3, a[s][kWait] * 1e3, bubble,
            theory, sim_bubble, speedup, static_cast<int>(a[s][kPeakLive]), bound,
            a[s][kBoundaryBytes] / 1024, bound * a[s][kBoundaryPerMicroBatch] / 1024, a[s][kHeapBytes] / 1024,
            bound * a[s][kMicroBatchBytes] / 1024);
        json_rows += fmt::format(
            "{}{{\"stages\": {}, \"schedule\": \"{}\", \"micro_batches\": {}, \"stage\": {}, \"step_ms\": "
            "{:.3f}, \"busy_ms\": {:.3f}, \"wait_ms\": {:.3f}, \"bubble\": {:.4f}, \"theory\": {:.4f}, "
            "\"simulated\": {:.4f}, \"whole_model_ms\": {:.3f}, \"speedup\": {:.3f}, \"peak_live\": {}, "
            "\"live_bound\": {}, \"boundary_bytes\": {:.0f}, \"boundary_bound_bytes\": {:.0f}, "
            "\"heap_bytes\": {:.0f}, \"heap_bound_bytes\": {:.0f}}}",
            json_rows.empty() ? "" : ",\n  ", p, to_string(schedule), m, s, a[s][kStep] * 1e3,
            a[s][kCompute] * 1e3, a[s][kWait] * 1e3, bubble, theory, sim_bubble, whole_s * 1e3, speedup,
            static_cast<int>(a[s][kPeakLive]), bound, a[s][kBoundaryBytes],
            bound * a[s][kBoundaryPerMicroBatch], a[s][kHeapBytes], bound * a[s][kMicroBatchBytes]);
      }
    }
  }
  if (r == 0) std::fputs(json ? ("[\n  " + json_rows + "\n]\n").c_str() : text.c_str(), stdout);
  comm->barrier();
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "bench_pipeline: %s\n", e.what());
  return 1;
}

}  // namespace bench_pipeline
