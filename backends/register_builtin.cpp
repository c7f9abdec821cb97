#include <accel/backend.hpp>

#include "ddp/ddp_backend.hpp"
#include "fsdp/fsdp_backend.hpp"
#include "local/local_backend.hpp"
#include "zero/zero_backend.hpp"

namespace accel {

void register_builtin_backends(BackendRegistry& registry) {
  registry.add(backends::local_backend_descriptor());
  registry.add(backends::ddp_backend_descriptor());
  registry.add(backends::zero_backend_descriptor());
  registry.add(backends::fsdp_backend_descriptor());
}

}  // namespace accel
