#include <accel/backend.hpp>

#include "ddp/ddp_backend.hpp"
#include "local/local_backend.hpp"
#include "zero/zero_backend.hpp"

namespace accel {

void register_builtin_backends(BackendRegistry& registry) {
  registry.add(BackendKind::Local, backends::make_local_backend);
  registry.add(BackendKind::Ddp, backends::make_ddp_backend);
  registry.add(BackendKind::Zero, backends::make_zero_backend_from_config);
  registry.add(BackendKind::Fsdp, backends::make_fsdp_backend_from_config);
}

}  // namespace accel
