#pragma once
/// \file zero_backend.hpp
/// ZeRO (DeepSpeed's Zero Redundancy Optimizer) stages 1 and 2, also serving FSDP's SHARD_GRAD_OP:
/// - every optimizer parameter group is split into sub-groups of whole parameters (DeepSpeed's
///   `sub_group_size` elements each, unless one parameter alone is larger); each sub-group is laid out as
///   one flat buffer padded to a multiple of N that the parameters' storages point into; rank r owns the
///   contiguous slice [r*S, (r+1)*S), S = ceil(P/N), and the user's optimizer is re-pointed at a flat
///   "master" copy of that slice per sub-group, so each rank holds exactly S elements of every optimizer
///   state tensor, in tensors no larger than a sub-group's slice;
/// - stage 1: after backward the full gradients are reduce-scattered in chunks of `bucket_bytes` (two in
///   flight, each rank's k-th piece side by side); stage 2: during backward, gradients are reduced to their
///   owners in buckets as they become ready, and the full gradients are freed bucket by bucket, so a rank
///   holds its S gradient elements plus at most one bucket;
/// - after the user's `optimizer.step()` the updated slices are all-gathered straight into the flat buffers
///   (so into the parameters) at the next step boundary (`Backend::sync_parameters`).
/// Communication per step equals DDP's: reduce(-scatter) (N-1)/N x P plus all-gather (N-1)/N x P elements.

#include <accel/backend/backend.hpp>

#include "../common/nvme_tier.hpp"

#include <memory>
#include <optional>

namespace accel::backends {

/// Options of the sharded-optimizer backend.
struct ZeroOptions {
  int stage = 2;                           ///< 1 or 2
  std::uint64_t bucket_bytes = 500000000;  ///< stage 2 reduce bucket / stage 1 chunk, in bytes
  /// DeepSpeed's reduce_bucket_size, which counts elements: when set, bucket_bytes becomes this many
  /// elements of the parameters' type at prepare_model.
  std::optional<std::uint64_t> bucket_elements;
  /// DeepSpeed's "auto": bucket_bytes is set at prepare_model from the model (auto_bucket_bytes).
  bool bucket_from_model = false;
  /// Elements per optimizer sub-group (DeepSpeed's sub_group_size; see ZeroConfig::sub_group_size).
  std::int64_t sub_group_numel = static_cast<std::int64_t>(ZeroConfig{}.sub_group_size);
  bool overlap_comm = true;  ///< stage 2: reduce a bucket while the next fills (else one bucket at most)
  bool offload_optimizer = false;  ///< keep master slices and optimizer state in CPU memory
  /// Optimizer state on NVMe between steps (offload_optimizer_device: nvme; the masters stay in CPU memory).
  std::optional<detail::NvmeOptions> nvme;
  std::string name = "zero";  ///< reported by name() ("zero" or "fsdp")
  /// When set, save_state also writes `model_16bit.safetensors` in this floating type.
  std::optional<c10::ScalarType> save_16bit;
  /// Hybrid sharding (FSDP's _HYBRID_SHARD_ZERO2): shard over each machine's ranks, replicate across them.
  bool hybrid = false;
  /// With hybrid: ranks per shard group, consecutive (fsdp_hybrid_shard_size); 0: one machine's.
  int hybrid_shard_size = 0;
};

/// Makes the ZeRO backend for stage 1 or 2 (stage 0 is DDP; stage 3 is full_shard_backend.hpp).
std::unique_ptr<Backend> make_zero_backend(const BackendContext& context, ZeroOptions options);
/// The `zero` descriptor: reads `deepspeed_config` (zero_stage 0 is DDP, 1-2 this engine, 3 the fully
/// sharded one; reduce_bucket_size, offload ...).
BackendDescriptor zero_backend_descriptor();

}  // namespace accel::backends
