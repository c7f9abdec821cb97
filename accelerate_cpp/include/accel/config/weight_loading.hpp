#pragma once
/// \file weight_loading.hpp
/// Whether a run loads pretrained weights sharded: Accelerate's `deepspeed_config.zero3_init_flag` and
/// `fsdp_config.fsdp_cpu_ram_efficient_loading`, on a layout that shards parameters.
#include <accel/config/config.hpp>

namespace accel {

/// True when `config` sets `deepspeed_config.zero3_init_flag` or `fsdp_config.fsdp_cpu_ram_efficient_loading`
/// and its backend shards parameters (ZeRO stage 3, FSDP FULL_SHARD, HYBRID_SHARD): a program then builds
/// the model with empty weights (accel::llm::from_pretrained_empty), prepares it, and fills it with
/// `Accelerator::load_model`, each rank reading only the slices it owns, so that no rank ever holds the whole
/// model. On other layouts the flags have no effect (every rank holds the whole model anyway), and the
/// backends' notices say so. Not collective; the same on every rank.
inline bool loads_weights_sharded(const Config& config) {
  return sharding_of(config).shards_parameters &&
         (config.zero.zero3_init_flag || config.fsdp.cpu_ram_efficient_loading);
}

}  // namespace accel
