// accel::optim: Adam and AdamW stepping each parameter group with one fused ATen kernel call, on LibTorch's
// own state objects (so checkpoints interchange with torch::optim).
#include <accel/errors.hpp>
#include <accel/optim/chunked_adamw.hpp>
#include <accel/optim/deepspeed_adam.hpp>
#include <accel/optim/optim.hpp>

#include <ATen/ops/_fused_adam.h>
#include <ATen/ops/_fused_adamw.h>
#include <ATen/ops/_fused_sgd.h>
#include <ATen/ops/max.h>
#include <ATen/ops/sqrt.h>
#include <fmt/format.h>
#include <torch/autograd.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <tuple>
#include <type_traits>
#include <vector>

namespace accel::optim {
namespace {

// The tensors of one parameter group that have gradients, laid out for the fused kernel; the state objects
// are LibTorch's (created on first use as LibTorch creates them).
struct GroupTensors {
  std::vector<torch::Tensor> params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps;
  std::vector<int64_t*> step_counts;  // the state's int64 step, advanced after the kernel ran
};

template <typename State>
GroupTensors collect(const char* who, torch::optim::OptimizerParamGroup& group,
                     ska::flat_hash_map<void*, std::unique_ptr<torch::optim::OptimizerParamState>>& states,
                     bool amsgrad) {
  GroupTensors g;
  for (auto& p : group.params()) {
    if (!p.grad().defined()) continue;
    const auto& grad = p.grad();
    if (grad.is_sparse()) {
      throw UnsupportedOperation(
          fmt::format("{} does not support sparse gradients; use torch::optim::SparseAdam", who));
    }
    if (!g.params.empty() &&
        (p.scalar_type() != g.params.front().scalar_type() || p.device() != g.params.front().device())) {
      throw UsageError(
          fmt::format("{}: the parameters of one group must share dtype and device for the fused kernel; put "
                      "the others in their own parameter group",
                      who));
    }
    auto& slot = states[p.unsafeGetTensorImpl()];
    if (!slot) {
      auto state = std::make_unique<State>();
      state->step(0);
      state->exp_avg(torch::zeros_like(p, at::MemoryFormat::Preserve));
      state->exp_avg_sq(torch::zeros_like(p, at::MemoryFormat::Preserve));
      if (amsgrad) state->max_exp_avg_sq(torch::zeros_like(p, at::MemoryFormat::Preserve));
      slot = std::move(state);
    }
    auto& state = static_cast<State&>(*slot);
    if (amsgrad && !state.max_exp_avg_sq().defined()) {
      state.max_exp_avg_sq(torch::zeros_like(p, at::MemoryFormat::Preserve));
    }
    g.params.push_back(p);
    g.grads.push_back(grad);
    g.exp_avgs.push_back(state.exp_avg());
    g.exp_avg_sqs.push_back(state.exp_avg_sq());
    if (amsgrad) g.max_exp_avg_sqs.push_back(state.max_exp_avg_sq());
    // The kernel reads the step already advanced (PyTorch adds 1 before calling it); a float tensor on the
    // parameter's device, as the kernel wants.
    g.steps.push_back(torch::full({}, static_cast<double>(state.step() + 1),
                                  torch::TensorOptions().dtype(torch::kFloat32).device(p.device())));
    g.step_counts.push_back(&const_cast<int64_t&>(state.step()));
  }
  return g;
}

template <typename Options, typename State, typename Kernel>
torch::Tensor fused_step(
    const char* who, torch::optim::Optimizer& opt,
    ska::flat_hash_map<void*, std::unique_ptr<torch::optim::OptimizerParamState>>& states,
    const torch::optim::Optimizer::LossClosure& closure, Kernel kernel) {
  torch::NoGradGuard no_grad;
  torch::Tensor loss;
  if (closure != nullptr) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  for (auto& group : opt.param_groups()) {
    const auto& o = static_cast<const Options&>(group.options());
    auto g = collect<State>(who, group, states, o.amsgrad());
    if (g.params.empty()) continue;
    kernel(g, o);
    for (auto* step : g.step_counts)
      *step += 1;
  }
  return loss;
}

}  // namespace

torch::Tensor AdamW::step(LossClosure closure) {
  return fused_step<torch::optim::AdamWOptions, torch::optim::AdamWParamState>(
      "accel::optim::AdamW", *this, state_, closure,
      [](GroupTensors& g, const torch::optim::AdamWOptions& o) {
        at::_fused_adamw_(g.params, g.grads, g.exp_avgs, g.exp_avg_sqs, g.max_exp_avg_sqs, g.steps, o.lr(),
                          std::get<0>(o.betas()), std::get<1>(o.betas()), o.weight_decay(), o.eps(),
                          o.amsgrad(),
                          /*maximize=*/false);
      });
}

torch::Tensor Adam::step(LossClosure closure) {
  return fused_step<torch::optim::AdamOptions, torch::optim::AdamParamState>(
      "accel::optim::Adam", *this, state_, closure, [](GroupTensors& g, const torch::optim::AdamOptions& o) {
        at::_fused_adam_(g.params, g.grads, g.exp_avgs, g.exp_avg_sqs, g.max_exp_avg_sqs, g.steps, o.lr(),
                         std::get<0>(o.betas()), std::get<1>(o.betas()), o.weight_decay(), o.eps(),
                         o.amsgrad(),
                         /*maximize=*/false);
      });
}

torch::Tensor SGD::step(LossClosure closure) {
  torch::NoGradGuard no_grad;
  torch::Tensor loss;
  if (closure != nullptr) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  for (auto& group : param_groups()) {
    const auto& o = static_cast<const torch::optim::SGDOptions&>(group.options());
    // LibTorch keeps a momentum buffer only with momentum, created from the first gradient: parameters whose
    // buffer exists step together, the ones stepping for the first time together (the kernel fills theirs).
    std::vector<torch::Tensor> params[2], grads[2], buffers[2];  // [0]: buffer exists, [1]: first step
    for (auto& p : group.params()) {
      if (!p.grad().defined()) continue;
      if (p.grad().is_sparse()) {
        throw UnsupportedOperation(
            "accel::optim::SGD does not support sparse gradients; use torch::optim::SGD");
      }
      int first = 0;
      if (o.momentum() != 0) {
        auto& slot = state_[p.unsafeGetTensorImpl()];
        if (!slot) {
          auto state = std::make_unique<torch::optim::SGDParamState>();
          state->momentum_buffer(torch::empty_like(p, at::MemoryFormat::Preserve));
          slot = std::move(state);
          first = 1;
        }
        buffers[first].push_back(static_cast<torch::optim::SGDParamState&>(*slot).momentum_buffer());
      }
      if (!params[first].empty() && (p.scalar_type() != params[first].front().scalar_type() ||
                                     p.device() != params[first].front().device())) {
        throw UsageError(
            "accel::optim::SGD: the parameters of one group must share dtype and device for the fused "
            "kernel; put the others in their own parameter group");
      }
      params[first].push_back(p);
      grads[first].push_back(p.grad());
    }
    for (int first = 0; first < 2; ++first) {
      if (params[first].empty()) continue;
      at::_fused_sgd_(params[first], grads[first], buffers[first], o.weight_decay(), o.momentum(), o.lr(),
                      o.dampening(), o.nesterov(), /*maximize=*/false, /*is_first_step=*/first == 1);
    }
  }
  return loss;
}

// --- LAMB --------------------------------------------------------------------------------------------------

LambOptions::LambOptions(double lr) : lr_(lr) {}

void LambOptions::serialize(torch::serialize::OutputArchive& archive) const {
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(lr);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(betas);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(eps);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(weight_decay);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(bias_correction);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(max_coeff);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(min_coeff);
}

void LambOptions::serialize(torch::serialize::InputArchive& archive) {
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, lr);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(betas_t, betas);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, eps);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, weight_decay);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(bool, bias_correction);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, max_coeff);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, min_coeff);
}

double LambOptions::get_lr() const {
  return lr();
}

void LambOptions::set_lr(const double lr) {
  this->lr(lr);
}

void LambParamState::serialize(torch::serialize::OutputArchive& archive) const {
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(step);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(exp_avg);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(exp_avg_sq);
}

void LambParamState::serialize(torch::serialize::InputArchive& archive) {
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(int64_t, step);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(torch::Tensor, exp_avg);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(torch::Tensor, exp_avg_sq);
}

Lamb::Lamb(const std::vector<torch::optim::OptimizerParamGroup>& param_groups, LambOptions defaults)
    : Optimizer(param_groups, std::make_unique<LambOptions>(defaults)) {
  const auto [beta1, beta2] = defaults.betas();
  if (!(defaults.lr() >= 0) || !(defaults.eps() >= 0) || !(defaults.weight_decay() >= 0) || !(beta1 >= 0) ||
      !(beta1 < 1) || !(beta2 >= 0) || !(beta2 < 1) || !(defaults.min_coeff() <= defaults.max_coeff())) {
    throw UsageError(
        fmt::format("Lamb: invalid options (lr {}, betas ({}, {}), eps {}, weight_decay {}, "
                    "min_coeff {} > max_coeff {}?); rates and decay must be >= 0 and betas in [0, 1)",
                    defaults.lr(), beta1, beta2, defaults.eps(), defaults.weight_decay(),
                    defaults.min_coeff(), defaults.max_coeff()));
  }
}

torch::Tensor Lamb::step(LossClosure closure) {
  torch::NoGradGuard no_grad;
  torch::Tensor loss;
  if (closure) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  for (auto& group : param_groups_) {
    const auto& o = static_cast<const LambOptions&>(group.options());
    const auto [beta1, beta2] = o.betas();
    for (auto& p : group.params()) {
      if (!p.grad().defined()) continue;
      if (p.grad().is_sparse())
        throw UnsupportedOperation("accel::optim::Lamb does not support sparse gradients");
      auto& slot = state_[p.unsafeGetTensorImpl()];
      if (!slot) {
        auto fresh = std::make_unique<LambParamState>();
        fresh->exp_avg(torch::zeros_like(p, at::MemoryFormat::Preserve));
        fresh->exp_avg_sq(torch::zeros_like(p, at::MemoryFormat::Preserve));
        slot = std::move(fresh);
      }
      auto& st = static_cast<LambParamState&>(*slot);
      st.step(st.step() + 1);
      const auto& grad = p.grad();
      st.exp_avg().mul_(beta1).add_(grad, 1 - beta1);
      st.exp_avg_sq().mul_(beta2).addcmul_(grad, grad, 1 - beta2);
      const double c1 = o.bias_correction() ? 1 - std::pow(beta1, static_cast<double>(st.step())) : 1.0;
      const double c2 = o.bias_correction() ? 1 - std::pow(beta2, static_cast<double>(st.step())) : 1.0;
      torch::Tensor update = (st.exp_avg() / c1) / ((st.exp_avg_sq() / c2).sqrt().add_(o.eps()));
      if (o.weight_decay() != 0) update.add_(p, o.weight_decay());
      const double w_norm = p.norm().item<double>();
      const double u_norm = update.norm().item<double>();
      double ratio = 1.0;
      if (w_norm > 0 && u_norm > 0) ratio = std::clamp(w_norm / u_norm, o.min_coeff(), o.max_coeff());
      p.add_(update, -o.lr() * ratio);
    }
  }
  return loss;
}

void Lamb::save(torch::serialize::OutputArchive& archive) const {
  torch::optim::serialize<LambParamState, LambOptions>(archive, *this);
}

void Lamb::load(torch::serialize::InputArchive& archive) {
  torch::optim::serialize<LambParamState, LambOptions>(archive, *this);
}

// ---- ChunkedAdamW: LibTorch's AdamW step, slice by slice --------------------------------------------------

namespace {

// Elements per slice: 512 KiB of float, so a slice of the parameter, its gradient, both moments and the
// scratch stay in the cache through the eight operators. A multiple of every vector width, so each slice's
// elements take the same (vectorised) path as in the whole-tensor operators.
constexpr std::int64_t kAdamSlice = std::int64_t{1} << 17;

// The scalars of one parameter's AdamW update at its current step (computed as LibTorch's step does).
struct AdamWTerms {
  double beta1, beta2, bias_correction2_sqrt, step_size, eps;
  bool amsgrad;
};

// LibTorch's AdamW update (after the weight decay) of one parameter or one slice of it; `scratch`, when
// defined, receives the denominator (shaped like `exp_avg_sq`), else a new tensor does, as in LibTorch.
void adamw_update(torch::Tensor p, const torch::Tensor& grad, torch::Tensor exp_avg, torch::Tensor exp_avg_sq,
                  torch::Tensor max_exp_avg_sq, torch::Tensor scratch, const AdamWTerms& t) {
  exp_avg.mul_(t.beta1).add_(grad, 1 - t.beta1);
  exp_avg_sq.mul_(t.beta2).addcmul_(grad, grad, 1 - t.beta2);
  if (t.amsgrad) at::max_out(max_exp_avg_sq, exp_avg_sq, max_exp_avg_sq);
  const auto& second = t.amsgrad ? max_exp_avg_sq : exp_avg_sq;
  auto denom = scratch.defined() ? at::sqrt_out(scratch, second) : second.sqrt();
  denom.div_(t.bias_correction2_sqrt).add_(t.eps);
  p.addcdiv_(exp_avg, denom, -t.step_size);
}

// True when `t` is laid out like the contiguous CPU parameter `p`, so that equal flat slices match.
bool sliceable_like(const torch::Tensor& t, const torch::Tensor& p) {
  return !t.defined() || (t.layout() == torch::kStrided && t.is_contiguous() && t.numel() == p.numel() &&
                          t.device() == p.device() && t.scalar_type() == p.scalar_type());
}

// LibTorch's Adam / AdamW step (the operators of torch::optim::Adam / AdamW::step, in that order), each large
// contiguous CPU parameter in slices. `decoupled`: AdamW's decay of the parameter, else Adam's L2 term added
// to the gradient; without `bias_correction` bc1 = bc2 = 1 (DeepSpeed's switch).
template <typename Options, typename State>
torch::Tensor sliced_adam_step(torch::optim::Optimizer& opt,
                               const torch::optim::Optimizer::LossClosure& closure, const char* who,
                               bool decoupled, bool bias_correction) {
  torch::NoGradGuard no_grad;
  torch::Tensor loss;
  if (closure != nullptr) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  torch::Tensor scratch;  // one slice, reused by every parameter of its dtype
  auto& states = opt.state();
  for (auto& group : opt.param_groups()) {
    const auto& o = static_cast<const Options&>(group.options());
    for (auto& p : group.params()) {
      if (!p.grad().defined()) continue;
      if (p.grad().is_sparse()) {
        throw UnsupportedOperation(
            fmt::format("{} does not support sparse gradients; use torch::optim::SparseAdam", who));
      }
      if (decoupled && o.weight_decay() != 0) p.mul_(1 - o.lr() * o.weight_decay());
      auto& slot = states[p.unsafeGetTensorImpl()];
      if (!slot) {
        auto fresh = std::make_unique<State>();
        fresh->step(0);
        fresh->exp_avg(torch::zeros_like(p, at::MemoryFormat::Preserve));
        fresh->exp_avg_sq(torch::zeros_like(p, at::MemoryFormat::Preserve));
        if (o.amsgrad()) fresh->max_exp_avg_sq(torch::zeros_like(p, at::MemoryFormat::Preserve));
        slot = std::move(fresh);
      }
      auto& state = static_cast<State&>(*slot);
      if (o.amsgrad() && !state.max_exp_avg_sq().defined()) {
        state.max_exp_avg_sq(torch::zeros_like(p, at::MemoryFormat::Preserve));
      }
      state.step(state.step() + 1);
      const auto beta1 = std::get<0>(o.betas());
      const auto beta2 = std::get<1>(o.betas());
      const auto bias_correction1 = bias_correction ? 1 - std::pow(beta1, state.step()) : 1.0;
      const auto bias_correction2 = bias_correction ? 1 - std::pow(beta2, state.step()) : 1.0;
      const torch::Tensor grad =
          !decoupled && o.weight_decay() != 0 ? p.grad().add(p, o.weight_decay()) : p.grad();
      const AdamWTerms terms{beta1,   beta2,      std::sqrt(bias_correction2), o.lr() / bias_correction1,
                             o.eps(), o.amsgrad()};
      const auto& max_sq = o.amsgrad() ? state.max_exp_avg_sq() : torch::Tensor();
      const bool sliced = p.device().is_cpu() && p.is_contiguous() && p.numel() > kAdamSlice &&
                          sliceable_like(grad, p) && sliceable_like(state.exp_avg(), p) &&
                          sliceable_like(state.exp_avg_sq(), p) && sliceable_like(max_sq, p);
      if (!sliced) {
        adamw_update(p, grad, state.exp_avg(), state.exp_avg_sq(), max_sq, torch::Tensor(), terms);
        continue;
      }
      if (!scratch.defined() || scratch.scalar_type() != p.scalar_type()) {
        scratch = torch::empty({kAdamSlice}, p.options());
      }
      const auto flat = [](const torch::Tensor& t) { return t.defined() ? t.view({-1}) : t; };
      const auto fp = flat(p), fg = flat(grad), fm = flat(state.exp_avg()), fv = flat(state.exp_avg_sq()),
                 fmax = flat(max_sq);
      const auto slice = [](const torch::Tensor& t, std::int64_t at, std::int64_t len) {
        return t.defined() ? t.narrow(0, at, len) : t;
      };
      const auto n = p.numel();
      for (std::int64_t at = 0; at < n; at += kAdamSlice) {
        const auto len = std::min(kAdamSlice, n - at);
        adamw_update(slice(fp, at, len), slice(fg, at, len), slice(fm, at, len), slice(fv, at, len),
                     slice(fmax, at, len), scratch.narrow(0, 0, len), terms);
      }
    }
  }
  return loss;
}

// FusedAdam refuses amsgrad ("FusedAdam does not support the AMSGrad variant"); so do these, in any group.
template <typename Options>
void refuse_amsgrad(const torch::optim::Optimizer& opt, const char* who) {
  for (const auto& group : opt.param_groups()) {
    if (static_cast<const Options&>(group.options()).amsgrad()) {
      throw UsageError(
          fmt::format("{}: amsgrad is not supported (DeepSpeed's FusedAdam and CPU Adam refuse "
                      "it too); use torch::optim::{} for AMSGrad",
                      who, std::is_same_v<Options, torch::optim::AdamWOptions> ? "AdamW" : "Adam"));
    }
  }
}

}  // namespace

torch::Tensor ChunkedAdamW::step(LossClosure closure) {
  return sliced_adam_step<torch::optim::AdamWOptions, torch::optim::AdamWParamState>(
      *this, closure, "accel::optim::ChunkedAdamW", /*decoupled=*/true, /*bias_correction=*/true);
}

// ---- DeepSpeedAdamW / DeepSpeedAdam: DeepSpeed's Adam with its bias_correction switch
// ----------------------

DeepSpeedAdamW::DeepSpeedAdamW(const std::vector<torch::optim::OptimizerParamGroup>& param_groups,
                               torch::optim::AdamWOptions defaults, bool bias_correction)
    : torch::optim::AdamW(param_groups, std::move(defaults)), bias_correction_(bias_correction) {
  refuse_amsgrad<torch::optim::AdamWOptions>(*this, "accel::optim::DeepSpeedAdamW");
}

torch::Tensor DeepSpeedAdamW::step(LossClosure closure) {
  return sliced_adam_step<torch::optim::AdamWOptions, torch::optim::AdamWParamState>(
      *this, closure, "accel::optim::DeepSpeedAdamW", /*decoupled=*/true, bias_correction_);
}

DeepSpeedAdam::DeepSpeedAdam(const std::vector<torch::optim::OptimizerParamGroup>& param_groups,
                             torch::optim::AdamOptions defaults, bool bias_correction)
    : torch::optim::Adam(param_groups, std::move(defaults)), bias_correction_(bias_correction) {
  refuse_amsgrad<torch::optim::AdamOptions>(*this, "accel::optim::DeepSpeedAdam");
}

torch::Tensor DeepSpeedAdam::step(LossClosure closure) {
  return sliced_adam_step<torch::optim::AdamOptions, torch::optim::AdamParamState>(
      *this, closure, "accel::optim::DeepSpeedAdam", /*decoupled=*/false, bias_correction_);
}

}  // namespace accel::optim
