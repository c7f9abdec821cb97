#pragma once
// Private: how prepare puts a model on the accelerator's device.

#include <ATen/core/grad_mode.h>
#include <torch/nn/module.h>

namespace accel::detail {

/// `model.to(device)` in place (the optimizer's parameter handles stay valid), gradients included: LibTorch's
/// Module::to moves parameters and buffers but leaves a parameter's existing gradient where it was, where
/// PyTorch's Module.to moves it too. A gradient left from a loop run before prepare (a model pretrained on
/// the CPU, then prepared for a GPU) would otherwise stay on the CPU, and the first backward that accumulates
/// into it fails with "Expected all tensors to be on the same device" (seen on the H200).
inline void move_module(torch::nn::Module& model, const torch::Device& device) {
  model.to(device);
  const at::NoGradGuard no_grad;
  for (auto& p : model.parameters()) {
    if (p.grad().defined() && p.grad().device() != device) p.mutable_grad() = p.grad().to(device);
  }
}

}  // namespace accel::detail
