#pragma once
/// \file open_communicator.hpp
/// A communicator whose c10d process groups are real even for one process.

#include <accel/distributed/communicator.hpp>

#include <memory>

namespace accel {

/// Like `Communicator::create`, but always opens rank 0's TCPStore and the c10d process groups (Gloo, and
/// NCCL on a CUDA device), also for a single process, as `torch.distributed.init_process_group` with
/// world_size 1 does. `create` hands one process the identity communicator instead, which is what training
/// wants; this is for exercising the transport itself on one machine or one GPU (NCCL world size 1). Each
/// call opens a new connection: with one process, give `state.master_port` a free port (0 lets the store
/// pick one). Throws DistributedError naming address, port and rank.
std::shared_ptr<Communicator> open_communicator(const ProcessState& state, torch::Device device,
                                                CommunicatorOptions options = {});

}  // namespace accel
