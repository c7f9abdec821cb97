// Accelerator::memory_report: exact bytes held in parameter, gradient and optimizer-state tensors.
#include <accel/accelerator/accelerator.hpp>

#include "checkpoint/optimizer_state.hpp"

#include <unordered_set>

namespace accel {
namespace {

class Counter {
 public:
  // Counts a tensor's storage once, however many tensors view it.
  std::uint64_t add(const torch::Tensor& t) {
    if (!t.defined() || !t.has_storage()) return 0;
    const void* key = t.storage().unsafeGetStorageImpl();
    if (!seen_.insert(key).second) return 0;
    // A storage without memory (a sharded engine's released parameter or .grad placeholder) holds 0 bytes,
    // whatever size it claims.
    if (t.storage().unsafeGetStorageImpl()->_mutable_data_ptr_no_checks().get() == nullptr) return 0;
    return t.storage().nbytes();
  }

 private:
  std::unordered_set<const void*> seen_;
};

std::vector<torch::Tensor> state_tensors(const torch::optim::OptimizerParamState& s) {
  std::vector<torch::Tensor> out;
  for (const auto& [name, t] : detail::named_state(s)) {
    if (name != "step") out.push_back(t);
  }
  return out;
}

}  // namespace

MemoryReport Accelerator::memory_report() const {
  MemoryReport r;
  Counter counter;
  for (const auto& m : prepared_.models) {
    for (const auto& p : m.module->parameters())
      r.parameters += counter.add(p);
  }
  for (auto* opt : prepared_.optimizers) {
    for (const auto& group : opt->param_groups()) {
      for (const auto& p : group.params())
        r.parameters += counter.add(p);  // sharded masters
    }
  }
  for (const auto& m : prepared_.models) {
    for (const auto& b : m.engine->parameter_buffers())
      r.parameters += counter.add(b);
  }
  for (const auto& m : prepared_.models) {
    for (const auto& p : m.module->parameters())
      r.gradients += counter.add(p.grad());
  }
  for (auto* opt : prepared_.optimizers) {
    for (const auto& group : opt->param_groups()) {
      for (const auto& p : group.params())
        r.gradients += counter.add(p.grad());
    }
  }
  for (const auto& g : prepared_.stashed_grads)
    r.gradients += counter.add(g);
  for (const auto& m : prepared_.models) {
    for (const auto& b : m.engine->gradient_buffers())
      r.gradients += counter.add(b);
  }
  for (auto* opt : prepared_.optimizers) {
    for (const auto& [key, state] : opt->state()) {
      for (const auto& t : state_tensors(*state))
        r.optimizer_state += counter.add(t);
    }
  }
  return r;
}

}  // namespace accel
