#include "flat_shards.hpp"

#include <accel/errors.hpp>
#include <accel/optim/optim.hpp>

#include <fmt/format.h>

#include <algorithm>
#include <iostream>
#include <map>

namespace accel::backends::detail {

ShardGroups shard_groups(Communicator& comm, bool hybrid, int group_size, const std::string& who) {
  ShardGroups g;
  g.shard = &comm;
  if (!hybrid || comm.world_size() == 1) return g;
  if (group_size > 0 && comm.world_size() % group_size != 0) {
    throw UsageError(fmt::format(
        "{}: fsdp_hybrid_shard_size (parallelism_config's dp_shard_size) {} does not divide the {} "
        "data-parallel ranks; choose a divisor of {}",
        who, group_size, comm.world_size(), comm.world_size()));
  }
  const int per_machine = std::max(comm.state().local_world_size, 1);
  std::map<int, std::vector<int>> machines;  // shard group (a machine) -> this group's ranks in it, in order
  for (int r = 0; r < comm.world_size(); ++r) {
    machines[group_size > 0 ? r / group_size : comm.job_ranks()[static_cast<std::size_t>(r)] / per_machine]
        .push_back(r);
  }
  if (machines.size() == 1) return g;  // one machine: hybrid sharding is plain sharding over it
  std::vector<std::vector<int>> shards;
  for (auto& [machine, ranks] : machines) {
    if (!shards.empty() && ranks.size() != shards.front().size()) {
      throw UsageError(fmt::format(
          "{}: hybrid sharding needs the same number of ranks on every machine; machine {} holds {} of them "
          "and machine {} holds {} (num_processes must be num_machines x the processes per machine)",
          who, machines.begin()->first, shards.front().size(), machine, ranks.size()));
    }
    shards.push_back(ranks);
  }
  std::vector<std::vector<int>> across(shards.front().size());
  for (const auto& ranks : shards) {
    for (std::size_t i = 0; i < ranks.size(); ++i)
      across[i].push_back(ranks[i]);
  }
  g.shard_owner = comm.split(shards);
  g.shard = g.shard_owner.get();
  g.across = comm.split(across);
  // The engine's traffic shows in `comm`'s counters as without hybrid sharding: the all-reduces there are
  // then exactly what crosses machines.
  g.shard_owner->count_into(&comm);
  g.across->count_into(&comm);
  return g;
}

std::shared_ptr<Communicator> secondary_groups(Communicator& shard, int size, const std::string& who,
                                               Communicator& counted) {
  const int n = shard.world_size();
  if (size <= 1 || n == 1) return nullptr;
  if (size >= n) {
    if (shard.rank() == 0) {
      std::cerr << fmt::format(
          "accelerate-cpp: note: zero_optimization.zero_hpz_partition_size {} covers all {} ranks the "
          "parameters are sharded over: the secondary copy would be the primary one, so hpZ is off (it pays "
          "off with several machines: the ranks of one machine)\n",
          size, n);
    }
    return nullptr;
  }
  if (n % size != 0) {
    throw UsageError(fmt::format(
        "{}: zero_optimization.zero_hpz_partition_size {} does not divide the {} ranks the parameters are "
        "sharded over; use a divisor of {} (DeepSpeed's choice: the ranks of one machine)",
        who, size, n, n));
  }
  std::vector<std::vector<int>> groups(static_cast<std::size_t>(n / size));
  for (int r = 0; r < n; ++r)
    groups[static_cast<std::size_t>(r / size)].push_back(r);
  auto secondary = shard.split(groups);
  secondary->count_into(&counted);
  return secondary;
}

std::size_t parameter_index(const std::vector<torch::Tensor>& params, const torch::Tensor& p,
                            const std::string& who) {
  for (std::size_t i = 0; i < params.size(); ++i) {
    if (params[i].unsafeGetTensorImpl() == p.unsafeGetTensorImpl()) return i;
  }
  throw UsageError(
      fmt::format("{}: the optimizer holds a tensor that is not a parameter of the prepared model", who));
}

std::int64_t shard_size(std::int64_t numel, int world) {
  return std::max<std::int64_t>(1, (numel + world - 1) / world);
}

torch::Tensor flat_slice(const std::vector<torch::Tensor>& params, const std::vector<std::size_t>& indices,
                         const std::vector<std::int64_t>& offsets, std::int64_t shard,
                         const Communicator& comm, bool to_cpu) {
  torch::NoGradGuard no_grad;
  const auto& first = params[indices.front()];
  auto flat = torch::zeros({shard * comm.world_size()}, first.options().requires_grad(false));
  for (std::size_t m = 0; m < indices.size(); ++m) {
    const auto& p = params[indices[m]];
    flat.narrow(0, offsets[m], p.numel()).copy_(p.detach().reshape({-1}));
  }
  auto slice = flat.narrow(0, comm.rank() * shard, shard).clone();
  return to_cpu ? slice.to(torch::kCPU) : slice;
}

void check_shardable_optimizer(const torch::nn::Module* model, const torch::optim::Optimizer& optimizer,
                               const std::string& who) {
  if (model == nullptr) {
    throw UsageError(
        fmt::format("{}: prepare the model before (or together with) its optimizer: "
                    "accelerator.prepare(model, optimizer)",
                    who));
  }
  if (!optimizer.state().empty()) {
    throw UsageError(
        fmt::format("{}: the optimizer already has state (it has stepped); prepare it before the first "
                    "optimizer.step() so that its state can be sharded",
                    who));
  }
}

OptimizerTensorLayout flat_layout(const std::vector<std::string>& names,
                                  const std::vector<torch::Tensor>& params,
                                  const std::vector<std::size_t>& indices,
                                  const std::vector<std::int64_t>& offsets, std::int64_t shard,
                                  const Communicator& comm) {
  OptimizerTensorLayout l;
  for (std::size_t m = 0; m < indices.size(); ++m)
    l.pieces.push_back({names[indices[m]], offsets[m], params[indices[m]].numel()});
  l.flat_numel = shard * comm.world_size();
  l.begin = shard * comm.rank();
  l.length = shard;
  return l;
}

std::vector<OptimizerTensorLayout> layouts_for(
    const torch::optim::Optimizer& optimizer,
    const std::vector<std::pair<torch::Tensor, OptimizerTensorLayout>>& known, const std::string& who) {
  std::vector<OptimizerTensorLayout> out;
  for (const auto& pg : optimizer.param_groups()) {
    for (const auto& t : pg.params()) {
      const auto it = std::find_if(known.begin(), known.end(), [&](const auto& k) {
        return k.first.unsafeGetTensorImpl() == t.unsafeGetTensorImpl();
      });
      if (it == known.end()) {
        throw UsageError(
            fmt::format("{}: the optimizer holds a tensor this backend did not create; prepare it with "
                        "accelerator.prepare",
                        who));
      }
      out.push_back(it->second);
    }
  }
  return out;
}

std::vector<std::string> offload_step_notices(const std::string& key,
                                              const torch::optim::Optimizer& optimizer) {
  const auto fused = optim::fused_replacement(optimizer);
  if (!fused) return {};
  const std::string kind = fused->substr(fused->rfind(':') + 1);
  // Speed-ups measured by bench_optim on a 21M-parameter MLP (BENCHMARKS.md).
  const char* gain = kind == "SGD" ? "the fused CPU step, about 2x faster per step"
                                   : "the fused CPU step (DeepSpeed's CPU-Adam role), 4-11x faster per step";
  return {fmt::format(
      "{}: torch::optim::{} steps the CPU shard with LibTorch's unfused update (several operators and "
      "temporaries per tensor); {} (#include <accel/optim/optim.hpp>: same options and state names, "
      "checkpoints load both ways) is {} in bench_optim (BENCHMARKS.md)",
      key, kind, *fused, gain)};
}

}  // namespace accel::backends::detail
