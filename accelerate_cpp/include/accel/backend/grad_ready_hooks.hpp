#pragma once
/// \file grad_ready_hooks.hpp
/// Gradient-ready hooks for backends (DDP, ZeRO, and a program's own) and the facade: a callback after
/// backward's AccumulateGrad has written a parameter's .grad (never for torch::autograd::grad, which writes
/// no .grad), removed again when the owner goes away. Hooks of one parameter run in the order they were
/// added.

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

namespace accel {

/// Owns post hooks on the gradient accumulators of some parameters. Not copyable; the callback must stay
/// valid for the lifetime of this object.
class GradReadyHooks {
 public:
  GradReadyHooks() = default;
  GradReadyHooks(const GradReadyHooks&) = delete;
  GradReadyHooks& operator=(const GradReadyHooks&) = delete;
  ~GradReadyHooks() {
    for (auto& [node, key] : hooks_)
      node->del_post_hook(key);
  }

  /// Calls `on_ready(index)` each time backward has accumulated the gradient of `param`.
  void add(const torch::Tensor& param, std::size_t index, std::function<void(std::size_t)> on_ready) {
    auto acc = torch::autograd::impl::grad_accumulator(param);
    const auto key = acc->add_post_hook(std::make_unique<Hook>(std::move(on_ready), index));
    hooks_.emplace_back(std::move(acc), key);  // keeping the node alive keeps the hook alive
  }

 private:
  class Hook final : public torch::autograd::FunctionPostHook {
   public:
    Hook(std::function<void(std::size_t)> f, std::size_t index) : f_(std::move(f)), index_(index) {}
    torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                              const torch::autograd::variable_list& /*inputs*/) override {
      f_(index_);
      return outputs;
    }

   private:
    std::function<void(std::size_t)> f_;
    std::size_t index_;
  };

  std::vector<std::pair<std::shared_ptr<torch::autograd::Node>, std::uintptr_t>> hooks_;
};

}  // namespace accel
