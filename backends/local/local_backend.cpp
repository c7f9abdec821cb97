#include "local_backend.hpp"

#include <accel/errors.hpp>

#include "../common/grad_utils.hpp"

#include <fmt/format.h>

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
    return detail::clip_grad_norm_local(params, max_norm, norm_type);
  }

  NamedTensors model_state() override { return model_ ? detail::module_state(*model_) : NamedTensors{}; }

  void load_model_state(const std::map<std::string, torch::Tensor>& state) override {
    if (model_) detail::load_module_state(*model_, state);
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
