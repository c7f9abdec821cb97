#pragma once
/// \file activation_checkpoint.hpp
/// Activation checkpointing (gradient checkpointing) for LibTorch, which has none: a segment of the forward
/// pass runs without keeping its intermediate activations; backward re-runs the segment from its saved inputs
/// and backpropagates through that recomputation. Memory for activations falls from O(layers) to O(segments)
/// at the price of one extra forward per segment.
///
/// Semantics are those of PyTorch's reentrant `torch.utils.checkpoint.checkpoint(fn, *args,
/// use_reentrant=True, preserve_rng_state=True)`:
///  - gradients reach the inputs and every parameter the segment uses, including parameters captured by the
///    closure (they are not inputs); they accumulate into `.grad()` during the recomputation;
///  - the CPU RNG state, and the CUDA RNG state of every CUDA device an input lives on, are saved in forward
///  and
///    restored around the recomputation, so dropout draws the same mask; the caller's RNG state is unchanged;
///  - the recomputation runs under the autocast state (CPU and CUDA, enabled flag and dtype) of the forward;
///  - gradients are bitwise identical to the plain forward/backward on the same device.
/// Local: no collective is involved; call it on any rank independently.
///
/// Limitations (the same as PyTorch's reentrant checkpoint unless stated):
///  - `torch::autograd::grad(...)` and `backward(..., inputs=...)` through a checkpointed segment throw
///    UsageError (the recomputed gradients go to `.grad()`, they cannot be returned), and double backward
///    (`create_graph=true`) throws UnsupportedOperation;
///  - the segment must be deterministic apart from the RNG: it must not change state it reads (BatchNorm
///    running statistics are updated twice, once by the forward and once by the recomputation);
///  - an input must not be modified in place after the call (autograd reports it in backward).
///
/// Example:
///   auto mlp = torch::nn::Sequential(torch::nn::Linear(64, 256), torch::nn::ReLU(), torch::nn::Linear(256,
///   64)); auto y = accel::checkpoint([&](const torch::Tensor& x) { return mlp->forward(x); }, x);
///   y.sum().backward();   // recomputes mlp once, fills mlp's .grad() and x.grad()

#include <torch/arg.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/pimpl.h>
#include <torch/types.h>

#include <functional>
#include <memory>
#include <optional>
#include <ostream>
#include <string>
#include <type_traits>
#include <vector>

namespace accel {

/// Options of checkpoint(). Example: `CheckpointOptions().preserve_rng_state(false)`.
struct CheckpointOptions {
  /// Save the RNG state in forward and replay it in the recomputation (default true). Turn off only for
  /// segments that draw no random numbers: it saves copying the CPU generator state (about 5 KB) per call.
  TORCH_ARG(bool, preserve_rng_state) = true;
};

/// A segment with one tensor in and one tensor out.
using CheckpointSegment = std::function<torch::Tensor(const torch::Tensor&)>;
/// A segment with any number of tensors in and out.
using CheckpointSegmentList = std::function<std::vector<torch::Tensor>(const std::vector<torch::Tensor>&)>;

/// Runs `segment(input)` without storing its activations; backward recomputes it (see the file comment).
/// When grad mode is off (e.g. under `torch::NoGradGuard`) this is exactly `segment(input)`.
/// When no input requires grad, a private zero-size leaf that requires grad is added so that the output
/// still reaches backward and the parameters captured by `segment` get their gradients (the common case of a
/// first layer fed with data). `segment` is called again during backward, so whatever it captures must stay
/// alive until then. Throws UsageError when `input` is undefined or `segment` is empty or returns an
/// undefined tensor. Local (no collective).
torch::Tensor checkpoint(const CheckpointSegment& segment, const torch::Tensor& input,
                         const CheckpointOptions& options = {});

/// The same for a segment with several inputs and outputs. Inputs that do not require grad (masks, integer
/// ids) get no gradient; outputs of integral dtype are not differentiable. Throws UsageError when an input is
/// undefined, `inputs` is empty, or the segment returns no tensor or a different number of tensors when
/// recomputed. Local (no collective).
std::vector<torch::Tensor> checkpoint(const CheckpointSegmentList& segment,
                                      const std::vector<torch::Tensor>& inputs,
                                      const CheckpointOptions& options = {});

/// True while this thread runs a segment as checkpoint()'s recomputation in backward. The values of the
/// segment's outputs are then discarded (only their autograd graph is backpropagated), so the segment may
/// skip computing values that reach nothing but its outputs, as PyTorch's non-reentrant checkpoint stops
/// recomputing once every tensor backward saves is back (e.g. linear_graph_only for a last projection that
/// only a residual add follows). Every entry into a segment sets it for that segment alone: a nested
/// checkpoint()'s forward, a plain run of checkpointed_call / Checkpointed and checkpoint() under no grad see
/// false (their outputs' values are used). Read it at the top of your segment, where your code knows which
/// values are the segment's outputs; code the segment calls cannot tell. Local (no collective).
bool checkpoint_recomputing() noexcept;

/// `torch::linear(input, weight, bias)` for a result whose value nobody reads (the last projection of a
/// segment recomputed by checkpoint(), see checkpoint_recomputing): the matrix product is not computed and
/// the returned tensor (the right shape, dtype and device) holds UNSPECIFIED VALUES, but it carries
/// torch::linear's autograd graph: backward gives `input` the gradient `g @ weight`, `weight` the gradient
/// `g^T @ input` and `bias` `g` summed over the leading dimensions, each only when that tensor requires
/// grad, with aten::linear's own backward operators (bitwise equal to torch::linear's gradients on CPU).
/// Adding to the result (in place or not) is allowed and differentiated as usual. Falls back to
/// torch::linear (values computed) when autocast is on for the input's device (its casts are part of the
/// graph), when `input` has fewer than 2 dimensions, or when grad mode is off. Operator observers that watch
/// aten::linear (LoRA's adapters on a torch::nn::Linear) do not see this call: use it only on a layer
/// nothing observes. Throws UsageError on shapes torch::linear would refuse. Local (no collective).
torch::Tensor linear_graph_only(const torch::Tensor& input, const torch::Tensor& weight,
                                const torch::Tensor& bias = {});

/// A module whose `forward(Tensor) -> Tensor` runs the wrapped module under checkpoint() while training with
/// grad mode on, and plainly otherwise (eval, `NoGradGuard`, or when neither the input nor any parameter
/// requires grad).
///
/// Name-transparent: the wrapper registers the wrapped module's own parameters, buffers and children under
/// their original names (the same Tensor objects), so `named_parameters()`, `state_dict`-style saving and an
/// optimizer built before or after wrapping see exactly the same names and tensors as without the wrapper:
/// wrapping `Linear` stored under "fc" still gives "fc.weight", not "fc.module.weight". Consequences:
///  - the wrapped module itself does not appear in `modules()` / `named_modules()` (the wrapper does, under
///  its
///    name), so select by module type before wrapping;
///  - parameters, buffers or children registered on the wrapped module after wrapping are not mirrored;
///  - `train()` / `eval()` reach the wrapped module; `is_training()` reports the wrapped module's mode;
///  - `to(device / dtype)` converts the shared tensors in place, so the wrapped module follows;
///  - `clone()` deep-copies the wrapped module and wraps the copy.
/// Example: `auto block = accel::Checkpointed(torch::nn::Sequential(Linear(8, 8), ReLU()));`
class CheckpointedImpl : public torch::nn::Cloneable<CheckpointedImpl> {
 public:
  /// Wraps `module`, whose forward must take one Tensor and return one Tensor. Throws UsageError when
  /// `module` is empty.
  explicit CheckpointedImpl(torch::nn::AnyModule module, CheckpointOptions options = {});
  /// Wraps a Sequential (which AnyModule cannot hold: its forward is a template). Throws UsageError when
  /// `sequential` is an empty holder.
  explicit CheckpointedImpl(torch::nn::Sequential sequential, CheckpointOptions options = {});
  /// Wraps a module holder, e.g. `torch::nn::Linear`.
  template <typename ModuleType>
  explicit CheckpointedImpl(const torch::nn::ModuleHolder<ModuleType>& module, CheckpointOptions options = {})
      : CheckpointedImpl(torch::nn::AnyModule(module), options) {}
  /// Wraps a module given by shared pointer.
  template <typename ModuleType>
  explicit CheckpointedImpl(std::shared_ptr<ModuleType> module, CheckpointOptions options = {})
      : CheckpointedImpl(wrap(std::move(module)), options) {}

  /// checkpoint(wrapped.forward, input) when training with grad mode on, wrapped.forward(input) otherwise.
  torch::Tensor forward(const torch::Tensor& input);

  /// Registers the wrapped module's parameters, buffers and children under their names (called by the
  /// constructor; names already registered are left alone).
  void reset() override;

  /// Deep copy: clones the wrapped module (onto `device` if given) and wraps the clone with the same options.
  std::shared_ptr<torch::nn::Module> clone(
      const std::optional<torch::Device>& device = std::nullopt) const override;

  /// Sets the mode of the wrapper and of the wrapped module.
  void train(bool on = true) override;
  /// The wrapped module's mode (it may have been switched directly, e.g. by a parent that still holds it).
  bool is_training() const noexcept override;

  /// Prints `accel::Checkpointed(<wrapped module>)`.
  void pretty_print(std::ostream& stream) const override;

  /// The wrapped module (not registered as a child, see the class comment).
  std::shared_ptr<torch::nn::Module> module() const;
  /// The options passed to checkpoint().
  const CheckpointOptions& options() const noexcept { return options_; }

 private:
  template <typename ModuleType>
  static auto wrap(std::shared_ptr<ModuleType> module) {
    if constexpr (std::is_base_of_v<torch::nn::SequentialImpl, ModuleType>) {
      return torch::nn::Sequential(std::move(module));
    } else {
      return torch::nn::AnyModule(std::move(module));
    }
  }

  torch::Tensor forward_wrapped(const torch::Tensor& input);

  // Exactly one of the two holds the wrapped module.
  torch::nn::AnyModule any_;
  torch::nn::Sequential sequential_{nullptr};
  CheckpointOptions options_;
};

/// Holder of CheckpointedImpl (`accel::Checkpointed(torch::nn::Linear(4, 4))`).
TORCH_MODULE(Checkpointed);

/// Wraps every direct child of `seq` in a Checkpointed, in place: each child becomes one checkpointed
/// segment, so backward keeps only the tensors passed between children. Parameter and buffer names and the
/// parameter Tensor objects are unchanged (an optimizer created before the call keeps working, saved
/// checkpoints still load), because Checkpointed is name-transparent. Children already wrapped are left
/// alone, so a second call is a no-op. Every child must take one Tensor and return one Tensor (Checkpointed's
/// forward). Call it before creating data-parallel or sharding wrappers that look at module types. Throws
/// UsageError when `seq` is empty (no module). Local (no collective), but call it on every rank alike.
void checkpoint_sequential(torch::nn::Sequential& seq, const CheckpointOptions& options = {});

/// A block that can run checkpointed while staying the model's own type (transformers'
/// GradientCheckpointingLayer, the base of every decoder layer there). For blocks that a model keeps in a
/// torch::nn::ModuleList and calls by their type (`layers[i]->as<DecoderLayer>()->forward(x, mask)`), which
/// no wrapper can replace: derive the block from this class too and run its forward through
/// checkpointed_call. checkpoint_model_blocks (the Trainer's gradient_checkpointing) then switches it on.
///
///   struct DecoderLayerImpl : torch::nn::Module, accel::GradientCheckpointingLayer {
///     torch::Tensor forward(const torch::Tensor& x) {
///       return checkpointed_call([this](const torch::Tensor& h) { return forward_impl(h); }, x,
///       is_training());
///     }
///   };
class GradientCheckpointingLayer {
 public:
  virtual ~GradientCheckpointingLayer() = default;
  /// Checkpoint this block's calls from now on (transformers' `gradient_checkpointing = True`).
  void gradient_checkpointing_enable(CheckpointOptions options = {}) {
    enabled_ = true;
    options_ = options;
  }
  void gradient_checkpointing_disable() noexcept { enabled_ = false; }
  bool gradient_checkpointing() const noexcept { return enabled_; }

 protected:
  /// `run(input)` through checkpoint() when enabled, `training` and grad mode on; plainly otherwise.
  torch::Tensor checkpointed_call(const CheckpointSegment& run, const torch::Tensor& input,
                                  bool training) const;
  /// The same with several tensors in and out (masks and position ids pass as inputs that need no grad).
  std::vector<torch::Tensor> checkpointed_call(const CheckpointSegmentList& run,
                                               const std::vector<torch::Tensor>& inputs, bool training) const;

 private:
  bool enabled_ = false;
  CheckpointOptions options_;
};

/// Activation checkpointing of an unmodified model, as the configs' `fsdp_activation_checkpointing` /
/// `activation_checkpointing` and the Trainer's `gradient_checkpointing` turn it on:
///  - checkpoint_sequential on `model` when it is a Sequential, else on each of its direct Sequential
///    children (a block list);
///  - every GradientCheckpointingLayer anywhere in the model is switched on (transformers' layout: the
///    decoder layers in a ModuleList);
///  - each block of a ModuleList that is a Sequential is checkpointed child by child (checkpoint_sequential:
///    it stays a Sequential, so code that calls it by type still works).
/// Returns how many Sequentials and layers it switched on (again a no-op for those already on). Throws
/// UsageError naming `setting` (what asked for it) when there is nothing to checkpoint, or when a ModuleList
/// holds a block of another type (no wrapper can stand in for it: the error names it and says how to make it
/// a GradientCheckpointingLayer). Local; call it on every rank alike.
int checkpoint_model_blocks(torch::nn::Module& model, const std::string& setting,
                            const CheckpointOptions& options = {});

}  // namespace accel
