#pragma once
// Flat-vector sharding of parameters and optimizer state: each rank's slice of a flat vector, its layout,
// and the checks and notes for an optimizer stepped on such slices.

#include <accel/backend/backend.hpp>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace accel::backends::detail {

/// The communicators a sharding engine works over. `shard` splits parameters, gradients and optimizer state:
/// every rank of the engine's group, or under hybrid sharding the ranks of one shard group (a machine, or
/// fsdp_hybrid_shard_size consecutive ranks); `across` (hybrid
/// only) joins the ranks of the other machines that hold the same shard, over which each reduced gradient
/// shard is all-reduced. Shard groups are consecutive ranks, so gathering a flat vector over the whole group
/// still yields it first (checkpoint consolidation relies on that).
struct ShardGroups {
  Communicator* shard = nullptr;
  std::shared_ptr<Communicator> shard_owner;  ///< keeps a split-off `shard` alive (null: the engine's own)
  std::shared_ptr<Communicator> across;       ///< null without hybrid sharding (or on one machine)
  /// ZeRO++ hpZ: groups of consecutive ranks of `shard` holding the secondary copy (null: off).
  std::shared_ptr<Communicator> secondary;
  /// Ranks holding each shard: the shard groups under hybrid sharding, else 1.
  int copies() const { return across ? across->world_size() : 1; }
};
/// `comm` itself, or with `hybrid` its ranks split into shard groups and across groups (collective): groups
/// of `group_size` consecutive ranks of `comm`, or with 0 the ranks of each machine
/// (ProcessState::local_world_size ranks each, node-major as every launcher numbers them). UsageError naming
/// `who` when the machines hold different numbers of the group's ranks, or `group_size` does not divide them.
ShardGroups shard_groups(Communicator& comm, bool hybrid, int group_size, const std::string& who);
/// ZeRO++ hpZ's secondary groups (collective): `shard`'s ranks in groups of `size` consecutive ones, their
/// traffic counted into `counted`; null when `size` is 1 or covers every rank of `shard` (a note says so).
/// UsageError naming `who` when `size` does not divide them.
std::shared_ptr<Communicator> secondary_groups(Communicator& shard, int size, const std::string& who,
                                               Communicator& counted);

/// The position of `p` (the same tensor, not an equal one) in `params`; UsageError naming `who` if absent.
std::size_t parameter_index(const std::vector<torch::Tensor>& params, const torch::Tensor& p,
                            const std::string& who);
/// ceil(numel / world), at least 1: the elements of each rank's slice of a flat vector.
std::int64_t shard_size(std::int64_t numel, int world);
/// This rank's slice [rank * shard, (rank + 1) * shard) of the zero-padded concatenation of the (flattened)
/// `params[indices[m]]` placed at `offsets[m]`, as a new tensor (in CPU memory when `to_cpu`).
torch::Tensor flat_slice(const std::vector<torch::Tensor>& params, const std::vector<std::size_t>& indices,
                         const std::vector<std::int64_t>& offsets, std::int64_t shard,
                         const Communicator& comm, bool to_cpu = false);
/// The checks every sharded backend makes before re-pointing an optimizer at flat slices: the model was
/// prepared first and the optimizer has no state yet. UsageError naming `who`.
void check_shardable_optimizer(const torch::nn::Module* model, const torch::optim::Optimizer& optimizer,
                               const std::string& who);
/// The layout of a flat vector made of `params[indices[m]]` (named `names[indices[m]]`) at `offsets[m]`,
/// sharded `shard` elements per rank.
OptimizerTensorLayout flat_layout(const std::vector<std::string>& names,
                                  const std::vector<torch::Tensor>& params,
                                  const std::vector<std::size_t>& indices,
                                  const std::vector<std::int64_t>& offsets, std::int64_t shard,
                                  const Communicator& comm);
/// The layouts of `optimizer`'s tensors, in order, looked up among `known` (master tensor, layout) pairs;
/// UsageError naming `who` for a tensor the backend did not create.
std::vector<OptimizerTensorLayout> layouts_for(
    const torch::optim::Optimizer& optimizer,
    const std::vector<std::pair<torch::Tensor, OptimizerTensorLayout>>& known, const std::string& who);
/// The note for an optimizer stepped on CPU-offloaded shards (`key`: the config key that offloads) when it is
/// LibTorch's unfused AdamW / Adam / SGD: names the accel::optim drop-in (DeepSpeed's CPU-Adam role). Empty
/// otherwise.
std::vector<std::string> offload_step_notices(const std::string& key,
                                              const torch::optim::Optimizer& optimizer);

}  // namespace accel::backends::detail
