#include <accel/backend.hpp>

#include "local/local_backend.hpp"

namespace accel {

void register_builtin_backends(BackendRegistry& registry) {
  registry.add(BackendKind::Local, backends::make_local_backend);
}

}  // namespace accel
