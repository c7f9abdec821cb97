#pragma once
/// \file fsdp_backend.hpp
/// `backend: fsdp` (Accelerate's `distributed_type: FSDP`), read from `fsdp_config:`: NO_SHARD runs the DDP
/// engine, SHARD_GRAD_OP the ZeRO stage-2 engine, FULL_SHARD the fully sharded engine with FSDP's wrap
/// policies and `no_sync` accumulation (gradients stay local until the sync step).

#include <accel/backend/backend.hpp>

namespace accel::backends {

/// The `fsdp` descriptor.
BackendDescriptor fsdp_backend_descriptor();

}  // namespace accel::backends
