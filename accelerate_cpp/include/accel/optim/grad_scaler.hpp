#pragma once
/// \file grad_scaler.hpp
/// Dynamic loss scaling for fp16 training (LibTorch has no C++ GradScaler). By default the policy of
/// PyTorch's `torch.amp.GradScaler`: the loss is multiplied by `scale` before backward; before the optimizer
/// step the gradients are unscaled and checked; a step with an inf/NaN gradient is skipped and the scale
/// multiplied by `backoff_factor`; after `growth_interval` clean steps in a row the scale is multiplied by
/// `growth_factor`. The options also express DeepSpeed's DynamicLossScaler (fp16/loss_scaler.py):
/// `deepspeed_schedule`, `hysteresis`, `consecutive_hysteresis` and `min_scale`; `dynamic(false)` is its
/// static LossScaler.

#include <torch/arg.h>
#include <torch/types.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace accel {

/// Options of GradScaler. Example: `GradScalerOptions().init_scale(1024).growth_interval(100)`.
/// Validated by GradScaler's constructor.
struct GradScalerOptions {
  /// The first loss scale (> 0).
  TORCH_ARG(double, init_scale) = 65536.0;
  /// Multiplies the scale after `growth_interval` steps without inf/NaN (> 1).
  TORCH_ARG(double, growth_factor) = 2.0;
  /// Multiplies the scale after a step with inf/NaN, in (0, 1).
  TORCH_ARG(double, backoff_factor) = 0.5;
  /// Clean steps between growths (>= 1).
  TORCH_ARG(std::int64_t, growth_interval) = 2000;
  /// false: the scale stays `init_scale` (DeepSpeed's static loss_scale); overflowing steps are still
  /// skipped.
  TORCH_ARG(bool, dynamic) = true;
  /// DeepSpeed's growth rule: grow when the clean steps since the last overflow, less one, are a positive
  /// multiple of `growth_interval` (the first growth after growth_interval + 1 clean steps, then every
  /// growth_interval). false: PyTorch's (every growth_interval clean steps in a row).
  TORCH_ARG(bool, deepspeed_schedule) = false;
  /// Overflows before the scale backs off (>= 1; DeepSpeed's `hysteresis`): each overflow skips its step;
  /// the count refills when the scale grows (or at every clean step with `consecutive_hysteresis`).
  TORCH_ARG(std::int64_t, hysteresis) = 1;
  /// Refill the hysteresis at every clean step.
  TORCH_ARG(bool, consecutive_hysteresis) = false;
  /// The scale never backs off below this (0: no floor); an overflow while the scale is at it throws
  /// UsageError, as DeepSpeed stops there ("Current loss scale already at minimum").
  TORCH_ARG(double, min_scale) = 0.0;
};

/// Dynamic loss scaler. Not thread-safe; one per accelerator.
class GradScaler {
 public:
  /// Throws UsageError naming the option when a factor or interval is out of range.
  explicit GradScaler(GradScalerOptions options = {}, torch::Device device = torch::kCPU);

  /// `loss * scale`.
  torch::Tensor scale(const torch::Tensor& loss) const;
  /// Divides every defined gradient by the scale in place; returns true when any of them holds inf or NaN.
  bool unscale_(const std::vector<torch::Tensor>& params);
  /// Updates the scale after a step: back off on overflow, grow after `growth_interval` clean steps (by
  /// the options' rule). Throws UsageError on an overflow at `min_scale`.
  void update(bool found_inf);

  double get_scale() const;
  /// Clean steps counted toward the next growth (PyTorch's rule), or clean steps since the last overflow
  /// (DeepSpeed's rule).
  std::int64_t growth_tracker() const;
  /// Overflows left before the scale backs off (`hysteresis` when none was absorbed).
  std::int64_t hysteresis_left() const noexcept { return hysteresis_left_; }
  const GradScalerOptions& options() const noexcept { return options_; }

  /// State for checkpoints: scale, growth tracker and hysteresis left as 1-element tensors. A state without
  /// "hysteresis" (written before it existed) loads with a full hysteresis.
  std::map<std::string, torch::Tensor> state_dict() const;
  void load_state_dict(const std::map<std::string, torch::Tensor>& state);

 private:
  void update_deepspeed(bool found_inf);

  GradScalerOptions options_;
  std::int64_t hysteresis_left_ = 1;
  torch::Tensor scale_;           // float32 [1] on the device
  torch::Tensor growth_tracker_;  // int32 [1] on the device
  torch::Tensor found_inf_;       // float32 [1] scratch
};

}  // namespace accel
