#include <accel/errors.hpp>
#include <accel/nn/activation_checkpoint.hpp>

#include <ATen/Context.h>
#include <ATen/ExpandUtils.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/Generator.h>
#include <ATen/core/ivalue.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/nn/modules/container/modulelist.h>

#include <algorithm>
#include <mutex>
#include <string>
#include <utility>

namespace accel {
namespace detail {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

/// The autocast thread-local state that decides how a segment computes.
struct AutocastSnapshot {
  bool cpu_enabled = false;
  at::ScalarType cpu_dtype = at::kBFloat16;
  bool cuda_enabled = false;
  at::ScalarType cuda_dtype = at::kHalf;
  bool cache_enabled = true;

  static AutocastSnapshot current() {
    AutocastSnapshot s;
    s.cpu_enabled = at::autocast::is_autocast_enabled(at::kCPU);
    s.cpu_dtype = at::autocast::get_autocast_dtype(at::kCPU);
    s.cuda_enabled = at::autocast::is_autocast_enabled(at::kCUDA);
    s.cuda_dtype = at::autocast::get_autocast_dtype(at::kCUDA);
    s.cache_enabled = at::autocast::is_autocast_cache_enabled();
    return s;
  }

  void apply() const {
    at::autocast::set_autocast_enabled(at::kCPU, cpu_enabled);
    at::autocast::set_autocast_dtype(at::kCPU, cpu_dtype);
    at::autocast::set_autocast_enabled(at::kCUDA, cuda_enabled);
    at::autocast::set_autocast_dtype(at::kCUDA, cuda_dtype);
    at::autocast::set_autocast_cache_enabled(cache_enabled);
  }
};

/// Installs `target` (with the weight-cast cache off) and puts the previous state back on destruction.
/// The cache is turned off defensively in both passes: autocast caches the low-precision copy of a leaf
/// parameter without looking at grad mode, and LibTorch clears that cache only on an explicit clear_cache(),
/// so a copy cached by the no-grad forward (no grad_fn) must never be reused by the recomputation. Casting is
/// deterministic, so results stay bitwise identical; the cost is one cast per parameter use in the segment.
class AutocastScope {
 public:
  explicit AutocastScope(AutocastSnapshot target) : saved_(AutocastSnapshot::current()) {
    target.cache_enabled = false;
    target.apply();
  }
  ~AutocastScope() { saved_.apply(); }
  AutocastScope(const AutocastScope&) = delete;
  AutocastScope& operator=(const AutocastScope&) = delete;

 private:
  AutocastSnapshot saved_;
};

/// RNG states of the CPU generator and of the CUDA generators of some devices.
struct RngStates {
  at::Tensor cpu;
  std::vector<std::pair<c10::Device, at::Tensor>> cuda;

  static RngStates capture(const std::vector<c10::Device>& cuda_devices) {
    RngStates s;
    s.cpu = get(c10::Device(c10::kCPU));
    for (const auto& device : cuda_devices)
      s.cuda.emplace_back(device, get(device));
    return s;
  }

  void restore() const {
    set(c10::Device(c10::kCPU), cpu);
    for (const auto& [device, state] : cuda)
      set(device, state);
  }

 private:
  static at::Tensor get(const c10::Device& device) {
    at::Generator gen = at::globalContext().defaultGenerator(device);
    std::lock_guard<std::mutex> lock(gen.mutex());
    return gen.get_state();
  }
  static void set(const c10::Device& device, const at::Tensor& state) {
    at::Generator gen = at::globalContext().defaultGenerator(device);
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(state);
  }
};

/// torch.random.fork_rng: replays `forward_states` and restores the caller's states on destruction.
class RngFork {
 public:
  explicit RngFork(const std::optional<RngStates>& forward_states) {
    if (!forward_states) return;
    std::vector<c10::Device> devices;
    for (const auto& entry : forward_states->cuda)
      devices.push_back(entry.first);
    outer_ = RngStates::capture(devices);
    forward_states->restore();
  }
  ~RngFork() {
    if (outer_) outer_->restore();
  }
  RngFork(const RngFork&) = delete;
  RngFork& operator=(const RngFork&) = delete;

 private:
  std::optional<RngStates> outer_;
};

thread_local bool tl_recomputing = false;  // checkpoint_recomputing()

/// Sets checkpoint_recomputing() for one run of a segment and puts the previous value back.
class RecomputingScope {
 public:
  explicit RecomputingScope(bool on) : saved_(std::exchange(tl_recomputing, on)) {}
  ~RecomputingScope() { tl_recomputing = saved_; }
  RecomputingScope(const RecomputingScope&) = delete;
  RecomputingScope& operator=(const RecomputingScope&) = delete;

 private:
  bool saved_;
};

/// linear_graph_only: an uninitialised output in forward, aten::linear's backward in backward. aten::linear
/// of a contiguous input folds it to 2 dimensions and calls addmm(bias, x, W.t()) or mm(x, W.t()); their
/// derivative formulas (mm_mat1_backward / mm_mat2_backward, with W.t() column-major) are g.mm(W) and
/// (g.t().mm(x)).t().t(), the bias's the engine's sum_to of g, which this repeats operator for operator.
struct LinearGraphOnly : public torch::autograd::Function<LinearGraphOnly> {
  // `tensors`: the input, the weight and, when there is one, the bias (an undefined tensor cannot be an
  // input of a custom Function).
  static variable_list forward(AutogradContext* ctx, at::TensorList tensors) {
    const auto& input = tensors[0];
    const auto& weight = tensors[1];
    auto flat = input.reshape({-1, input.size(-1)});
    // Only what backward reads: the input for the weight's gradient, the weight for the input's.
    ctx->save_for_backward(
        {weight.requires_grad() ? flat : torch::Tensor(), input.requires_grad() ? weight : torch::Tensor()});
    ctx->saved_data["input_sizes"] = input.sizes().vec();
    if (tensors.size() > 2) ctx->saved_data["bias_sizes"] = tensors[2].sizes().vec();
    auto sizes = input.sizes().vec();
    sizes.back() = weight.size(0);
    return {torch::empty(sizes, input.options())};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    const auto& grad = grad_outputs[0];
    const bool has_bias = ctx->saved_data.count("bias_sizes") > 0;
    variable_list grads(has_bias ? 3 : 2);
    if (!grad.defined()) return grads;
    const auto g = grad.reshape({-1, grad.size(-1)});
    if (ctx->needs_input_grad(0))
      grads[0] = g.mm(saved[1]).view(ctx->saved_data["input_sizes"].toIntVector());
    if (ctx->needs_input_grad(1)) grads[1] = g.t().mm(saved[0]);
    if (has_bias && ctx->needs_input_grad(2))
      grads[2] = at::sum_to(g, ctx->saved_data["bias_sizes"].toIntVector());
    return grads;
  }
};

/// What backward needs besides the saved inputs. Held by the autograd context as an IValue capsule.
struct CheckpointState : torch::CustomClassHolder {
  CheckpointSegmentList segment;
  std::optional<RngStates> rng;
  AutocastSnapshot autocast;
  std::size_t num_user_inputs = 0;  // inputs after these are the private grad-carrying dummy
  std::size_t num_outputs = 0;
};

struct CheckpointFunction : public torch::autograd::Function<CheckpointFunction> {
  static variable_list forward(AutogradContext* ctx, at::TensorList inputs,
                               c10::intrusive_ptr<CheckpointState> state) {
    // Only the inputs are saved; everything the segment computes is freed when it returns.
    ctx->save_for_backward(inputs.vec());
    ctx->set_materialize_grads(false);
    variable_list outputs;
    {
      AutocastScope autocast(state->autocast);
      RecomputingScope recomputing(false);  // the forward's outputs are used
      outputs = state->segment(variable_list(inputs.begin(), inputs.begin() + state->num_user_inputs));
    }
    if (outputs.empty()) {
      throw UsageError("accel::checkpoint: the segment returned no tensor; it must return at least one");
    }
    for (std::size_t i = 0; i < outputs.size(); ++i) {
      if (!outputs[i].defined()) {
        throw UsageError("accel::checkpoint: output " + std::to_string(i) +
                         " of the segment is an undefined tensor; return only defined tensors");
      }
    }
    state->num_outputs = outputs.size();
    ctx->saved_data["state"] = c10::IValue::make_capsule(std::move(state));
    return outputs;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    if (!torch::autograd::Engine::get_default_engine().is_checkpoint_valid()) {
      throw UsageError(
          "accel::checkpoint: gradients of a checkpointed segment can only be computed by backward() without "
          "`inputs`: the recomputed gradients accumulate into .grad() and cannot be returned to "
          "torch::autograd::grad(); call loss.backward() and read .grad() instead");
    }
    if (torch::GradMode::is_enabled()) {
      throw UnsupportedOperation(
          "accel::checkpoint does not support double backward (create_graph=true); run the segment without "
          "checkpointing to take higher-order gradients");
    }
    auto state = c10::static_intrusive_pointer_cast<CheckpointState>(ctx->saved_data["state"].toCapsule());
    const variable_list saved = ctx->get_saved_variables();

    // Fresh leaves: the recomputed graph ends here, its gradients are read back from .grad().
    variable_list detached;
    detached.reserve(state->num_user_inputs);
    for (std::size_t i = 0; i < state->num_user_inputs; ++i) {
      auto leaf = saved[i].detach();
      leaf.set_requires_grad(saved[i].requires_grad());
      detached.push_back(std::move(leaf));
    }

    variable_list outputs;
    {
      RngFork rng(state->rng);
      AutocastScope autocast(state->autocast);
      torch::AutoGradMode grad_mode(true);
      RecomputingScope recomputing(true);  // only the graph of the outputs is used, not their values
      outputs = state->segment(detached);
    }
    if (outputs.size() != state->num_outputs) {
      throw UsageError("accel::checkpoint: the segment returned " + std::to_string(state->num_outputs) +
                       " tensors in forward but " + std::to_string(outputs.size()) +
                       " when recomputed in backward; a checkpointed segment must be deterministic");
    }

    variable_list roots;
    variable_list root_grads;
    for (std::size_t i = 0; i < outputs.size(); ++i) {
      if (outputs[i].defined() && outputs[i].requires_grad() && grad_outputs[i].defined()) {
        roots.push_back(outputs[i]);
        root_grads.push_back(grad_outputs[i]);
      }
    }
    // Reentrant backward: parameters captured by the segment accumulate their .grad() here.
    if (!roots.empty()) torch::autograd::backward(roots, root_grads);

    // One gradient per tensor input (the dummy included) plus one (undefined) for the state argument.
    variable_list grads(saved.size() + 1);
    for (std::size_t i = 0; i < detached.size(); ++i) {
      if (detached[i].requires_grad()) grads[i] = detached[i].grad();
    }
    return grads;
  }
};

}  // namespace
}  // namespace detail

std::vector<torch::Tensor> checkpoint(const CheckpointSegmentList& segment,
                                      const std::vector<torch::Tensor>& inputs,
                                      const CheckpointOptions& options) {
  if (!segment) throw UsageError("accel::checkpoint: the segment is an empty std::function; pass a callable");
  if (inputs.empty()) {
    throw UsageError(
        "accel::checkpoint: no input tensors; pass the tensors the segment reads (at least one)");
  }
  std::vector<c10::Device> cuda_devices;
  bool any_requires_grad = false;
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    const auto& input = inputs[i];
    if (!input.defined()) {
      throw UsageError("accel::checkpoint: input " + std::to_string(i) +
                       " is an undefined tensor; pass only defined tensors");
    }
    any_requires_grad = any_requires_grad || input.requires_grad();
    if (input.is_cuda() &&
        std::find(cuda_devices.begin(), cuda_devices.end(), input.device()) == cuda_devices.end()) {
      cuda_devices.push_back(input.device());
    }
  }
  // Nothing will be differentiated: checkpointing would only cost time.
  if (!torch::GradMode::is_enabled()) {
    detail::RecomputingScope recomputing(false);
    return segment(inputs);
  }

  auto state = c10::make_intrusive<detail::CheckpointState>();
  state->segment = segment;
  state->autocast = detail::AutocastSnapshot::current();
  state->num_user_inputs = inputs.size();
  if (options.preserve_rng_state()) state->rng = detail::RngStates::capture(cuda_devices);

  std::vector<torch::Tensor> all_inputs = inputs;
  // Without an input that requires grad, autograd would not record the Function at all, and parameters
  // captured by the segment would get no gradient. A zero-size leaf that requires grad keeps it in the graph.
  if (!any_requires_grad) all_inputs.push_back(torch::empty({0}, torch::TensorOptions().requires_grad(true)));
  return detail::CheckpointFunction::apply(at::TensorList(all_inputs), std::move(state));
}

torch::Tensor checkpoint(const CheckpointSegment& segment, const torch::Tensor& input,
                         const CheckpointOptions& options) {
  if (!segment) throw UsageError("accel::checkpoint: the segment is an empty std::function; pass a callable");
  auto outputs = checkpoint(
      // By value: backward calls it again after the caller's std::function may be gone.
      [segment](const std::vector<torch::Tensor>& in) { return std::vector<torch::Tensor>{segment(in[0])}; },
      std::vector<torch::Tensor>{input}, options);
  return outputs[0];
}

bool checkpoint_recomputing() noexcept {
  return detail::tl_recomputing;
}

torch::Tensor linear_graph_only(const torch::Tensor& input, const torch::Tensor& weight,
                                const torch::Tensor& bias) {
  if (!input.defined() || !weight.defined() || weight.dim() != 2 ||
      (input.dim() >= 1 && input.size(-1) != weight.size(1)) ||
      (bias.defined() && (bias.dim() != 1 || bias.size(0) != weight.size(0))) ||
      input.scalar_type() != weight.scalar_type() ||
      (bias.defined() && bias.scalar_type() != weight.scalar_type())) {
    throw UsageError(
        "accel::linear_graph_only: expected an input [..., in], a weight [out, in] and an optional bias "
        "[out] of one dtype; got input " +
        (input.defined() ? c10::str(input.sizes(), " ", input.scalar_type()) : std::string("undefined")) +
        ", weight " +
        (weight.defined() ? c10::str(weight.sizes(), " ", weight.scalar_type()) : std::string("undefined")) +
        ", bias " +
        (bias.defined() ? c10::str(bias.sizes(), " ", bias.scalar_type()) : std::string("undefined")) +
        "; pass the tensors torch::linear takes");
  }
  // Where aten::linear's own graph would differ (autocast's casts, matmul's unfolded batched path for a
  // non-contiguous input), or no graph is built: the real operator.
  const auto device = input.device().type();
  if (input.dim() < 2 || !input.is_contiguous() || !torch::GradMode::is_enabled() ||
      at::autocast::is_autocast_enabled(device))
    return torch::linear(input, weight, bias);
  const auto tensors = bias.defined() ? std::vector<torch::Tensor>{input, weight, bias}
                                      : std::vector<torch::Tensor>{input, weight};
  return detail::LinearGraphOnly::apply(at::TensorList(tensors))[0];
}

// ---------------------------------------------------------------------------------------------------------------

CheckpointedImpl::CheckpointedImpl(torch::nn::AnyModule module, CheckpointOptions options)
    : any_(std::move(module)), options_(options) {
  if (any_.is_empty()) {
    throw UsageError(
        "accel::Checkpointed: the module to wrap is empty; pass a module, e.g. "
        "accel::Checkpointed(torch::nn::Linear(4, 4))");
  }
  reset();
}

CheckpointedImpl::CheckpointedImpl(torch::nn::Sequential sequential, CheckpointOptions options)
    : sequential_(std::move(sequential)), options_(options) {
  if (sequential_.is_empty()) {
    throw UsageError(
        "accel::Checkpointed: the Sequential to wrap is an empty holder (nullptr); construct it first");
  }
  reset();
}

std::shared_ptr<torch::nn::Module> CheckpointedImpl::module() const {
  if (sequential_) return sequential_.ptr();
  return any_.ptr();
}

void CheckpointedImpl::reset() {
  const auto inner = module();
  const auto own_parameters = named_parameters(/*recurse=*/false);
  for (const auto& item : inner->named_parameters(/*recurse=*/false)) {
    if (!own_parameters.contains(item.key())) {
      register_parameter(item.key(), item.value(), item.value().requires_grad());
    }
  }
  const auto own_buffers = named_buffers(/*recurse=*/false);
  for (const auto& item : inner->named_buffers(/*recurse=*/false)) {
    if (!own_buffers.contains(item.key())) register_buffer(item.key(), item.value());
  }
  const auto own_children = named_children();
  for (const auto& item : inner->named_children()) {
    if (!own_children.contains(item.key())) register_module(item.key(), item.value());
  }
}

torch::Tensor CheckpointedImpl::forward_wrapped(const torch::Tensor& input) {
  detail::RecomputingScope recomputing(false);  // a plain run: its output's value is used
  if (sequential_) return sequential_->forward(input);
  return any_.forward(input);
}

torch::Tensor CheckpointedImpl::forward(const torch::Tensor& input) {
  if (!is_training() || !torch::GradMode::is_enabled()) return forward_wrapped(input);
  if (!input.requires_grad()) {
    const auto params = module()->parameters();
    const bool any =
        std::any_of(params.begin(), params.end(), [](const torch::Tensor& p) { return p.requires_grad(); });
    // A frozen block fed with data builds no graph, so there are no activations to drop.
    if (!any) return forward_wrapped(input);
  }
  // Capture the module itself (shared), not `this`: backward may run after the wrapper is gone.
  if (sequential_) {
    return checkpoint([seq = sequential_](const torch::Tensor& x) mutable { return seq->forward(x); }, input,
                      options_);
  }
  return checkpoint([any = any_](const torch::Tensor& x) mutable { return any.forward(x); }, input, options_);
}

std::shared_ptr<torch::nn::Module> CheckpointedImpl::clone(const std::optional<torch::Device>& device) const {
  std::shared_ptr<CheckpointedImpl> copy;
  if (sequential_) {
    auto seq = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(sequential_->clone(device));
    copy = std::make_shared<CheckpointedImpl>(torch::nn::Sequential(std::move(seq)), options_);
  } else {
    copy = std::make_shared<CheckpointedImpl>(any_.clone(device), options_);
  }
  copy->train(is_training());
  return copy;
}

void CheckpointedImpl::train(bool on) {
  torch::nn::Module::train(on);
  module()->train(on);
}

bool CheckpointedImpl::is_training() const noexcept {
  return module()->is_training();
}

void CheckpointedImpl::pretty_print(std::ostream& stream) const {
  stream << "accel::Checkpointed(";
  module()->pretty_print(stream);
  stream << ")";
}

void checkpoint_sequential(torch::nn::Sequential& seq, const CheckpointOptions& options) {
  if (seq.is_empty()) {
    throw UsageError(
        "accel::checkpoint_sequential: the Sequential holder is empty (nullptr); construct it first");
  }
  const auto children = seq->named_children();
  if (children.size() != seq->size()) {
    throw UsageError("accel::checkpoint_sequential: the Sequential has " + std::to_string(children.size()) +
                     " registered submodules but " + std::to_string(seq->size()) +
                     " modules in its chain; register children only through push_back");
  }
  std::size_t index = 0;
  for (auto it = seq->begin(); it != seq->end(); ++it, ++index) {
    const auto& name = children[index].key();
    if (children[index].value().get() != it->ptr().get()) {
      throw UsageError("accel::checkpoint_sequential: submodule '" + name + "' is not module " +
                       std::to_string(index) + " of the chain; register children only through push_back");
    }
    if (std::dynamic_pointer_cast<CheckpointedImpl>(it->ptr())) continue;  // already wrapped
    auto wrapper = std::make_shared<CheckpointedImpl>(*it, options);
    // The chain (what forward runs) and the registry (what parameters()/train()/to() walk) must agree.
    *it = torch::nn::AnyModule(wrapper);
    seq->replace_module(name, wrapper);
  }
}

torch::Tensor GradientCheckpointingLayer::checkpointed_call(const CheckpointSegment& run,
                                                            const torch::Tensor& input, bool training) const {
  if (!enabled_ || !training || !torch::GradMode::is_enabled()) {
    detail::RecomputingScope recomputing(false);  // a plain run: its output's value is used
    return run(input);
  }
  return checkpoint(run, input, options_);
}

std::vector<torch::Tensor> GradientCheckpointingLayer::checkpointed_call(
    const CheckpointSegmentList& run, const std::vector<torch::Tensor>& inputs, bool training) const {
  if (!enabled_ || !training || !torch::GradMode::is_enabled()) {
    detail::RecomputingScope recomputing(false);  // a plain run: its outputs' values are used
    return run(inputs);
  }
  return checkpoint(run, inputs, options_);
}

namespace {

// The blocks of every ModuleList in `model`: GradientCheckpointingLayers are switched on by the caller,
// Sequentials checkpointed child by child; the path and type of the first block of another type go to
// `foreign` (its callers hold it by type: no wrapper fits).
int checkpoint_module_lists(torch::nn::Module& model, const CheckpointOptions& options,
                            std::string& foreign) {
  int done = 0;
  // The model itself by reference (it may live on the stack: named_modules(include_self) needs a shared_ptr).
  std::vector<std::pair<std::string, const torch::nn::Module*>> all{{"", &model}};
  for (const auto& item : model.named_modules("", /*include_self=*/false))
    all.emplace_back(item.key(), item.value().get());
  for (const auto& [name, module] : all) {
    const auto* list = dynamic_cast<const torch::nn::ModuleListImpl*>(module);
    if (list == nullptr) continue;
    for (std::size_t i = 0; i < list->size(); ++i) {
      const auto block = list->ptr(i);
      if (dynamic_cast<GradientCheckpointingLayer*>(block.get()) != nullptr) continue;  // switched on below
      if (auto seq = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(block)) {
        torch::nn::Sequential holder(seq);
        checkpoint_sequential(holder, options);
        ++done;
        continue;
      }
      if (dynamic_cast<CheckpointedImpl*>(block.get()) != nullptr || !foreign.empty()) continue;
      const std::string path = name.empty() ? std::to_string(i) : name + "." + std::to_string(i);
      foreign = "'" + path + "' (a " + block->name() + ")";
    }
  }
  return done;
}

}  // namespace

int checkpoint_model_blocks(torch::nn::Module& model, const std::string& setting,
                            const CheckpointOptions& options) {
  int wrapped = 0;
  if (auto* seq = dynamic_cast<torch::nn::SequentialImpl*>(&model)) {
    torch::nn::Sequential holder(
        std::static_pointer_cast<torch::nn::SequentialImpl>(seq->shared_from_this()));
    checkpoint_sequential(holder, options);
    wrapped = 1;
  } else {
    for (const auto& child : model.children()) {
      if (auto seq = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(child)) {
        torch::nn::Sequential holder(seq);
        checkpoint_sequential(holder, options);
        ++wrapped;
      }
    }
  }
  std::string foreign;
  wrapped += checkpoint_module_lists(model, options, foreign);
  std::vector<torch::nn::Module*> modules{&model};
  for (const auto& m : model.modules(/*include_self=*/false))
    modules.push_back(m.get());
  for (auto* m : modules) {
    if (auto* layer = dynamic_cast<GradientCheckpointingLayer*>(m)) {
      layer->gradient_checkpointing_enable(options);
      ++wrapped;
    }
  }
  if (wrapped == 0 && !foreign.empty()) {
    throw UsageError(
        setting + " is on, but the model's blocks are in a ModuleList, and block " + foreign +
        " is called by its type, so no checkpointing wrapper can stand in for it. Derive that class from "
        "accel::GradientCheckpointingLayer too and run its forward through checkpointed_call "
        "(<accel/nn/activation_checkpoint.hpp>; transformers' decoder layers are GradientCheckpointingLayers "
        "alike), or turn the option off");
  }
  if (wrapped == 0) {
    throw UsageError(setting +
                     " is on, but the model is not a torch::nn::Sequential and has no Sequential children, "
                     "ModuleList blocks or accel::GradientCheckpointingLayer to checkpoint; wrap its blocks "
                     "with accel::Checkpointed or derive them from accel::GradientCheckpointingLayer "
                     "(<accel/nn/activation_checkpoint.hpp>), or turn the option off");
  }
  return wrapped;
}

}  // namespace accel
