#pragma once
/// \file empty_weights.hpp
/// A model larger than one rank's memory under ZeRO-3 / FSDP FULL_SHARD: built with empty parameters, sharded
/// by `prepare`, and filled by `Accelerator::load_model`, each rank reading only the slices it owns from the
/// memory-mapped checkpoint (what DeepSpeed's `zero3_init_flag` and FSDP's `fsdp_cpu_ram_efficient_loading`
/// promise; see docs/llm.md):
///
///   const bool sharded = accel::loads_weights_sharded(accelerator.config());
///   auto model = sharded ? accel::llm::from_pretrained_empty(dir) : accel::llm::from_pretrained(dir);
///   torch::optim::AdamW optimizer(model->parameters(), 1e-5);
///   accelerator.prepare(model, optimizer);
///   if (sharded) accelerator.load_model(model, dir);  // collective: every rank
#include <accel/llm/models/causal_lm.hpp>

#include <string>

namespace accel::llm {

/// The model of `dir/config.json` as from_pretrained builds it, every parameter empty: its shape, dtype and
/// device, no memory (Accelerate's `init_empty_weights`); reading one throws, naming the parameter and the
/// fix. The blocks are built (and initialised) one at a time and emptied at once, so building holds at most
/// the embedding and one block. The checkpoint is opened and checked as from_pretrained checks it (every
/// tensor present, with config.json's shape and a floating dtype; errors name the file and the tensor), but
/// no tensor is read. Prepare it on a backend that shards parameters (ZeRO stage 3, FSDP FULL_SHARD or
/// HYBRID_SHARD), with its optimizer, then fill it with `accelerator.load_model(model, dir)`; other backends
/// refuse it when they read a parameter. UsageError with `load_in_4bit` (4-bit weights are buffers the
/// sharding engines do not split, as in DeepSpeed). Parameters outside every prepared optimizer (frozen ones
/// the optimizer does not list) are loaded whole on each rank.
CausalLM from_pretrained_empty(const std::string& dir, const LoadOptions& options = {});

}  // namespace accel::llm
