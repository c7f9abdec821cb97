// The engines of the built-in backends. The list is backends/builtin_backends.def, shared with the config
// side (config_parts.cpp), so adding a backend is one folder and one line there.
#include <accel/backend/backend.hpp>

namespace accel {
namespace backends {

#define ACCEL_BACKEND(name) BackendDescriptor name##_backend_descriptor();
#include "builtin_backends.def"
#undef ACCEL_BACKEND

}  // namespace backends

void register_builtin_backends(BackendRegistry& registry) {
#define ACCEL_BACKEND(name) registry.add(backends::name##_backend_descriptor());
#include "builtin_backends.def"
#undef ACCEL_BACKEND
}

}  // namespace accel
