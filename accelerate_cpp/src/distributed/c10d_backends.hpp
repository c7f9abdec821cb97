#pragma once
// Private: c10d backend construction, split so that only one translation unit needs the NCCL/CUDA headers.

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>

namespace accel::detail {

/// Whether this build can create NCCL process groups (LibTorch with CUDA and NCCL headers at build time).
bool nccl_compiled();

/// ProcessGroupNCCL over `store`; throws UnsupportedOperation when not compiled in.
c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                                    int size, std::chrono::milliseconds timeout);

}  // namespace accel::detail
