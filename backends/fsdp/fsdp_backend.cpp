#include "fsdp_backend.hpp"

#include <accel/errors.hpp>

#include "../common/descriptor.hpp"
#include "../common/flat_shards.hpp"
#include "../ddp/ddp_backend.hpp"
#include "../zero/full_shard_backend.hpp"
#include "../zero/zero_backend.hpp"

#include <fmt/format.h>

namespace accel::backends {
namespace {

UnitPolicy unit_policy(AutoWrapPolicy policy) {
  switch (policy) {
    case AutoWrapPolicy::PerChildWrap:
      return UnitPolicy::PerChild;
    case AutoWrapPolicy::SizeBasedWrap:
      return UnitPolicy::SizeBased;
    case AutoWrapPolicy::TransformerBasedWrap:
      return UnitPolicy::ClassBased;
    case AutoWrapPolicy::NoWrap:
      return UnitPolicy::Whole;
  }
  return UnitPolicy::Whole;
}

std::vector<std::string> split_names(const std::string& names) {
  std::vector<std::string> out;
  for (std::size_t at = 0; at <= names.size();) {
    const auto comma = std::min(names.find(',', at), names.size());
    auto name = names.substr(at, comma - at);
    name.erase(0, name.find_first_not_of(' '));
    name.erase(name.find_last_not_of(' ') + 1);
    if (!name.empty()) out.push_back(name);
    at = comma + 1;
  }
  return out;
}

std::unique_ptr<Backend> make_fsdp_engine(const BackendContext& context) {
  const auto& f = context.config->fsdp;
  switch (f.sharding_strategy) {
    case ShardingStrategy::NoShard:
      return make_ddp_backend(context);
    case ShardingStrategy::ShardGradOp:
    case ShardingStrategy::HybridShardZero2: {
      ZeroOptions o;
      o.stage = 2;
      o.bucket_bytes = static_cast<std::uint64_t>(context.config->ddp_bucket_cap_mb * 1024 * 1024);
      o.offload_optimizer = f.offload_params;
      o.name = "fsdp";
      o.hybrid = f.hybrid();
      o.hybrid_shard_size = f.hybrid_shard_size;
      return make_zero_backend(context, o);
    }
    case ShardingStrategy::FullShard:
    case ShardingStrategy::HybridShard: {
      FullShardOptions o;
      o.hybrid = f.hybrid();
      o.hybrid_shard_size = f.hybrid_shard_size;
      o.name = "fsdp";
      o.policy = unit_policy(f.auto_wrap_policy);
      o.min_num_params = f.min_num_params;
      o.wrap_classes = split_names(f.transformer_layer_cls_to_wrap);
      o.forward_prefetch = f.forward_prefetch;
      o.backward_prefetch = f.backward_prefetch != BackwardPrefetch::NoPrefetch;
      o.offload = f.offload_params;
      return make_full_shard_backend(context, o);
    }
  }
  throw UnsupportedOperation("fsdp: unknown sharding strategy");
}

std::vector<std::string> fsdp_notices(const BackendContext& context) {
  const auto& f = context.config->fsdp;
  std::vector<std::string> out;
  if (context.device.is_cpu() && f.offload_params) {
    out.push_back(
        "fsdp_config.fsdp_offload_params: true has no effect: this run trains on the CPU, where that state "
        "lives already");
  }
  if (f.hybrid() && f.hybrid_shard_size >= 1 && context.comm != nullptr && context.comm->world_size() > 1 &&
      f.hybrid_shard_size >= context.comm->world_size()) {
    // Accelerate refuses a mesh whose sizes do not multiply to the world size; here the file's num_processes
    // may have been overridden (--num_processes) after parallelism_config was checked against it.
    out.push_back(fmt::format(
        "fsdp_config.fsdp_hybrid_shard_size (parallelism_config's dp_shard_size) {} covers all {} "
        "data-parallel ranks: one shard group and no replica, as {} over every rank; for hybrid sharding run "
        "{} processes or another multiple of {} above it",
        f.hybrid_shard_size, context.comm->world_size(),
        f.reshard_after_forward() ? "FULL_SHARD" : "SHARD_GRAD_OP", 2 * f.hybrid_shard_size,
        f.hybrid_shard_size));
  }
  if (f.hybrid() && f.hybrid_shard_size == 0 && context.comm != nullptr && context.comm->world_size() > 1 &&
      context.comm->state().local_world_size >= context.comm->world_size()) {
    out.push_back(
        fmt::format("fsdp_config.fsdp_sharding_strategy: {} on one machine shards over all of its {} ranks, "
                    "as {} does (the replicas are the machines, and there is one)",
                    to_string(f.sharding_strategy), context.comm->world_size(),
                    f.reshard_after_forward() ? "FULL_SHARD" : "SHARD_GRAD_OP"));
  }
  if (f.state_dict_type == StateDictType::ShardedStateDict) {
    out.push_back(
        "fsdp_config.fsdp_state_dict_type: SHARDED_STATE_DICT has no effect: save_state always writes the "
        "whole model, each rank's optimizer shard and the per-parameter optimizer state");
  }
  // FULL_SHARD and HYBRID_SHARD honour it: a model built empty (accel::llm::from_pretrained_empty) is filled
  // by load_model, each rank reading only its slices (accel::loads_weights_sharded).
  if (f.cpu_ram_efficient_loading && !sharding_of(*context.config).shards_parameters) {
    out.push_back(fmt::format(
        "fsdp_config.fsdp_cpu_ram_efficient_loading: true has no effect: {} keeps every parameter whole on "
        "each rank; FULL_SHARD and HYBRID_SHARD load weights sharded (each rank reading the slices it owns)",
        to_string(f.sharding_strategy)));
  }
  return out;
}

// The sharded strategies step the optimizer on CPU masters with fsdp_offload_params.
std::vector<std::string> fsdp_optimizer_notices(const BackendContext& context,
                                                const torch::optim::Optimizer& optimizer) {
  const auto& f = context.config->fsdp;
  if (context.device.is_cpu() || !f.offload_params || f.sharding_strategy == ShardingStrategy::NoShard)
    return {};
  return detail::offload_step_notices("fsdp_config.fsdp_offload_params: true", optimizer);
}

}  // namespace

BackendDescriptor fsdp_backend_descriptor() {
  return detail::describe("fsdp", make_fsdp_engine, fsdp_notices, fsdp_optimizer_notices,
                          [](const Config& config) { return config.fsdp.activation_checkpointing; });
}

}  // namespace accel::backends
