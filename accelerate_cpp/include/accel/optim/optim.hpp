#pragma once
/// \file optim.hpp
/// Drop-in replacements for `torch::optim::AdamW`, `Adam` and `SGD` that step every parameter group
/// with one call of ATen's fused kernel (`at::_fused_adamw_` / `at::_fused_adam_` / `at::_fused_sgd_`, CPU
/// and CUDA) instead of LibTorch's elementwise operators and temporaries per tensor. Same constructor and
/// Options types, same per-parameter state (`AdamWParamState` / `AdamParamState`: step, exp_avg, exp_avg_sq,
/// max_exp_avg_sq; `SGDParamState`: momentum_buffer), so `torch::save` / `torch::load` of the optimizer and
/// accelerate-cpp checkpoints load both ways, and the sharded backends re-point them like any optimizer.
/// Results agree with LibTorch's to rounding (weight decay, amsgrad, the step count; tested within 1e-5 after
/// 5 steps).
///
///   accel::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-3));  // was
///   torch::optim::AdamW
///
/// Parameters of one group must share dtype and device (floating point); sparse gradients are refused.

#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/serialize.h>
#include <torch/optim/sgd.h>

#include <optional>
#include <string>
#include <tuple>
#include <typeinfo>

namespace accel::optim {

class AdamW : public torch::optim::AdamW {
 public:
  using torch::optim::AdamW::AdamW;
  torch::Tensor step(LossClosure closure = nullptr) override;
};

class Adam : public torch::optim::Adam {
 public:
  using torch::optim::Adam::Adam;
  torch::Tensor step(LossClosure closure = nullptr) override;
};

class SGD : public torch::optim::SGD {
 public:
  using torch::optim::SGD::SGD;
  torch::Tensor step(LossClosure closure = nullptr) override;
};

/// The accel::optim drop-in ("accel::optim::AdamW", "accel::optim::Adam", "accel::optim::SGD") for an
/// optimizer that is exactly LibTorch's `torch::optim::AdamW`, `Adam` or `SGD`; empty for any other (already
/// fused, a subclass with its own step, another kind). The sharding backends name it when CPU offload would
/// step LibTorch's unfused optimizer on the CPU shard. (Inline: the backends library, linked below this one,
/// uses it.)
inline std::optional<std::string> fused_replacement(const torch::optim::Optimizer& optimizer) {
  const auto& type = typeid(optimizer);
  if (type == typeid(torch::optim::AdamW)) return "accel::optim::AdamW";
  if (type == typeid(torch::optim::Adam)) return "accel::optim::Adam";
  if (type == typeid(torch::optim::SGD)) return "accel::optim::SGD";
  return std::nullopt;
}

/// Optimizers whose update of a parameter needs the whole parameter (LAMB's trust ratio is a ratio of norms
/// over each parameter tensor). `Accelerator::prepare` refuses them on backends that shard optimizer state,
/// whose optimizers see slices of flattened parameters; the error says which backends to use.
class WholeParameterOptimizer {
 public:
  virtual ~WholeParameterOptimizer() = default;
  /// Its name in messages.
  virtual const char* optimizer_name() const = 0;
};

/// Options of LAMB (DeepSpeed's FusedLamb defaults: eps 1e-8, trust ratio clamped to [0.01, 10]).
struct LambOptions : public torch::optim::OptimizerCloneableOptions<LambOptions> {
  LambOptions(double lr = 1e-3);
  TORCH_ARG(double, lr) = 1e-3;
  typedef std::tuple<double, double> betas_t;
  TORCH_ARG(betas_t, betas) = std::make_tuple(0.9, 0.999);
  TORCH_ARG(double, eps) = 1e-8;
  TORCH_ARG(double, weight_decay) = 0.0;
  /// Divide the moments by 1 - beta^t (as Adam); false uses them raw (the paper's option).
  TORCH_ARG(bool, bias_correction) = true;
  /// The trust ratio ||w|| / ||update|| is clamped to [min_coeff, max_coeff] (DeepSpeed's FusedLamb).
  TORCH_ARG(double, max_coeff) = 10.0;
  TORCH_ARG(double, min_coeff) = 0.01;

 public:
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
  double get_lr() const override;
  void set_lr(const double lr) override;
};

/// LAMB's per-parameter state: the step count and Adam's two moments.
struct LambParamState : public torch::optim::OptimizerCloneableParamState<LambParamState> {
  TORCH_ARG(int64_t, step) = 0;
  TORCH_ARG(torch::Tensor, exp_avg);
  TORCH_ARG(torch::Tensor, exp_avg_sq);

 public:
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
};

/// LAMB (You et al., "Large Batch Optimization for Deep Learning", 2019, Algorithm 2), the large-batch
/// optimizer of DeepSpeed's FusedLamb: Adam's update `r = m̂ / (sqrt(v̂) + eps)` plus decoupled weight decay,
/// `u = r + weight_decay * w`, scaled per parameter tensor by the trust ratio `||w|| / ||u||` (1 when either
/// norm is 0, clamped to [min_coeff, max_coeff]): `w -= lr * ratio * u`. Saved and loaded with torch::save /
/// torch::load and accelerate-cpp checkpoints. Needs whole parameters (see WholeParameterOptimizer).
class Lamb : public torch::optim::Optimizer, public WholeParameterOptimizer {
 public:
  explicit Lamb(const std::vector<torch::optim::OptimizerParamGroup>& param_groups,
                LambOptions defaults = {});
  explicit Lamb(std::vector<torch::Tensor> params, LambOptions defaults = {})
      : Lamb({torch::optim::OptimizerParamGroup(std::move(params))}, std::move(defaults)) {}
  torch::Tensor step(LossClosure closure = nullptr) override;
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;
  const char* optimizer_name() const override { return "accel::optim::Lamb"; }
};

}  // namespace accel::optim
