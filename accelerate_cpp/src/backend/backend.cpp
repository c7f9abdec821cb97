#include <accel/backend/backend.hpp>
#include <accel/config/config.hpp>
#include <accel/errors.hpp>

#include <fmt/format.h>
#include <fmt/ranges.h>

namespace accel {

GradientTensors Backend::gradients() const {
  throw UnsupportedOperation(
      fmt::format("{} does not support gradients() (needed by clip_grad_norm_)", name()));
}

NamedTensors Backend::model_state() {
  throw UnsupportedOperation(
      fmt::format("{} does not support model_state() (needed by get_state_dict and save_state)", name()));
}

void Backend::load_model_state(const std::map<std::string, torch::Tensor>& /*state*/) {
  throw UnsupportedOperation(
      fmt::format("{} does not support load_model_state() (needed by load_state)", name()));
}

void BackendRegistry::add(BackendDescriptor descriptor) {
  auto name = descriptor.name;
  descriptors_[name] = std::move(descriptor);
}

bool BackendRegistry::contains(const std::string& name) const {
  return descriptors_.count(name) != 0;
}

std::vector<std::string> BackendRegistry::names() const {
  std::vector<std::string> out;
  for (const auto& [name, d] : descriptors_)
    out.push_back(name);
  return out;
}

const BackendDescriptor& BackendRegistry::resolve(const std::string& requested, int world_size) const {
  const std::string name = backend_for_processes(requested, world_size);
  auto it = descriptors_.find(name);
  if (it == descriptors_.end()) {
    const auto known = names();
    throw UnsupportedOperation(
        fmt::format("backend '{}' is not available in this build of accelerate-cpp (registered: {}); set "
                    "`backend:` in the config to one of those",
                    name, known.empty() ? std::string("none") : fmt::format("{}", fmt::join(known, ", "))));
  }
  return it->second;
}

}  // namespace accel
