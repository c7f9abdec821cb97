#include <accel/errors.hpp>
#include <accel/optim/grad_scaler.hpp>

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace accel {

GradScaler::GradScaler(GradScalerOptions options, torch::Device device) : options_(options) {
  if (!(options_.init_scale() > 0)) {
    throw UsageError(fmt::format("GradScaler: init_scale must be > 0, got {}", options_.init_scale()));
  }
  if (!(options_.growth_factor() > 1)) {
    throw UsageError(fmt::format("GradScaler: growth_factor must be > 1, got {}", options_.growth_factor()));
  }
  if (!(options_.backoff_factor() > 0 && options_.backoff_factor() < 1)) {
    throw UsageError(
        fmt::format("GradScaler: backoff_factor must be in (0, 1), got {}", options_.backoff_factor()));
  }
  if (options_.growth_interval() < 1) {
    throw UsageError(
        fmt::format("GradScaler: growth_interval must be >= 1, got {}", options_.growth_interval()));
  }
  if (options_.hysteresis() < 1) {
    throw UsageError(fmt::format("GradScaler: hysteresis must be >= 1, got {}", options_.hysteresis()));
  }
  if (!(options_.min_scale() >= 0) || !std::isfinite(options_.min_scale())) {
    throw UsageError(
        fmt::format("GradScaler: min_scale must be >= 0 (0: none), got {}", options_.min_scale()));
  }
  hysteresis_left_ = options_.hysteresis();
  const auto f32 = torch::TensorOptions().dtype(torch::kFloat32).device(device);
  scale_ = torch::full({1}, options_.init_scale(), f32);
  growth_tracker_ = torch::zeros({1}, f32.dtype(torch::kInt32));
  found_inf_ = torch::zeros({1}, f32);
}

torch::Tensor GradScaler::scale(const torch::Tensor& loss) const {
  return loss * scale_.to(loss.device()).to(loss.scalar_type());
}

bool GradScaler::unscale_(const std::vector<torch::Tensor>& params) {
  std::vector<torch::Tensor> grads;
  for (const auto& p : params) {
    if (p.grad().defined()) grads.push_back(p.grad());
  }
  found_inf_.zero_();
  if (grads.empty()) return false;
  // The reciprocal is taken in float64 and rounded to float32, exactly as torch.amp.GradScaler does.
  const auto inv_scale = scale_.to(torch::kFloat64).reciprocal().to(torch::kFloat32);
  at::_amp_foreach_non_finite_check_and_unscale_(grads, found_inf_, inv_scale);
  return found_inf_.item<float>() != 0.0f;
}

void GradScaler::update(bool found_inf) {
  if (!options_.dynamic()) return;  // a static scale (DeepSpeed's LossScaler) never changes
  const bool pytorch_rule = !options_.deepspeed_schedule() && options_.hysteresis() == 1 &&
                            !options_.consecutive_hysteresis() && options_.min_scale() == 0;
  if (!pytorch_rule) {
    update_deepspeed(found_inf);
    return;
  }
  found_inf_.fill_(found_inf ? 1.0f : 0.0f);
  at::_amp_update_scale_(scale_, growth_tracker_, found_inf_, options_.growth_factor(),
                         options_.backoff_factor(), options_.growth_interval());
}

// DeepSpeed's DynamicLossScaler.update_scale, with the clean steps since the last overflow as the tracker
// (DeepSpeed's cur_iter - last_overflow_iter). On the host: the flag is already there, and the scale is a
// power of two times the initial one, exact in float32.
void GradScaler::update_deepspeed(bool found_inf) {
  double scale = get_scale();
  std::int64_t clean = growth_tracker();
  if (found_inf) {
    if (hysteresis_left_ <= 1) {
      if (options_.min_scale() > 0 && scale == options_.min_scale()) {  // DeepSpeed compares exactly
        throw UsageError(fmt::format(
            "fp16: the gradients overflowed (inf/NaN) while the loss scale is already at its minimum {} "
            "(DeepSpeed stops here too: \"Current loss scale already at minimum\"); the loss or a gradient "
            "is not finite even unscaled: check the model and data, lower the learning rate, lower "
            "min_loss_scale, or train in bf16",
            options_.min_scale()));
      }
      scale = std::max(scale * options_.backoff_factor(), options_.min_scale());
    } else {
      --hysteresis_left_;
    }
    clean = 0;
  } else {
    if (options_.consecutive_hysteresis()) hysteresis_left_ = options_.hysteresis();
    ++clean;
    const std::int64_t stable = options_.deepspeed_schedule() ? clean - 1 : clean;
    if (stable > 0 && stable % options_.growth_interval() == 0) {
      hysteresis_left_ = options_.hysteresis();
      scale *= options_.growth_factor();
    }
  }
  scale_.fill_(scale);
  growth_tracker_.fill_(static_cast<std::int32_t>(std::min<std::int64_t>(clean, INT32_MAX)));
}

double GradScaler::get_scale() const {
  return scale_.item<float>();
}

std::int64_t GradScaler::growth_tracker() const {
  return growth_tracker_.item<std::int32_t>();
}

std::map<std::string, torch::Tensor> GradScaler::state_dict() const {
  return {{"scale", scale_.cpu().clone()},
          {"growth_tracker", growth_tracker_.cpu().clone()},
          {"hysteresis", torch::tensor({hysteresis_left_}, torch::kInt64)}};
}

void GradScaler::load_state_dict(const std::map<std::string, torch::Tensor>& state) {
  for (const char* key : {"scale", "growth_tracker"}) {
    auto it = state.find(key);
    if (it == state.end()) {
      throw CheckpointError(
          fmt::format("GradScaler state has no '{}' entry; was it saved by a GradScaler?", key));
    }
  }
  scale_.copy_(state.at("scale"));
  growth_tracker_.copy_(state.at("growth_tracker"));
  auto h = state.find("hysteresis");
  const std::int64_t left = h == state.end() ? options_.hysteresis() : h->second.item<std::int64_t>();
  if (left < 1) {
    throw CheckpointError(
        fmt::format("GradScaler state: hysteresis {} is below 1; the checkpoint is damaged", left));
  }
  hysteresis_left_ = std::min(left, options_.hysteresis());  // a run resumed with a smaller hysteresis
}

}  // namespace accel
