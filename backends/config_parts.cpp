// The config side of the built-in backends (torch-free; compiled into accel_config, which accel-launch links
// without LibTorch). The list is backends/builtin_backends.def, shared with register_builtin.cpp.
#include "config/config_detail.hpp"

namespace accel::config_detail {

#define ACCEL_BACKEND(name) BackendPart name##_config_part();
#include "builtin_backends.def"
#undef ACCEL_BACKEND

const std::vector<BackendPart>& backend_parts() {
  static const std::vector<BackendPart> kParts = [] {
    std::vector<BackendPart> parts;
#define ACCEL_BACKEND(name) parts.push_back(name##_config_part());
#include "builtin_backends.def"
#undef ACCEL_BACKEND
    return parts;
  }();
  return kParts;
}

}  // namespace accel::config_detail
