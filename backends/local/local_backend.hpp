#pragma once
/// \file local_backend.hpp
/// The single-process backend: the model stays whole on one device; nothing is communicated. With several
/// processes the `local` name resolves to `ddp` (as Accelerate infers MULTI_CPU / MULTI_GPU).

#include <accel/backend/backend.hpp>

#include <memory>

namespace accel::backends {

/// Makes the local engine of one model. Throws UsageError when asked to run with more than one process.
std::unique_ptr<Backend> make_local_backend(const BackendContext& context);
/// The `local` descriptor.
BackendDescriptor local_backend_descriptor();

}  // namespace accel::backends
