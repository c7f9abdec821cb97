#pragma once
// After a synchronising backward a sharded engine (ZeRO 1/2/3, SHARD_GRAD_OP, FULL_SHARD) holds each
// parameter's reduced gradient in the optimizer's shard, not in the parameter's .grad. Code that reads .grad
// then (LibTorch's torch::nn::utils::clip_grad_norm_, kept from a DDP loop) found no gradient and did
// nothing, silently (issue 29, item 8). GradSentinels gives each such parameter a .grad of its shape that
// holds no memory and throws on any data access, with a message naming accelerator.clip_grad_norm_; the
// engine takes them away before the next backward and when it ends.

#include <torch/types.h>

#include <functional>
#include <string>
#include <vector>

namespace accel::backends::detail {

class GradSentinels {
 public:
  /// Gives every parameter `params[i]` with `managed(i)`, requires_grad and no .grad a sentinel .grad.
  /// `names` and `backend` go into the message.
  void plant(std::vector<torch::Tensor>& params, const std::vector<std::string>& names,
             const std::string& backend, const std::function<bool(std::size_t)>& managed);
  /// Takes the planted sentinels away (a .grad that is not ours is left alone).
  void clear(std::vector<torch::Tensor>& params) noexcept;
  bool planted() const noexcept { return planted_; }

 private:
  std::vector<torch::Tensor> sentinels_;  // per parameter index; undefined until first planted
  bool planted_ = false;
};

}  // namespace accel::backends::detail
