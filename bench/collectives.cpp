// Reduce-scatter, all-gather and reduce on CPU ranks: ProcessGroupGloo's built-in collectives against the
// point-to-point ones of the Communicator (ACCEL_CPU_COLLECTIVES), with an all-reduce of the whole buffer as
// the reference, at several sizes; rank 0 prints medians and ratios. Both algorithms' results are compared.
//   accel-launch launch --cpu --num_processes 2 bench_collectives [--repeats 5] [--max-elements 21265930]
#include "bench_args.hpp"

#include <accel/distributed/communicator.hpp>
#include <accel/distributed/process_state.hpp>

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <memory>
#include <vector>

namespace bench_collectives {

using bench::median;

double time_ms(accel::Communicator& comm, const std::function<void()>& op) {
  comm.barrier();
  const auto start = std::chrono::steady_clock::now();
  op();
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
}

int run(int argc, char** argv) {
  int repeats = 5;
  std::int64_t max_elements = 21265930;  // the parameters of bench_zero_memory's MLP
  bench::Flags().add("--repeats", repeats).add("--max-elements", max_elements).parse(argc, argv);
  const auto state = accel::ProcessState::from_environment();
  auto comm = accel::Communicator::create(state, torch::kCPU);
  const int n = comm->world_size(), r = comm->rank();
  const auto base = comm->options();
  auto with = [&](accel::CpuCollectives algorithm) {
    auto o = base;
    o.cpu_collectives = algorithm;
    comm->set_options(o);
  };
  if (r == 0) {
    std::printf("%d ranks, %d thread(s) per rank, medians of %d\n\n", n, torch::get_num_threads(), repeats);
    std::printf(
        "| elements | all_reduce ms | reduce_scatter builtin ms | reduce_scatter p2p ms | speed-up | "
        "all_gather builtin ms | all_gather p2p ms | speed-up | reduce to owners builtin ms | p2p ms | "
        "speed-up | "
        "max difference |\n");
    std::printf("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
  }
  for (std::int64_t elements :
       {std::int64_t{1} << 14, std::int64_t{1} << 18, std::int64_t{1} << 22, max_elements}) {
    const auto shard = (elements + n - 1) / n;
    torch::manual_seed(r);
    const auto input = torch::randn({shard * n});
    const auto part = torch::randn({shard});
    std::vector<double> ar, rs_b, rs_p, ag_b, ag_p, rd_b, rd_p;
    torch::Tensor rs_out[2], ag_out[2], rd_out[2];
    for (int k = 0; k < repeats; ++k) {
      auto whole = input.clone();
      ar.push_back(time_ms(*comm, [&] { comm->all_reduce(whole, accel::ReduceOp::Sum); }));
      for (int a = 0; a < 2; ++a) {
        with(a == 0 ? accel::CpuCollectives::Builtin : accel::CpuCollectives::PointToPoint);
        rs_out[a] = torch::zeros({shard});
        ag_out[a] = torch::zeros({shard * n});
        (a == 0 ? rs_b : rs_p).push_back(time_ms(*comm, [&] {
          comm->reduce_scatter_async(rs_out[a], input)->wait();
        }));
        (a == 0 ? ag_b : ag_p).push_back(time_ms(*comm, [&] {
          comm->all_gather_async(ag_out[a], part)->wait();
        }));
        // ZeRO-2's reduction: each rank's part of a bucket to its owner (here: 1/N of the buffer to each).
        rd_out[a] = input.clone();
        (a == 0 ? rd_b : rd_p).push_back(time_ms(*comm, [&] {
          std::vector<std::unique_ptr<accel::CollectiveHandle>> works;
          for (int owner = 0; owner < n; ++owner)
            works.push_back(comm->reduce_async(rd_out[a].narrow(0, owner * shard, shard), owner));
          for (auto& w : works)
            w->wait();
        }));
      }
    }
    with(base.cpu_collectives);
    // All-gather moves bits; reductions over 3+ ranks may add in another order than Gloo does.
    const double rs_diff =
        std::max((rs_out[0] - rs_out[1]).abs().max().item<double>(),
                 (rd_out[0] - rd_out[1]).narrow(0, r * shard, shard).abs().max().item<double>());
    const bool equal = torch::equal(ag_out[0], ag_out[1]) && rs_diff <= 1e-5;
    if (r == 0) {
      std::printf(
          "| %lld | %.2f | %.2f | %.2f | %.2fx | %.2f | %.2f | %.2fx | %.2f | %.2f | %.2fx | %.1e |\n",
          static_cast<long long>(shard * n), median(ar), median(rs_b), median(rs_p),
          median(rs_b) / median(rs_p), median(ag_b), median(ag_p), median(ag_b) / median(ag_p), median(rd_b),
          median(rd_p), median(rd_b) / median(rd_p), rs_diff);
    }
    if (!equal) {
      std::fprintf(stderr, "rank %d: the two algorithms disagree (max difference %.1e)\n", r, rs_diff);
      return 1;
    }
  }
  return 0;
}

}  // namespace bench_collectives
