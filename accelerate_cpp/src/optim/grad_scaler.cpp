#include <accel/errors.hpp>
#include <accel/optim/grad_scaler.hpp>

#include <ATen/ATen.h>
#include <fmt/format.h>

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
  found_inf_.fill_(found_inf ? 1.0f : 0.0f);
  at::_amp_update_scale_(scale_, growth_tracker_, found_inf_, options_.growth_factor(),
                         options_.backoff_factor(), options_.growth_interval());
}

double GradScaler::get_scale() const {
  return scale_.item<float>();
}

std::int64_t GradScaler::growth_tracker() const {
  return growth_tracker_.item<std::int32_t>();
}

std::map<std::string, torch::Tensor> GradScaler::state_dict() const {
  return {{"scale", scale_.cpu().clone()}, {"growth_tracker", growth_tracker_.cpu().clone()}};
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
}

}  // namespace accel
