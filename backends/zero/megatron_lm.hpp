#pragma once
// Accelerate's Megatron-LM files (`distributed_type: MEGATRON_LM` with a `megatron_lm_config:` section) for
// the zero backend's config part (torch-free; compiled into accel_core). They run as what they describe here:
// tensor parallelism (accel::tp layers), a pipeline (prepare_pipeline / pipeline_step) and the zero backend
// at stage 0 (Megatron's DDP) or 1 (its distributed optimizer), clipping as Megatron clips.

#include "config/config_detail.hpp"

namespace accel::config_detail {

inline const Section kMegatronLmSection = "megatron_lm_config";

/// The `megatron_lm_config:` section's rows (read into the pending values; resolve_megatron_lm maps them).
std::vector<KeyRow> megatron_lm_rows();

/// The megatron_lm_config keys Accelerate 1.13+ added (launch.py's Megatron-LM arguments) that
/// accelerate-cpp does not map: refused where they change the layout or what is computed, ignored with a
/// notice where they concern Megatron-LM's own models, memory or speed.
std::vector<UnsupportedKey> megatron_lm_unsupported();

/// Whether the file says `distributed_type: MEGATRON_LM`.
bool is_megatron_lm(const Reader& r, const Pending& p);

/// Maps a MEGATRON_LM file's megatron_lm_config onto `c` (zero stage and clipping, tensor_parallel_size,
/// pipeline stages and micro-batches, activation checkpointing, the fp16 scaler's first scale), as
/// Accelerate's MegatronLMPlugin reads it, with its defaults for absent keys; refuses what has no equivalent
/// here. Under another distributed_type a non-empty section is ignored with a notice, as Accelerate ignores
/// it.
void resolve_megatron_lm(const Reader& r, Config& c, const Pending& p);

}  // namespace accel::config_detail
