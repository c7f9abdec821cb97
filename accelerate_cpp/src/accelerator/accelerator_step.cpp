// Accelerator: the training step. Micro-steps (batches, not backward calls), gradient accumulation with
// gradients set aside between micro-steps, fp16 loss scaling per optimizer, clipping across models.
#include <accel/accelerator/accelerator.hpp>
#include <accel/parallel/pipeline.hpp>
#include <accel/parallel/tensor_parallel.hpp>

#include <ATen/autocast_mode.h>
#include <fmt/format.h>
#include <torch/autograd.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <unordered_map>
#include <unordered_set>

namespace accel {

std::vector<torch::Tensor> Accelerator::optimizer_params() const {
  std::vector<torch::Tensor> params;
  for (auto* opt : prepared_.optimizers) {
    for (auto& group : opt->param_groups()) {
      for (auto& p : group.params())
        params.push_back(p);
    }
  }
  return params;
}

void Accelerator::stash_gradients() {
  auto params = optimizer_params();
  prepared_.stashed_grads.assign(params.size(), torch::Tensor());
  for (std::size_t i = 0; i < params.size(); ++i) {
    prepared_.stashed_grads[i] = params[i].grad();
    params[i].mutable_grad() = torch::Tensor();
  }
}

void Accelerator::restore_gradients() {
  if (prepared_.stashed_grads.empty()) return;
  auto params = optimizer_params();
  if (params.size() != prepared_.stashed_grads.size()) {
    throw UsageError("backward: the optimizers' parameters changed in the middle of an accumulation cycle");
  }
  torch::NoGradGuard no_grad;
  for (std::size_t i = 0; i < params.size(); ++i) {
    if (!prepared_.stashed_grads[i].defined()) continue;
    auto& g = params[i].mutable_grad();
    // The user may have produced gradients outside backward() meanwhile; keep both.
    g = g.defined() ? g + prepared_.stashed_grads[i] : prepared_.stashed_grads[i];
  }
  prepared_.stashed_grads.clear();
}

void Accelerator::rescale_gradients() {
  // After a sync step the optimizers' gradients are unscaled; a further backward (hand-written accumulation,
  // a second loss) adds scaled ones. Scale the existing ones back first, so that unscaling after this
  // backward treats every part alike. The scale is a power of two: exact in floating point.
  if (!scaler_) return;
  const double scale = scaler_->get_scale();
  torch::NoGradGuard no_grad;
  for (auto& p : optimizer_params()) {
    if (p.grad().defined()) p.mutable_grad().mul_(scale);
  }
}

void Accelerator::begin_backward() {
  // The clock decides whether this backward starts a micro-step (a batch) and whether it syncs.
  if (clock_.begin_backward(end_of_data(), prepared_.optimizers.size()))
    std::fill(prepared_.skipped.begin(), prepared_.skipped.end(), false);
}

void Accelerator::backward(const torch::Tensor& loss) {
  if (pipeline_.engine) {
    throw UsageError(
        "backward: this Accelerator runs a pipeline (prepare_pipeline): call "
        "accelerator.pipeline_step(inputs, "
        "targets, loss_fn) instead, which runs the forward and backward of every micro-batch on every stage");
  }
  if (!loss.defined()) throw UsageError("backward: the loss tensor is undefined");
  if (!loss.requires_grad()) {
    throw UsageError("backward: the loss does not require grad; was it computed under torch::NoGradGuard?");
  }
  if (config_.pipeline.stages > 1) {
    add_notice(fmt::format(
        "pipeline_config asks for {} stages, but this program trains with accelerator.backward() on models "
        "from prepare(), not with prepare_pipeline() and pipeline_step(): the pipeline settings have no "
        "effect "
        "(each rank holds the whole model)",
        config_.pipeline.stages));
  }
  begin_backward();
  const int steps = config_.gradient_accumulation_steps;
  rescale_gradients();
  restore_gradients();
  for (auto& m : prepared_.models)
    m.engine->before_backward(clock_.sync_gradients() && m.no_sync == 0);
  auto scaled = steps > 1 ? loss / static_cast<double>(steps) : loss;
  if (scaler_) scaled = scaler_->scale(scaled);
  {
    // The backward watch (prepare) lets this backward's gradients through.
    struct Inside {
      std::atomic<int>& n;
      explicit Inside(std::atomic<int>& c) : n(c) { ++n; }
      ~Inside() { --n; }
      Inside(const Inside&) = delete;
      Inside& operator=(const Inside&) = delete;
    } inside(*prepared_.in_backward);
    scaled.backward();
  }
  // Cast weights cached by autocast are stale once the optimizer updates them in place.
  if (autocast_.on) at::autocast::clear_cache();
  for (auto& m : prepared_.models)
    m.engine->after_backward(clock_.sync_gradients() && m.no_sync == 0);

  if (!clock_.sync_gradients()) {
    stash_gradients();
    return;
  }
  unscale_and_check();
  clip_configured_gradients();
  const bool any_real =
      std::any_of(prepared_.skipped.begin(), prepared_.skipped.end(), [](bool s) { return !s; });
  if (prepared_.optimizers.empty() || any_real) clock_.count_step();
}

void Accelerator::clip_configured_gradients() {
  // The backend's own clipping setting (deepspeed_config.gradient_clipping): DeepSpeed's engine clips its
  // model's gradients before each step, so each model that has an optimizer is clipped on its own. A model
  // under no_sync is clipped at the backward that synchronises it; a pipeline clips its whole model.
  const double max_norm = automatic_gradient_clipping(config_);
  if (max_norm <= 0) return;
  if (pipeline_.engine) {
    configured_grad_norm_ = clip_grad_norm_(max_norm);
    return;
  }
  const auto& owners = prepared_.optimizer_model;
  double squares = 0.0;
  bool clipped = false;
  for (std::size_t i = 0; i < prepared_.models.size(); ++i) {
    const auto& m = prepared_.models[i];
    if (m.no_sync > 0 || std::find(owners.begin(), owners.end(), i) == owners.end()) continue;
    const double norm = clip_grad_norm_(m.module->parameters(), max_norm);
    squares += norm * norm;
    clipped = true;
  }
  if (clipped) configured_grad_norm_ = std::sqrt(squares);
}

void Accelerator::unscale_and_check() {
  if (!scaler_) return;
  // Per optimizer: unscale its gradients and skip its step alone when they overflowed. Sharded backends hold
  // different gradient slices per rank, so every rank decides alike (one all-reduce for all optimizers).
  auto flags =
      torch::zeros({static_cast<std::int64_t>(std::max<std::size_t>(prepared_.optimizers.size(), 1))});
  for (std::size_t o = 0; o < prepared_.optimizers.size(); ++o) {
    std::vector<torch::Tensor> params;
    for (auto& group : prepared_.optimizers[o]->param_groups()) {
      for (auto& p : group.params())
        params.push_back(p);
    }
    if (scaler_->unscale_(params)) flags[static_cast<std::int64_t>(o)] = 1.0f;
  }
  if (state_.world_size > 1) groups_.job->all_reduce(flags, ReduceOp::Max);
  bool any = false;
  for (std::size_t o = 0; o < prepared_.optimizers.size(); ++o) {
    if (flags[static_cast<std::int64_t>(o)].item<float>() == 0.0f) continue;
    any = true;
    prepared_.skipped[o] = true;
    // Undefined gradients make the user's optimizer.step() skip every parameter.
    for (auto& group : prepared_.optimizers[o]->param_groups()) {
      for (auto& p : group.params())
        p.mutable_grad() = torch::Tensor();
    }
  }
  scaler_->update(any);
}

bool Accelerator::optimizer_step_was_skipped() const noexcept {
  return std::any_of(prepared_.skipped.begin(), prepared_.skipped.end(), [](bool s) { return s; });
}

bool Accelerator::optimizer_step_was_skipped(const torch::optim::Optimizer& optimizer) const {
  for (std::size_t o = 0; o < prepared_.optimizers.size(); ++o) {
    if (prepared_.optimizers[o] == &optimizer) return prepared_.skipped[o];
  }
  throw UsageError("optimizer_step_was_skipped: this optimizer was not prepared by this accelerator");
}

Accelerator::Accumulate::Accumulate(Accelerator* acc) : acc_(acc) {
  acc_->clock_.open_scope();
}

Accelerator::Accumulate::~Accumulate() {
  if (acc_ != nullptr) acc_->clock_.close_scope();
}

Accelerator::NoSync::NoSync(Accelerator* acc, std::size_t index) : acc_(acc), index_(index) {
  acc_->prepared_.models[index_].no_sync += 1;
}

Accelerator::NoSync::~NoSync() {
  if (acc_ != nullptr) acc_->prepared_.models[index_].no_sync -= 1;
}

// ---- clipping ---------------------------------------------------------------------------------------------

namespace {

// Adds `term` to a running part of a p-norm: a sum of |g|^p, or the max of |g| for p = inf.
void add_norm_term(double& into, double term, double p) {
  into = std::isinf(p) ? std::max(into, term) : into + term;
}

// One gradient's term of a p-norm, in double: sum of |g|^p, or max |g| for p = inf (0 when empty). In chunks
// of 2^20 elements: cast whole, a [V, H] embedding's gradient would be copied to float64 twice (the cast and
// |g|), 16 bytes a parameter of transient memory (2.2 GB for Qwen2.5-0.5B's) on top of the gradients.
// For p = 2 (the usual clipping) a chunk's term is the dot product of its float64 copy with itself: the cast
// and one BLAS pass over a cache-resident chunk of 2^18 elements, where |g|, pow and sum took three more
// passes and two chunk-sized allocations (the same value up to the order of the float64 additions; the
// squares of float32 values are exact in float64).
double norm_term(const torch::Tensor& g, double p) {
  const bool two = p == 2.0;
  const std::int64_t chunk = two ? std::int64_t{1} << 18 : std::int64_t{1} << 20;
  const auto flat = g.detach().reshape({-1});
  const auto n = flat.numel();
  if (n == 0) return 0.0;
  const bool inf = std::isinf(p);
  torch::Tensor acc;  // on the gradient's device: one synchronisation at the end
  for (std::int64_t at = 0; at < n; at += chunk) {
    const auto d = flat.narrow(0, at, std::min(chunk, n - at)).to(torch::kFloat64);
    const auto part = two ? at::dot(d, d) : inf ? d.abs().max() : d.abs().pow(p).sum();
    acc = !acc.defined() ? part : inf ? torch::maximum(acc, part) : acc + part;
  }
  return acc.item<double>();
}

// The p-norm part of the gradients of `tensors`.
double local_norm_part(const std::vector<torch::Tensor>& tensors, double p) {
  double out = 0.0;
  for (const auto& t : tensors) {
    if (t.grad().defined()) add_norm_term(out, norm_term(t.grad(), p), p);
  }
  return out;
}

}  // namespace

std::vector<std::size_t> Accelerator::engines_for(const std::vector<torch::Tensor>& parameters,
                                                  std::vector<torch::Tensor>& loose) const {
  std::unordered_set<const void*> wanted;
  for (const auto& p : parameters)
    wanted.insert(p.unsafeGetTensorImpl());
  std::vector<std::size_t> engines;
  for (std::size_t i = 0; i < prepared_.models.size(); ++i) {
    const auto params = prepared_.models[i].module->parameters();
    std::vector<torch::Tensor> mine;
    for (const auto& p : params) {
      if (wanted.erase(p.unsafeGetTensorImpl()) != 0) mine.push_back(p);
    }
    if (mine.empty()) continue;
    const auto grads = prepared_.models[i].engine->gradients();
    if (mine.size() == params.size()) {
      engines.push_back(i);
    } else if (!grads.sharded) {
      loose.insert(loose.end(), mine.begin(), mine.end());  // every rank holds the same whole gradients
    } else {
      throw UnsupportedOperation(fmt::format(
          "clip_grad_norm_: the parameters are {} of the {} of model {}, whose gradients the {} backend "
          "shards; clip all of that model's parameters (model->parameters()) or call "
          "clip_grad_norm_(max_norm) for every model",
          mine.size(), params.size(), i, backend_name()));
    }
  }
  for (const auto& p : parameters) {
    if (wanted.count(p.unsafeGetTensorImpl()) != 0) loose.push_back(p);  // in no prepared model
  }
  return engines;
}

namespace {

// The parts of a gradient norm one rank adds (sum of |g|^p, or max |g|): [0] of the elements this rank alone
// holds among the ranks of its tensor-parallel group (all of them without tensor parallelism), [1] of the
// elements every rank of the group holds alike; of the whole gradients and of the engines' flat slices.
struct NormParts {
  double whole[2] = {0.0, 0.0};
  double sliced[2] = {0.0, 0.0};
};

struct NormInputs {
  int tp_size = 1;
  std::vector<std::pair<const torch::nn::Module*, const Backend*>> models;  // every prepared model
  const std::vector<torch::optim::Optimizer*>* optimizers = nullptr;
  const std::vector<std::size_t>* optimizer_model = nullptr;
  std::string backend;
};

NormParts norm_parts(const NormInputs& in, const std::vector<std::size_t>& engines,
                     const std::vector<torch::Tensor>& whole, const std::vector<torch::Tensor>& sliced,
                     double p) {
  NormParts out;
  if (in.tp_size == 1) {
    out.whole[0] = local_norm_part(whole, p);
    out.sliced[0] = local_norm_part(sliced, p);
    return out;
  }
  const auto add = [&](double& into, const torch::Tensor& g) { add_norm_term(into, norm_term(g, p), p); };
  // The split parameters of every prepared model, as tensors and, for the engines' flat slices, as names.
  std::unordered_set<const void*> split_tensors;
  std::vector<std::map<std::string, tp::SplitParameter>> split_names(in.models.size());
  for (std::size_t i = 0; i < in.models.size(); ++i) {
    split_names[i] = tp::split_parameters(*in.models[i].first);
    for (const auto& item : in.models[i].first->named_parameters()) {
      if (split_names[i].count(item.key()) != 0) split_tensors.insert(item.value().unsafeGetTensorImpl());
    }
  }
  for (const auto& t : whole) {
    if (!t.grad().defined()) continue;
    add(out.whole[split_tensors.count(t.unsafeGetTensorImpl()) != 0 ? 0 : 1], t.grad());
  }
  if (sliced.empty()) return out;
  // A flat slice mixes several parameters: its layout (the optimizer's, whose tensors the slices are) says
  // which elements are whose.
  std::unordered_map<const void*, std::pair<std::size_t, OptimizerTensorLayout>> layouts;
  for (std::size_t j = 0; j < in.optimizers->size(); ++j) {
    const auto i = (*in.optimizer_model)[j];
    if (std::find(engines.begin(), engines.end(), i) == engines.end()) continue;
    const auto& opt = *(*in.optimizers)[j];
    auto layout = in.models[i].second->optimizer_layout(opt);
    std::size_t k = 0;
    for (const auto& group : opt.param_groups()) {
      for (const auto& t : group.params()) {
        if (k < layout.size()) layouts[t.unsafeGetTensorImpl()] = {i, layout[k]};
        ++k;
      }
    }
  }
  for (const auto& t : sliced) {
    if (!t.grad().defined()) continue;
    const auto found = layouts.find(t.unsafeGetTensorImpl());
    if (found == layouts.end()) {
      throw UnsupportedOperation(fmt::format(
          "clip_grad_norm_ with tensor parallelism: backend {} holds a gradient slice that no prepared "
          "optimizer updates, so which parameters it holds is unknown; prepare the model's optimizer "
          "before clipping",
          in.backend));
    }
    const auto& [model, layout] = found->second;
    const auto flat = t.grad().reshape(-1);
    for (const auto& piece : layout.pieces) {
      const auto begin = std::max(layout.begin, piece.offset);
      const auto end = std::min(layout.begin + layout.length, piece.offset + piece.numel);
      if (begin >= end) continue;
      add(out.sliced[split_names[model].count(piece.param) != 0 ? 0 : 1],
          flat.narrow(0, begin - layout.begin, end - begin));
    }
  }
  return out;
}

}  // namespace

double Accelerator::clip_grad_norm_(double max_norm, double norm_type) {
  std::vector<torch::Tensor> all;
  for (const auto& m : prepared_.models) {
    for (const auto& p : m.module->parameters())
      all.push_back(p);
  }
  return clip_grad_norm_(all, max_norm, norm_type);
}

double Accelerator::clip_grad_norm_(const std::vector<torch::Tensor>& parameters, double max_norm,
                                    double norm_type) {
  if (!clock_.sync_gradients()) return 0.0;
  if (optimizer_step_was_skipped()) return std::numeric_limits<double>::infinity();
  if (!(norm_type > 0)) {
    throw UsageError(
        fmt::format("clip_grad_norm_: norm_type must be positive or infinity, got {}", norm_type));
  }
  std::vector<torch::Tensor> whole;   // every rank holds the same values
  std::vector<torch::Tensor> sliced;  // every rank holds disjoint slices
  const auto engines = engines_for(parameters, whole);
  int copies = 1;  // ranks holding each slice (the machines under hybrid sharding): the same for every engine
  for (auto i : engines) {
    auto g = prepared_.models[i].engine->gradients();
    auto& into = g.sharded ? sliced : whole;
    into.insert(into.end(), g.tensors.begin(), g.tensors.end());
    whole.insert(whole.end(), g.replicated.begin(), g.replicated.end());
    if (g.sharded) copies = std::max(copies, g.copies);
  }
  const bool inf = std::isinf(norm_type);
  const auto op = inf ? ReduceOp::Max : ReduceOp::Sum;
  // A parameter tied across pipeline stages counts once: on the first stage holding it.
  std::vector<torch::Tensor> counted = whole;
  if (pipeline_.stage) {
    std::unordered_set<const void*> copies;
    for (const auto& tie : pipeline_.stage->ties()) {
      if (tie.stages.front() == pipeline_.stage->stage()) continue;
      if (auto t = pipeline_.stage->tied_parameter(tie); t.defined()) copies.insert(t.unsafeGetTensorImpl());
    }
    counted.erase(
        std::remove_if(counted.begin(), counted.end(),
                       [&](const torch::Tensor& t) { return copies.count(t.unsafeGetTensorImpl()) != 0; }),
        counted.end());
  }
  // With tensor parallelism the ranks of a group hold slices of the split parameters and copies of the
  // others: a split element counts on its rank, a replicated one once per group.
  NormInputs inputs;
  inputs.tp_size = groups_.tensor->world_size();
  for (const auto& m : prepared_.models)
    inputs.models.emplace_back(m.module.get(), m.engine.get());
  inputs.optimizers = &prepared_.optimizers;
  inputs.optimizer_model = &prepared_.optimizer_model;
  inputs.backend = backend_name();
  const auto split = norm_parts(inputs, engines, counted, sliced, norm_type);
  double total = split.whole[0];
  double replicated = split.whole[1];
  // Slices are held by the ranks that replicate the same parameters: the data-parallel replicas (the whole
  // job without tensor or pipeline parallelism).
  if (capabilities().shards_gradients || capabilities().shards_optimizer_state) {
    auto part = groups_.tensor->world_size() > 1
                    ? torch::tensor({split.sliced[0], split.sliced[1]}, torch::kFloat64)
                    : torch::tensor({split.sliced[0]}, torch::kFloat64);
    // Under sequence parallelism the engines shard over every rank (groups_.replicas).
    auto& holders = groups_.sequence->world_size() > 1 ? *groups_.replicas : *groups_.data;
    if (holders.world_size() > 1) holders.all_reduce(part, op);
    if (!inf) part.div_(copies);  // each slice was summed once per rank holding it
    add_norm_term(total, part[0].item<double>(), norm_type);
    if (part.numel() > 1) add_norm_term(replicated, part[1].item<double>(), norm_type);
  }
  if (groups_.tensor->world_size() > 1) {
    auto part = torch::tensor({inf ? std::max(total, replicated)
                                   : total + replicated / static_cast<double>(groups_.tensor->world_size())},
                              torch::kFloat64);
    groups_.tensor->all_reduce(part, op);
    total = part.item<double>();
  }
  // With a pipeline each stage holds other layers: the model's norm adds every stage's part.
  if (pipeline_.engine && groups_.pipeline->world_size() > 1) {
    auto part = torch::tensor({total}, torch::kFloat64);
    groups_.pipeline->all_reduce(part, op);
    total = part.item<double>();
  }
  const double norm = inf ? total : std::pow(total, 1.0 / norm_type);
  const double coef = max_norm / (norm + 1e-6);
  if (coef < 1.0) {
    torch::NoGradGuard no_grad;
    for (auto* list : {&whole, &sliced}) {
      for (auto& t : *list) {
        if (t.grad().defined()) t.mutable_grad().mul_(coef);
      }
    }
  }
  return norm;
}

}  // namespace accel
