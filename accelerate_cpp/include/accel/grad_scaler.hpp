#pragma once
/// \file grad_scaler.hpp
/// Dynamic loss scaling for fp16 training (LibTorch has no C++ GradScaler). Same policy as PyTorch's
/// `torch.amp.GradScaler`: the loss is multiplied by `scale` before backward; before the optimizer step the
/// gradients are unscaled and checked; a step with an inf/NaN gradient is skipped and the scale multiplied by
/// `backoff_factor`; after `growth_interval` clean steps in a row the scale is multiplied by `growth_factor`.

#include <torch/types.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace accel {

/// Options of GradScaler. Example: `GradScalerOptions().init_scale(1024).growth_interval(100)`.
struct GradScalerOptions {
  GradScalerOptions& init_scale(double v) { return init_scale_ = v, *this; }
  GradScalerOptions& growth_factor(double v) { return growth_factor_ = v, *this; }
  GradScalerOptions& backoff_factor(double v) { return backoff_factor_ = v, *this; }
  GradScalerOptions& growth_interval(std::int64_t v) { return growth_interval_ = v, *this; }
  double init_scale_ = 65536.0;
  double growth_factor_ = 2.0;
  double backoff_factor_ = 0.5;
  std::int64_t growth_interval_ = 2000;
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
