#include "local_backend.hpp"

#include <accel/errors.hpp>

#include "../common/descriptor.hpp"
#include "../common/module_state.hpp"

#include <fmt/format.h>

namespace accel::backends {
namespace {

class LocalBackend final : public Backend {
 public:
  explicit LocalBackend(const BackendContext& context) : context_(context) {}

  std::string name() const override { return "local"; }
  BackendCapabilities capabilities() const override { return {}; }

  void prepare_model(torch::nn::Module& model) override { model_ = &model; }
  void prepare_optimizer(torch::optim::Optimizer& /*optimizer*/) override {}
  void before_backward(bool /*sync*/) override {}
  void after_backward(bool /*sync*/) override {}

  GradientTensors gradients() const override { return {model_->parameters(), false, 1, {}}; }

  NamedTensors model_state() override { return detail::module_state_copy(*model_); }
  void visit_model_state(const std::function<void(NamedTensors)>& sink) override {
    sink(detail::module_state(*model_));  // read at once by the export: no copy
  }

  void load_model_state(const std::map<std::string, torch::Tensor>& state) override {
    detail::load_module_state(*model_, state);
  }

 private:
  BackendContext context_;
  torch::nn::Module* model_ = nullptr;
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

BackendDescriptor local_backend_descriptor() {
  return detail::describe("local", make_local_backend);
}

}  // namespace accel::backends
