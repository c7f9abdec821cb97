#include "checkpoint/optimizer_state.hpp"

#include <accel/errors.hpp>

#include <fmt/format.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

namespace accel::detail {
namespace {

torch::Tensor step_tensor(std::int64_t step) {
  return torch::tensor(step, torch::kInt64);
}

torch::Tensor get(const std::map<std::string, torch::Tensor>& named, const std::string& key) {
  const auto it = named.find(key);
  return it == named.end() ? torch::Tensor() : it->second;
}

std::int64_t get_step(const std::map<std::string, torch::Tensor>& named) {
  const auto t = get(named, "step");
  return t.defined() ? t.item<std::int64_t>() : 0;
}

template <class AdamState>
std::vector<std::pair<std::string, torch::Tensor>> adam_state(const AdamState& a) {
  return {{"step", step_tensor(a.step())},
          {"exp_avg", a.exp_avg()},
          {"exp_avg_sq", a.exp_avg_sq()},
          {"max_exp_avg_sq", a.max_exp_avg_sq()}};
}

template <class AdamState>
std::unique_ptr<torch::optim::OptimizerParamState> make_adam_state(
    const std::map<std::string, torch::Tensor>& n) {
  auto s = std::make_unique<AdamState>();
  s->step(get_step(n));
  s->exp_avg(get(n, "exp_avg"));
  s->exp_avg_sq(get(n, "exp_avg_sq"));
  s->max_exp_avg_sq(get(n, "max_exp_avg_sq"));
  return s;
}

}  // namespace

std::string optimizer_kind(const torch::optim::Optimizer& optimizer) {
  if (dynamic_cast<const torch::optim::AdamW*>(&optimizer) != nullptr) return "adamw";
  if (dynamic_cast<const torch::optim::Adam*>(&optimizer) != nullptr) return "adam";
  if (dynamic_cast<const torch::optim::SGD*>(&optimizer) != nullptr) return "sgd";
  if (dynamic_cast<const torch::optim::RMSprop*>(&optimizer) != nullptr) return "rmsprop";
  if (dynamic_cast<const torch::optim::Adagrad*>(&optimizer) != nullptr) return "adagrad";
  return "";
}

std::vector<std::pair<std::string, torch::Tensor>> named_state(const torch::optim::OptimizerParamState& s) {
  if (const auto* a = dynamic_cast<const torch::optim::AdamWParamState*>(&s)) return adam_state(*a);
  if (const auto* a = dynamic_cast<const torch::optim::AdamParamState*>(&s)) return adam_state(*a);
  if (const auto* m = dynamic_cast<const torch::optim::SGDParamState*>(&s)) {
    return {{"momentum_buffer", m->momentum_buffer()}};
  }
  if (const auto* r = dynamic_cast<const torch::optim::RMSpropParamState*>(&s)) {
    return {{"step", step_tensor(r->step())},
            {"square_avg", r->square_avg()},
            {"momentum_buffer", r->momentum_buffer()},
            {"grad_avg", r->grad_avg()}};
  }
  if (const auto* g = dynamic_cast<const torch::optim::AdagradParamState*>(&s)) {
    return {{"step", step_tensor(g->step())}, {"sum", g->sum()}};
  }
  return {};
}

std::unique_ptr<torch::optim::OptimizerParamState> make_state(const std::string& kind,
                                                              const std::map<std::string, torch::Tensor>& n) {
  if (kind == "adam") return make_adam_state<torch::optim::AdamParamState>(n);
  if (kind == "adamw") return make_adam_state<torch::optim::AdamWParamState>(n);
  if (kind == "sgd") {
    auto s = std::make_unique<torch::optim::SGDParamState>();
    s->momentum_buffer(get(n, "momentum_buffer"));
    return s;
  }
  if (kind == "rmsprop") {
    auto s = std::make_unique<torch::optim::RMSpropParamState>();
    s->step(get_step(n));
    s->square_avg(get(n, "square_avg"));
    s->momentum_buffer(get(n, "momentum_buffer"));
    s->grad_avg(get(n, "grad_avg"));
    return s;
  }
  if (kind == "adagrad") {
    auto s = std::make_unique<torch::optim::AdagradParamState>();
    s->step(get_step(n));
    s->sum(get(n, "sum"));
    return s;
  }
  throw CheckpointError(fmt::format("optimizer state of kind '{}' cannot be rebuilt", kind));
}

void place_state_on_parameters(torch::optim::Optimizer& optimizer) {
  const auto kind = optimizer_kind(optimizer);
  if (kind.empty()) return;
  for (const auto& group : optimizer.param_groups()) {
    for (const auto& p : group.params()) {
      const auto it = optimizer.state().find(p.unsafeGetTensorImpl());
      if (it == optimizer.state().end()) continue;
      std::map<std::string, torch::Tensor> named;
      bool moved = false;
      for (auto& [name, t] : named_state(*it->second)) {
        if (t.defined() && name != "step" && t.device() != p.device()) {
          t = t.to(p.device());
          moved = true;
        }
        named[name] = t;
      }
      if (moved) it->second = make_state(kind, named);
    }
  }
}

}  // namespace accel::detail
