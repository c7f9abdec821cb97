#pragma once
// How a fully sharded model (ZeRO-3, FULL_SHARD) is cut into units, each gathered and released as a whole:
// the auto-wrap policies, written apart from the engine and unit-tested without ranks.

#include <torch/nn/module.h>

#include <cstdint>
#include <string>
#include <vector>

namespace accel::backends {

/// How the model is cut into units.
enum class UnitPolicy {
  PerModule,   ///< every module's own parameters (DeepSpeed ZeRO-3's granularity)
  PerChild,    ///< every direct child of the model (and the model's own parameters)
  SizeBased,   ///< bottom-up: a subtree with at least `min_num_params` unassigned parameters
  ClassBased,  ///< every module whose class name is in `wrap_classes`
  Whole        ///< the whole model is one unit
};

struct UnitPlanOptions {
  UnitPolicy policy = UnitPolicy::PerModule;
  std::int64_t min_num_params = 100000000;  ///< SizeBased threshold
  std::vector<std::string> wrap_classes;    ///< ClassBased names (`name()` of the module, with or without
                                            ///< namespace and `Impl`); empty: repeated_block_class(model)
};

namespace detail {

struct PlannedUnit {
  std::string name;                 ///< the module's path ("layers.3"), or "<root>" for what is left
  std::vector<std::size_t> params;  ///< indices into the model's named_parameters(), ascending
};

/// The units of `model` under `options`, in the order a bottom-up walk closes them (children before their
/// parent, the root's leftovers last). Every parameter of `model.named_parameters()` lands in exactly one
/// unit; a parameter reachable under two names (shared module) goes to the first unit that reaches it.
std::vector<PlannedUnit> plan_units(torch::nn::Module& model, const UnitPlanOptions& options);

/// The class a TRANSFORMER_BASED_WRAP without `fsdp_transformer_layer_cls_to_wrap` wraps, where Accelerate
/// takes a Hugging Face model's `_no_split_modules` (LibTorch modules have none): the module type repeated
/// (at least twice) among the children of a ModuleList, Sequential or ModuleDict whose instances there hold
/// the most parameters; its `name()`. A UsageError naming the model's types when no type repeats so.
std::string repeated_block_class(const torch::nn::Module& model);

}  // namespace detail
/// The model's hidden size, as Accelerate reads a Hugging Face model's `config.hidden_size` to resolve
/// DeepSpeed's "auto" bucket sizes: the most common input width (last dimension) among the model's matrices
/// (2-D parameters), the larger on a tie; 0 when it has none. An MLP 784-512-512-10 gives 512; a transformer
/// block gives d_model (embedding, attention and the first feed-forward matrix all read d_model wide).
std::int64_t model_hidden_size(const torch::nn::Module& model);

/// DeepSpeed's "auto" bucket in bytes as Accelerate sets it: `factor` x hidden_size² elements of
/// `element_size` bytes (reduce_bucket_size: factor 1), but not below 1 MiB; DeepSpeed's default of 5e8 when
/// the model has no matrix.
std::uint64_t auto_bucket_bytes(const torch::nn::Module& model, double factor, std::size_t element_size);

}  // namespace accel::backends
