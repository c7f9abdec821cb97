#pragma once
/// \file ddp_backend.hpp
/// Data-parallel training: every rank holds the whole model; gradients are averaged with bucketed,
/// asynchronous all-reduces that start during backward as soon as a bucket's gradients are ready.

#include <accel/backend/backend.hpp>

#include <memory>

namespace accel::backends {

/// Makes the DDP engine of one model (any world size, CPU over Gloo or CUDA over NCCL).
std::unique_ptr<Backend> make_ddp_backend(const BackendContext& context);
/// The `ddp` descriptor.
BackendDescriptor ddp_backend_descriptor();

}  // namespace accel::backends
