#include <accel/backend.hpp>
#include <accel/errors.hpp>

#include <fmt/format.h>

namespace accel {

void BackendRegistry::add(BackendKind kind, BackendFactory factory) {
  factories_[kind] = std::move(factory);
}

bool BackendRegistry::contains(BackendKind kind) const {
  return factories_.count(kind) != 0;
}

std::unique_ptr<Backend> BackendRegistry::create(BackendKind kind, const BackendContext& context) const {
  auto it = factories_.find(kind);
  if (it == factories_.end()) {
    std::string known;
    for (const auto& [k, f] : factories_)
      known += (known.empty() ? "" : ", ") + to_string(k);
    throw UnsupportedOperation(
        fmt::format("backend '{}' is not available in this build of accelerate-cpp (registered: {}); set "
                    "`backend:` in the "
                    "config to one of those",
                    to_string(kind), known.empty() ? "none" : known));
  }
  return it->second(context);
}

}  // namespace accel
