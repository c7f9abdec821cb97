#pragma once
/// \file deepspeed_adam.hpp
/// DeepSpeed's Adam as its engine builds it from a DeepSpeed JSON "optimizer" block (DeepSpeed 0.19.6
/// runtime/engine.py `_configure_basic_optimizer`: FusedAdam, or DeepSpeedCPUAdam under CPU offload; the same
/// update), with its `bias_correction` switch:
///  - `accel::optim::DeepSpeedAdamW`: decoupled weight decay (type "AdamW", or "Adam" with adam_w_mode, its
///    default): `p *= 1 - lr * weight_decay`, then the Adam update;
///  - `accel::optim::DeepSpeedAdam`: L2 weight decay (type "Adam" with adam_w_mode false): `g += weight_decay
///  *
///    p`, then the Adam update.
/// The Adam update, with bc1 = 1 - beta1^t and bc2 = 1 - beta2^t, or bc1 = bc2 = 1 when `bias_correction` is
/// false (csrc/adam/multi_tensor_adam.cu, csrc/includes/cpu_adam.h `update_state`):
///   m = beta1 m + (1 - beta1) g,   v = beta2 v + (1 - beta2) g^2,   p -= lr / bc1 * m / (sqrt(v / bc2) +
///   eps)
/// With bias correction (DeepSpeed's default) they are bitwise `ChunkedAdamW` / `torch::optim::Adam` (the
/// same operators, slice by slice). LibTorch's options and state types (they are a `torch::optim::AdamW` /
/// `Adam`), so checkpoints, ZeRO's flat shards and optimizer offload treat them as LibTorch's; the switch is
/// a property of the optimizer, not saved in checkpoints (the Trainer builds it from the JSON before loading
/// one). amsgrad is refused, as FusedAdam refuses it.
///
///   accel::optim::DeepSpeedAdamW opt(model->parameters(),
///                                    torch::optim::AdamWOptions(1e-3).weight_decay(0.01),
///                                    /*bias_correction=*/false);

#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>

#include <vector>

namespace accel::optim {

/// DeepSpeed's FusedAdam / CPU Adam in AdamW mode (decoupled weight decay), with `bias_correction`.
class DeepSpeedAdamW : public torch::optim::AdamW {
 public:
  /// UsageError for amsgrad (DeepSpeed's FusedAdam raises "does not support the AMSGrad variant").
  DeepSpeedAdamW(const std::vector<torch::optim::OptimizerParamGroup>& param_groups,
                 torch::optim::AdamWOptions defaults, bool bias_correction = true);
  DeepSpeedAdamW(std::vector<torch::Tensor> params, torch::optim::AdamWOptions defaults,
                 bool bias_correction = true)
      : DeepSpeedAdamW({torch::optim::OptimizerParamGroup(std::move(params))}, std::move(defaults),
                       bias_correction) {}
  /// Whether the moments are divided by 1 - beta^t (DeepSpeed's `bias_correction`, default true).
  bool bias_correction() const noexcept { return bias_correction_; }
  torch::Tensor step(LossClosure closure = nullptr) override;

 private:
  bool bias_correction_;
};

/// DeepSpeed's FusedAdam / CPU Adam with adam_w_mode false (L2 weight decay), with `bias_correction`.
class DeepSpeedAdam : public torch::optim::Adam {
 public:
  /// UsageError for amsgrad (DeepSpeed's FusedAdam raises "does not support the AMSGrad variant").
  DeepSpeedAdam(const std::vector<torch::optim::OptimizerParamGroup>& param_groups,
                torch::optim::AdamOptions defaults, bool bias_correction = true);
  DeepSpeedAdam(std::vector<torch::Tensor> params, torch::optim::AdamOptions defaults,
                bool bias_correction = true)
      : DeepSpeedAdam({torch::optim::OptimizerParamGroup(std::move(params))}, std::move(defaults),
                      bias_correction) {}
  /// Whether the moments are divided by 1 - beta^t (DeepSpeed's `bias_correction`, default true).
  bool bias_correction() const noexcept { return bias_correction_; }
  torch::Tensor step(LossClosure closure = nullptr) override;

 private:
  bool bias_correction_;
};

}  // namespace accel::optim
