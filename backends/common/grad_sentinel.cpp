#include "grad_sentinel.hpp"

#include "storage_guard.hpp"

#include <fmt/format.h>

namespace accel::backends::detail {

void GradSentinels::plant(std::vector<torch::Tensor>& params, const std::vector<std::string>& names,
                          const std::string& backend, const std::function<bool(std::size_t)>& managed) {
  sentinels_.resize(params.size());
  for (std::size_t i = 0; i < params.size(); ++i) {
    auto& p = params[i];
    if (!managed(i) || !p.requires_grad() || p.grad().defined()) continue;
    if (!sentinels_[i].defined()) {
      // The parameter's shape over a storage that has the size but no memory (a null data pointer, so memory
      // reports count 0 bytes): views of it work, any read or write of its data throws.
      auto s = torch::empty({0}, p.options().requires_grad(false));
      s.unsafeGetTensorImpl()->set_sizes_contiguous(p.sizes());
      mark_memoryless(
          s,
          fmt::format(
              "accelerate-cpp: parameter '{}' has no gradient in .grad under the {} backend: after a "
              "synchronising accelerator.backward its reduced gradient lives in the optimizer's shard. Clip "
              "with accelerator.clip_grad_norm_(max) (or accelerator.clip_grad_norm_(model->parameters(), "
              "max)), not torch::nn::utils::clip_grad_norm_, which would find no gradient here and clip "
              "nothing",
              i < names.size() ? names[i] : std::to_string(i), backend));
      sentinels_[i] = s;
    }
    p.mutable_grad() = sentinels_[i];
    planted_ = true;
  }
}

void GradSentinels::clear(std::vector<torch::Tensor>& params) noexcept {
  if (!planted_) return;
  for (std::size_t i = 0; i < params.size() && i < sentinels_.size(); ++i) {
    if (sentinels_[i].defined() && params[i].grad().defined() && params[i].grad().is_same(sentinels_[i]))
      params[i].mutable_grad() = torch::Tensor();
  }
  planted_ = false;
}

}  // namespace accel::backends::detail
