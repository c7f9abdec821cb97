// Data-parallel throughput of accelerate-cpp: the Fashion-MNIST CNN trained with per-rank batch B for a fixed
// number of steps, under accel-launch (any number of ranks). Rank 0 prints one JSON line that
// bench/ddp_bench.py compares with PyTorch DDP and Hugging Face Accelerate running the same model and data.
//
//   accel-launch launch --cpu --num_processes 2 build/bench/bench_ddp_throughput --steps 60 --batch-size 64
//
// With --overlap-steps K (K >= 1, several ranks), after the timed steps it measures how much of DDP's
// gradient all-reduce is hidden behind backward, K times on the last batch, each time three ways in rotated
// order, every one started after a barrier:
//   backward alone:  forward and accelerator.backward(loss) under no_sync (no communication at all);
//   all-reduce:      the all-reduce of buffers the sizes of DDP's buckets (same plan, same caps), launched
//                    back to back and waited for, without any backward;
//   synced backward: forward and accelerator.backward(loss) as in training (backward, bucket all-reduces,
//                    the wait for them).
// Each measurement is the slowest rank's time (a synced step waits for the slowest rank); hidden =
// 1 - (synced - alone) / all-reduce, clamped to [0, 1], from the medians of the K measurements.
// Copies into and out of the buckets count as exposed communication. The timed steps are unaffected.
#include <accel/accelerator/accelerator.hpp>

#include "../backends/common/buckets.hpp"
#include "bench_args.hpp"

#include "../examples/fashion_mnist/fashion_mnist.hpp"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace bench_ddp_throughput {

using Clock = std::chrono::steady_clock;

using bench::median;

double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

struct Overlap {
  double backward_ms = 0, allreduce_ms = 0, synced_ms = 0, hidden = 0;
};

// See the file comment. `model` is prepared with the ddp backend; `data`/`target` one per-rank batch.
Overlap measure_overlap(accel::Accelerator& accelerator, fashion::Net& model,
                        torch::optim::Optimizer& optimizer, const torch::Tensor& data,
                        const torch::Tensor& target, int repeats) {
  const auto& config = accelerator.config();
  const auto mib = [](double mb) { return static_cast<std::uint64_t>(mb * 1024 * 1024); };
  std::vector<torch::Tensor> params;
  std::vector<std::uint64_t> bytes;
  for (const auto& p : model->parameters()) {
    if (!p.requires_grad()) continue;
    params.push_back(p);
    bytes.push_back(static_cast<std::uint64_t>(p.nbytes()));
  }
  std::vector<torch::Tensor> buffers;
  for (const auto& members : accel::backends::detail::plan_buckets(bytes, mib(config.ddp_first_bucket_cap_mb),
                                                                   mib(config.ddp_bucket_cap_mb))) {
    std::int64_t numel = 0;
    for (auto i : members)
      numel += params[i].numel();
    buffers.push_back(torch::zeros({numel}, params.front().options().requires_grad(false)));
  }
  auto& comm = accelerator.communicator();
  // Forward and backward from the barrier on, so that a rank waiting for a slower peer's forward is not
  // counted as communication.
  const auto backward_once = [&](bool sync) {
    optimizer.zero_grad();
    const auto t0 = Clock::now();
    auto loss = torch::cross_entropy_loss(model(data), target);
    if (sync) {
      accelerator.backward(loss);
    } else {
      auto no_sync = accelerator.no_sync(model);
      accelerator.backward(loss);
    }
    return ms_since(t0);
  };
  const auto allreduce_once = [&] {
    const auto t0 = Clock::now();
    std::vector<std::unique_ptr<accel::CollectiveHandle>> work;
    for (auto& b : buffers)
      work.push_back(comm.all_reduce_async({b}));
    for (auto& w : work)
      w->wait();
    return ms_since(t0);
  };
  // Each measurement is the slowest rank's (every rank waits for it in a synced step), exchanged untimed.
  const auto slowest = [&](double ms) {
    auto t = torch::tensor({ms}, torch::kFloat64);
    comm.all_reduce(t, accel::ReduceOp::Max);
    return t.item<double>();
  };
  std::vector<double> alone, reduce, synced;
  const std::vector<std::function<void()>> kinds = {
      [&] { alone.push_back(slowest(backward_once(false))); },
      [&] { reduce.push_back(slowest(allreduce_once())); },
      [&] { synced.push_back(slowest(backward_once(true))); },
  };
  for (int r = 0; r < repeats; ++r) {
    for (std::size_t k = 0; k < kinds.size(); ++k) {
      accelerator.wait_for_everyone();
      kinds[(k + static_cast<std::size_t>(r)) % kinds.size()]();
    }
  }
  optimizer.zero_grad();
  Overlap o;
  o.backward_ms = median(alone);
  o.allreduce_ms = median(reduce);
  o.synced_ms = median(synced);
  o.hidden = std::clamp(1.0 - (o.synced_ms - o.backward_ms) / o.allreduce_ms, 0.0, 1.0);
  return o;
}

int run(int argc, char** argv) try {
  int steps = 60, warmup = 10;
  int overlap_steps = 0;
  std::size_t batch_size = 64;
  bench::Flags()
      .add("--steps", steps)
      .add("--warmup", warmup)
      .add("--batch-size", batch_size)
      .add("--overlap-steps", overlap_steps)
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

  Clock::time_point start;
  double first_step_unix_ms = 0;
  std::uint64_t bytes_start = 0;
  int step = 0;
  torch::Tensor last_data, last_target;
  for (auto& batch : *loader) {
    last_data = batch.data;
    last_target = batch.target;
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
  std::string overlap = "null";
  if (overlap_steps > 0 && w > 1) {
    const auto o = measure_overlap(accelerator, model, optimizer, last_data, last_target, overlap_steps);
    char buf[256];
    std::snprintf(buf, sizeof buf,
                  "{\"backward_ms\": %.3f, \"allreduce_ms\": %.3f, \"backward_synced_ms\": %.3f, "
                  "\"hidden_fraction\": %.3f, \"repeats\": %d}",
                  o.backward_ms, o.allreduce_ms, o.synced_ms, o.hidden, overlap_steps);
    overlap = buf;
  }
  if (accelerator.is_main_process()) {
    std::printf(
        "{\"impl\": \"accelerate-cpp\", \"world\": %d, \"threads\": %d, \"batch_per_rank\": %zu, \"steps\": "
        "%d, "
        "\"samples_per_s\": %.1f, \"step_ms\": %.3f, \"wire_bytes_per_step\": %.1f, "
        "\"theory_bytes_per_step\": %.1f, \"first_step_unix_ms\": %.1f, \"overlap\": %s}\n",
        w, torch::get_num_threads(), batch_size, timed, timed * batch_size * w / seconds,
        seconds / timed * 1e3, static_cast<double>(wire) / timed, 2.0 * params * (w - 1) / w,
        first_step_unix_ms, overlap.c_str());
  }
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "error: %s\n", e.what());
  return 1;
}

}  // namespace bench_ddp_throughput
