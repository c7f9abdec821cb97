#pragma once
/// \file tensor_parallel.hpp
/// Megatron-style tensor parallelism: layers whose weight is split over the ranks of a tensor-parallel group,
/// each rank holding one contiguous slice and computing its part of the layer's output. LibTorch modules
/// cannot be rewritten after construction, so the model is written with these layers instead of
/// `torch::nn::Linear` / `torch::nn::Embedding`:
///
///   auto tp = accel::Communicator::create(accel::ProcessState::from_environment(), torch::kCPU);
///   torch::nn::Sequential mlp(
///       accel::tp::ColumnParallelLinear(accel::tp::ColumnParallelLinearOptions(512, 2048).seed(1), tp),
///       torch::nn::GELU(),
///       accel::tp::RowParallelLinear(accel::tp::RowParallelLinearOptions(2048, 512).seed(2), tp));
///
/// A ColumnParallelLinear followed by a RowParallelLinear (with element-wise layers between them) costs one
/// all-reduce of the output in forward and one of the input gradient in backward, the two autograd functions
/// below (Megatron's f and g). Every rank of the group must see the same input; the output is the same on
/// every rank. Each layer is initialised from the FULL layer (drawn with `seed`, or from the global
/// generator, or copied from a `torch::nn::Linear` / `torch::nn::Embedding` given by the caller), so one rank
/// and N ranks start from the same weights and compute the same function. A size not divisible by the group's
/// size is a UsageError naming the layer, the size and the group size (splits are even, as in Megatron).
///
/// With data parallelism as well (`tp x dp`), build the tensor-parallel group with Communicator::split and
/// average every parameter's gradient over the data-parallel group; see docs/parallelism.md "Tensor
/// parallelism".

#include <accel/distributed/communicator.hpp>

#include <torch/arg.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>
#include <torch/types.h>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <ostream>
#include <string>
#include <utility>

namespace accel {
namespace tp {

/// Megatron's f: identity in forward; in backward the gradient is summed over the ranks of `comm` (one
/// all-reduce). Put in front of the layers that consume a replicated input with split weights, so that the
/// input's gradient is the full one on every rank. No all-reduce when `input` does not require a gradient.
/// Collective in backward: every rank of `comm` must run the same backward.
torch::Tensor copy_to_tensor_parallel(const torch::Tensor& input, std::shared_ptr<Communicator> comm);

/// Megatron's g: the sum of `input` over the ranks of `comm` (one all-reduce) in forward; identity in
/// backward. Turns the partial outputs of split weights into the full output on every rank. Collective.
torch::Tensor reduce_from_tensor_parallel(const torch::Tensor& input, std::shared_ptr<Communicator> comm);

/// Concatenation of every rank's `input` along the last dimension, in rank order (one all-gather); backward
/// takes this rank's slice of the gradient. Every rank's input must have the same shape. Collective.
torch::Tensor gather_from_tensor_parallel(const torch::Tensor& input, std::shared_ptr<Communicator> comm);

/// This rank's slice of `input`'s last dimension (which must be divisible by the group's size); backward
/// gathers the gradient's slices (one all-gather). Collective in backward.
torch::Tensor scatter_to_tensor_parallel(const torch::Tensor& input, std::shared_ptr<Communicator> comm);

namespace detail {

/// What ColumnParallelLinear and RowParallelLinear share, as LibTorch's ConvNdImpl does for Conv1d-Conv3d:
/// the options, the parameters, the communicator, the slice of the full layer this rank holds, and the two
/// ways to build a layer (from the full layer the options describe, or from a given `torch::nn::Linear`).
template <typename Derived, typename Options>
class ParallelLinearImpl : public torch::nn::Cloneable<Derived> {
 public:
  /// Draws the full layer again (see the options' `seed`) and keeps this rank's slice.
  void reset_parameters();

  const std::shared_ptr<Communicator>& communicator() const noexcept { return comm_; }

  Options options;
  torch::Tensor weight, bias;

 protected:
  ParallelLinearImpl(Options options, std::shared_ptr<Communicator> comm)
      : options(std::move(options)), comm_(std::move(comm)) {}
  /// The derived constructor's body (virtual calls reach the derived layer there): allocates the slices,
  /// then fills them from the full layer the options describe.
  void init();
  /// The same from `full` (which stays unchanged): its bias setting, device and dtype, and its values.
  void init(const torch::nn::Linear& full);
  /// Copies this rank's slice of `full` into the allocated parameters.
  virtual void load(const torch::nn::Linear& full) = 0;

  std::shared_ptr<Communicator> comm_;
  std::int64_t first_ = 0, local_ = 0;   ///< this rank's slice of the split dimension
  torch::TensorOptions tensor_options_;  ///< of the slices reset() allocates (the full layer's, if given)
};

}  // namespace detail

/// Options of ColumnParallelLinear.
///
/// Example: `ColumnParallelLinearOptions(512, 2048).bias(false).seed(7)`
struct ColumnParallelLinearOptions {
  ColumnParallelLinearOptions(std::int64_t in_features, std::int64_t out_features)
      : in_features_(in_features), out_features_(out_features) {}
  /// Input features (every rank sees the whole input).
  TORCH_ARG(std::int64_t, in_features);
  /// Output features of the full layer; each rank holds out_features / tp_size of them.
  TORCH_ARG(std::int64_t, out_features);
  /// Whether the layer has a bias (split as the output).
  TORCH_ARG(bool, bias) = true;
  /// false: the output is this rank's slice [*, out_features / tp_size] (what a RowParallelLinear with
  /// input_is_parallel takes); true: the full output, gathered from every rank (one all-gather).
  TORCH_ARG(bool, gather_output) = false;
  /// The full layer is `torch::nn::Linear(in_features, out_features)` as built right after
  /// `torch::manual_seed(seed)` (the global generator is left as it was); without a seed, it is drawn from
  /// the global generator, so ranks seeded alike start alike.
  TORCH_ARG(std::optional<std::uint64_t>, seed) = std::nullopt;
};

/// A linear layer whose weight [out_features, in_features] is split by output rows: rank r holds rows
/// [r * out_features / N, (r + 1) * out_features / N) of the weight and of the bias. Forward: f (above),
/// then this rank's slice of the output; with gather_output, the full output. Parameters "weight" and
/// "bias", the slices. Collective (through f in backward, and the gather).
class ColumnParallelLinearImpl
    : public detail::ParallelLinearImpl<ColumnParallelLinearImpl, ColumnParallelLinearOptions> {
 public:
  /// A new layer initialised from the full layer described by `options` (see `seed`). UsageError naming the
  /// layer, out_features and the group size when out_features is not divisible by comm->world_size().
  ColumnParallelLinearImpl(const ColumnParallelLinearOptions& options, std::shared_ptr<Communicator> comm);
  /// This rank's slice of `full` (which stays unchanged), on its device and dtype.
  ColumnParallelLinearImpl(const torch::nn::Linear& full, std::shared_ptr<Communicator> comm,
                           bool gather_output = false);

  /// Allocates this rank's (uninitialised) slices; clone() then copies the values.
  void reset() override;
  /// `input` [*, in_features] -> [*, out_features / N] (or [*, out_features] with gather_output).
  torch::Tensor forward(const torch::Tensor& input);
  void pretty_print(std::ostream& stream) const override;

  /// The first output row this rank holds, and how many.
  std::int64_t first_row() const noexcept { return first_; }
  std::int64_t local_rows() const noexcept { return local_; }

 private:
  void load(const torch::nn::Linear& full) override;
};

TORCH_MODULE(ColumnParallelLinear);

/// Options of RowParallelLinear.
///
/// Example: `RowParallelLinearOptions(2048, 512).input_is_parallel(false).seed(8)`
struct RowParallelLinearOptions {
  RowParallelLinearOptions(std::int64_t in_features, std::int64_t out_features)
      : in_features_(in_features), out_features_(out_features) {}
  /// Input features of the full layer; each rank holds in_features / tp_size of them.
  TORCH_ARG(std::int64_t, in_features);
  /// Output features (every rank computes the whole output).
  TORCH_ARG(std::int64_t, out_features);
  /// Whether the layer has a bias (not split; added once, after the sum over the ranks).
  TORCH_ARG(bool, bias) = true;
  /// true: the input is already this rank's slice [*, in_features / tp_size] (a ColumnParallelLinear's
  /// output); false: the full input [*, in_features], of which each rank takes its slice.
  TORCH_ARG(bool, input_is_parallel) = true;
  /// As ColumnParallelLinearOptions::seed.
  TORCH_ARG(std::optional<std::uint64_t>, seed) = std::nullopt;
};

/// A linear layer whose weight [out_features, in_features] is split by input columns: rank r holds columns
/// [r * in_features / N, (r + 1) * in_features / N) and the whole bias. Forward: this rank's partial product,
/// g (above: one all-reduce), then the bias. Parameters "weight" (the slice) and "bias" (replicated: its
/// gradient is the same on every rank of the group). Collective.
class RowParallelLinearImpl
    : public detail::ParallelLinearImpl<RowParallelLinearImpl, RowParallelLinearOptions> {
 public:
  /// A new layer initialised from the full layer described by `options` (see `seed`). UsageError naming the
  /// layer, in_features and the group size when in_features is not divisible by comm->world_size().
  RowParallelLinearImpl(const RowParallelLinearOptions& options, std::shared_ptr<Communicator> comm);
  /// This rank's slice of `full` (which stays unchanged), on its device and dtype.
  RowParallelLinearImpl(const torch::nn::Linear& full, std::shared_ptr<Communicator> comm,
                        bool input_is_parallel = true);

  /// Allocates this rank's (uninitialised) slice and the bias; clone() then copies the values.
  void reset() override;
  /// `input` [*, in_features / N] (or [*, in_features] without input_is_parallel) -> [*, out_features].
  torch::Tensor forward(const torch::Tensor& input);
  void pretty_print(std::ostream& stream) const override;

  /// The first input column this rank holds, and how many.
  std::int64_t first_column() const noexcept { return first_; }
  std::int64_t local_columns() const noexcept { return local_; }

 private:
  void load(const torch::nn::Linear& full) override;
};

TORCH_MODULE(RowParallelLinear);

/// Options of VocabParallelEmbedding.
///
/// Example: `VocabParallelEmbeddingOptions(50304, 768).seed(3)`
struct VocabParallelEmbeddingOptions {
  VocabParallelEmbeddingOptions(std::int64_t num_embeddings, std::int64_t embedding_dim)
      : num_embeddings_(num_embeddings), embedding_dim_(embedding_dim) {}
  /// Vocabulary size of the full table; each rank holds num_embeddings / tp_size rows.
  TORCH_ARG(std::int64_t, num_embeddings);
  /// Width of an embedding.
  TORCH_ARG(std::int64_t, embedding_dim);
  /// The full table is `torch::nn::Embedding(num_embeddings, embedding_dim)`'s as built right after
  /// `torch::manual_seed(seed)` (the global generator is left as it was); without a seed, it is drawn from
  /// the global generator.
  TORCH_ARG(std::optional<std::uint64_t>, seed) = std::nullopt;
};

/// An embedding whose table [num_embeddings, embedding_dim] is split by vocabulary rows: rank r holds rows
/// [r * num_embeddings / N, (r + 1) * num_embeddings / N). Each rank looks up the ids in its range (zeros for
/// the others) and g (above) sums the lookups: one all-reduce in forward, none in backward. Parameter
/// "weight", the slice. Ids outside [0, num_embeddings) are a UsageError on every rank. Collective.
class VocabParallelEmbeddingImpl : public torch::nn::Cloneable<VocabParallelEmbeddingImpl> {
 public:
  /// A new table initialised from the full one described by `options` (see `seed`). UsageError naming the
  /// layer, num_embeddings and the group size when num_embeddings is not divisible by comm->world_size().
  VocabParallelEmbeddingImpl(const VocabParallelEmbeddingOptions& options,
                             std::shared_ptr<Communicator> comm);
  /// This rank's rows of `full` (which stays unchanged), on its device and dtype. `full`'s padding_idx and
  /// max_norm are not supported (UsageError).
  VocabParallelEmbeddingImpl(const torch::nn::Embedding& full, std::shared_ptr<Communicator> comm);

  /// Allocates this rank's (uninitialised) rows; clone() then copies the values.
  void reset() override;
  /// Draws the full table again (see `seed`) and keeps this rank's rows.
  void reset_parameters();
  /// Integer `ids` of any shape -> [*ids.shape, embedding_dim].
  torch::Tensor forward(const torch::Tensor& ids);
  void pretty_print(std::ostream& stream) const override;

  const std::shared_ptr<Communicator>& communicator() const noexcept { return comm_; }
  /// The first vocabulary row this rank holds, and how many.
  std::int64_t first_row() const noexcept { return first_; }
  std::int64_t local_rows() const noexcept { return local_; }

  VocabParallelEmbeddingOptions options;
  torch::Tensor weight;

 private:
  void load(const torch::nn::Embedding& full);

  std::shared_ptr<Communicator> comm_;
  std::int64_t first_ = 0, local_ = 0;
  torch::TensorOptions tensor_options_;  ///< of the slices reset() allocates (the full layer's, if given)
};

TORCH_MODULE(VocabParallelEmbedding);

/// How one parameter of a tensor-parallel layer is split over the ranks of its group: this rank holds entries
/// [first, first + length) of dimension `dim` of the full parameter, whose size there is `full`.
struct SplitParameter {
  std::int64_t dim = 0;
  std::int64_t first = 0;
  std::int64_t length = 0;
  std::int64_t full = 0;
  std::shared_ptr<Communicator> comm;  ///< the layer's tensor-parallel group
};

/// The split parameters of the tensor-parallel layers inside `model` (itself included), by their names in
/// `model.named_parameters()`: ColumnParallelLinear's weight and bias (dimension 0), RowParallelLinear's
/// weight (dimension 1), VocabParallelEmbedding's weight (dimension 0); and of LoRA adapters on them
/// (accel::peft): a ColumnParallelLinear's `lora_B.weight` (dimension 0), a RowParallelLinear's
/// `lora_A.weight` (dimension 1). Parameters not listed are the same on
/// every rank of the group (RowParallelLinear's bias, every other layer). The Accelerator uses it to gather
/// whole weights for get_state_dict / save_model, slice them for load_model and count each element once in
/// clip_grad_norm_.
std::map<std::string, SplitParameter> split_parameters(const torch::nn::Module& model);

}  // namespace tp
}  // namespace accel
