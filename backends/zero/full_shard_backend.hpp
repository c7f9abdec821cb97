#pragma once
/// \file full_shard_backend.hpp
/// ZeRO stage 3 and FSDP FULL_SHARD: parameters, gradients and optimizer state sharded.
///
/// - The model is cut into units (auto-wrap policy). Each unit's parameters of one optimizer group form a
/// flat
///   vector padded to a multiple of N; rank r keeps the slice [r*S, (r+1)*S) as the tensor the user's
///   optimizer updates, and the parameters' own storages are freed: at rest a rank holds P/N parameters.
/// - A unit is gathered just before an operator uses one of its parameters (forward, or a saved tensor in
///   backward) and released again when another unit is needed, with the next unit prefetched asynchronously
///   in the order recorded during the first forward (reverse order in backward, skipping units that the first
///   backward never used and that train nothing: a frozen embedding). The user's model code does
///   not change: a process-wide at::RecordFunction callback spots operator inputs whose storage belongs to a
///   freed parameter (see docs/zero3_design.md for the mechanism and its pitfalls).
/// - Gradients are accumulated into the unit's flat gradient as backward produces them, and the complete
///   flat gradient is reduce-scattered (asynchronously) into the owner's shard.
/// - Frozen parameters (requires_grad false at prepare: a LoRA model's base, a frozen teacher) are sharded
///   too, as DeepSpeed's ZeRO-3 and FSDP shard them: each unit's frozen parameters form flat vectors of their
///   own, gathered with the unit, never reduced, in no optimizer (an optimizer handed them leaves them out,
///   as DeepSpeed's does) and outside gradient norms.
/// Communication per step: all-gather in forward, again in backward, and one reduce-scatter: 1.5 x DDP.

#include <accel/backend/backend.hpp>

#include "../common/nvme_tier.hpp"
#include "../common/unit_plan.hpp"

#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace accel::backends {

/// Options of the fully sharded backend.
struct FullShardOptions {
  std::string name = "zero";  ///< reported by name() and in messages ("zero" or "fsdp")
  UnitPolicy policy = UnitPolicy::PerModule;
  std::int64_t min_num_params = 100000000;  ///< SizeBased threshold
  std::vector<std::string> wrap_classes;    ///< ClassBased names (`name()` of the module, with or without
                                            ///< namespace and `Impl`)
  bool forward_prefetch = true;             ///< gather the next unit while the current one computes (forward)
  bool backward_prefetch = true;            ///< the same in backward
  bool offload = false;                     ///< shards (and so optimizer state) live in CPU memory
  /// Optimizer state on NVMe between steps (offload_optimizer_device: nvme; the shards stay in CPU memory).
  std::optional<detail::NvmeOptions> nvme;
  /// Parameter shards on NVMe between uses (offload_param_device: nvme, ZeRO-Infinity): each unit's shard is
  /// read for its all-gather (the next unit's read ahead) and for the optimizer's step, and written after the
  /// step; a read for a gather frees its memory again without writing.
  std::optional<detail::NvmeOptions> param_nvme;
  /// Reduce-scatter gradients on accumulation micro-steps too (DeepSpeed), instead of accumulating the
  /// unsharded gradient locally until the sync step (FSDP's no_sync).
  bool reduce_every_micro_step = false;
  /// When set, save_state also writes `model_16bit.safetensors` in this floating type (DeepSpeed's
  /// zero3_save_16bit_model).
  std::optional<c10::ScalarType> save_16bit;
  /// Hybrid sharding (FSDP's HYBRID_SHARD): shard over each machine's ranks, replicate across machines.
  bool hybrid = false;
  /// With hybrid: ranks per shard group, consecutive (fsdp_hybrid_shard_size); 0: one machine's.
  int hybrid_shard_size = 0;
  /// ZeRO++ hpZ (zero_hpz_partition_size): groups of this many consecutive ranks keep a secondary copy of
  /// each unit from its forward, and backward gathers from it inside the group; 1: off.
  int hpz_size = 1;
};

/// Makes the ZeRO-3 / FULL_SHARD backend.
std::unique_ptr<Backend> make_full_shard_backend(const BackendContext& context, FullShardOptions options);

}  // namespace accel::backends
