#pragma once
/// \file grad_scaler.hpp
/// Dynamic loss scaling for fp16 training (LibTorch has no C++ GradScaler). Same policy as PyTorch's
/// `torch.amp.GradScaler`: the loss is multiplied by `scale` before backward; before the optimizer step the
/// gradients are unscaled and checked; a step with an inf/NaN gradient is skipped and the scale multiplied by
/// `backoff_factor`; after `growth_interval` clean steps in a row the scale is multiplied by `growth_factor`.

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
  /// Updates the scale after a step: back off on overflow, grow after `growth_interval` clean steps.
  void update(bool found_inf);

  double get_scale() const;
  std::int64_t growth_tracker() const;
  const GradScalerOptions& options() const noexcept { return options_; }

  /// State for checkpoints: scale and growth tracker as 1-element tensors.
  std::map<std::string, torch::Tensor> state_dict() const;
  void load_state_dict(const std::map<std::string, torch::Tensor>& state);

 private:
  GradScalerOptions options_;
  torch::Tensor scale_;           // float32 [1] on the device
  torch::Tensor growth_tracker_;  // int32 [1] on the device
  torch::Tensor found_inf_;       // float32 [1] scratch
};

}  // namespace accel
