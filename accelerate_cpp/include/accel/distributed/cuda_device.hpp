#pragma once
/// \file cuda_device.hpp
/// Which CUDA device a rank trains on (torch-free, so the launcher and unit tests can use it).

#include <accel/distributed/process_state.hpp>

namespace accel {

/// The CUDA device index of this rank, given the devices it sees: its local rank, as torchrun and Accelerate
/// do (`cuda:<LOCAL_RANK>`). Where a rank sees fewer devices than the machine runs processes, the index wraps
/// (local rank modulo `device_count`) only for launchers that can give each rank GPUs of its own through
/// CUDA_VISIBLE_DEVICES (Slurm's --gpus-per-task, an MPI wrapper script, a single process). accel-launch and
/// torchrun give every rank of a machine the same devices, so there the ranks would share a GPU, which NCCL
/// refuses with an "invalid usage" error at the first collective: that is a UsageError here, naming the
/// counts and how to fix the config. `device_count` must be >= 1. With `ranks_may_share` (the CUDA
/// collectives go through Gloo on host copies, ACCEL_CUDA_COLLECTIVES=gloo) the index wraps for every
/// launcher.
int cuda_device_for(const ProcessState& state, int device_count, bool ranks_may_share = false);

}  // namespace accel
