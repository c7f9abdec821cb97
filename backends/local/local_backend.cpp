#include "local_backend.hpp"

#include <accel/errors.hpp>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/nn/utils/clip_grad.h>

namespace accel::backends {
namespace {

class LocalBackend final : public Backend {
 public:
  explicit LocalBackend(const BackendContext& context) : context_(context) {}

  std::string name() const override { return "local"; }

  void prepare_model(torch::nn::Module& model) override {
    if (model_ != nullptr && model_ != &model) {
      throw UsageError("the local backend prepares one model; call prepare() with each model once");
    }
    model_ = &model;
  }

  void prepare_optimizer(torch::optim::Optimizer& optimizer) override { optimizers_.push_back(&optimizer); }

  void before_backward(bool /*sync*/) override {}
  void after_backward(bool /*sync*/) override {}

  double clip_grad_norm(double max_norm, double norm_type) override {
    std::vector<torch::Tensor> params;
    for (auto* opt : optimizers_) {
      for (auto& group : opt->param_groups()) {
        for (auto& p : group.params())
          params.push_back(p);
      }
    }
    return torch::nn::utils::clip_grad_norm_(params, max_norm, norm_type);
  }

  NamedTensors model_state() override {
    NamedTensors out;
    if (model_ == nullptr) return out;
    for (const auto& item : model_->named_parameters())
      out.emplace_back(item.key(), item.value().detach());
    for (const auto& item : model_->named_buffers())
      out.emplace_back(item.key(), item.value().detach());
    return out;
  }

  void load_model_state(const std::map<std::string, torch::Tensor>& state) override {
    if (model_ == nullptr) return;
    torch::NoGradGuard no_grad;
    auto load = [&](const std::string& name, torch::Tensor& dst) {
      auto it = state.find(name);
      if (it == state.end()) {
        throw CheckpointError(
            fmt::format("checkpoint has no tensor '{}' for the model; was it saved from the "
                        "same model architecture?",
                        name));
      }
      if (it->second.sizes() != dst.sizes()) {
        throw CheckpointError(fmt::format("checkpoint tensor '{}' has shape {} but the model expects {}",
                                          name, fmt::join(it->second.sizes(), "x"),
                                          fmt::join(dst.sizes(), "x")));
      }
      dst.copy_(it->second);
    };
    for (auto& item : model_->named_parameters())
      load(item.key(), item.value());
    for (auto& item : model_->named_buffers())
      load(item.key(), item.value());
  }

 private:
  BackendContext context_;
  torch::nn::Module* model_ = nullptr;
  std::vector<torch::optim::Optimizer*> optimizers_;
};

}  // namespace

std::unique_ptr<Backend> make_local_backend(const BackendContext& context) {
  if (context.world_size != 1) {
    throw UsageError(fmt::format(
        "the local backend runs one process, but this run has {} (rank {}); set `backend: ddp` (or "
        "distributed_type: MULTI_CPU / MULTI_GPU) in the config",
        context.world_size, context.rank));
  }
  return std::make_unique<LocalBackend>(context);
}

}  // namespace accel::backends
