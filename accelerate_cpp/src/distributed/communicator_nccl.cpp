// ProcessGroupNCCL construction. Compiled with ACCEL_WITH_NCCL when LibTorch has CUDA; NCCL itself is linked
// only through libtorch_cuda (never the system libnccl).
#include <accel/errors.hpp>

#include "distributed/c10d_backends.hpp"

#ifdef ACCEL_WITH_NCCL
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

namespace accel::detail {

#ifdef ACCEL_WITH_NCCL
bool nccl_compiled() {
  return true;
}

c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                                    int size, std::chrono::milliseconds timeout) {
  auto options = c10d::ProcessGroupNCCL::Options::create();
  options->timeout = timeout;
  return c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, options);
}
#else
bool nccl_compiled() {
  return false;
}

c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>&, int, int,
                                                    std::chrono::milliseconds) {
  throw UnsupportedOperation(
      "this build of accelerate-cpp has no NCCL support (LibTorch without CUDA, or NCCL headers missing at "
      "build time); train on CPU with `use_cpu: true` or rebuild against a CUDA LibTorch");
}
#endif

}  // namespace accel::detail
