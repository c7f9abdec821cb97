#pragma once
/// \file local_backend.hpp
/// The single-process backend: the model stays whole on one device; nothing is communicated.

#include <accel/backend.hpp>

#include <memory>

namespace accel::backends {

/// Makes the local backend. Throws UsageError when asked to run with more than one process.
std::unique_ptr<Backend> make_local_backend(const BackendContext& context);

}  // namespace accel::backends
