// The device the GPU tests run on: cuda:0, or the CPU in gpu_main.cpp's --on-cpu dry run.
#pragma once

#include <c10/core/Device.h>

#include "test_support.hpp"

namespace accel::test {

inline c10::Device& gpu_device() {
  static c10::Device device(c10::kCUDA, 0);
  return device;
}

/// make_config(mp) on gpu_device() (use_cpu where the dry run put the tests on the CPU).
inline Config gpu_config(MixedPrecision mp = MixedPrecision::No) {
  Config c = make_config(mp);
  c.use_cpu = !gpu_device().is_cuda();
  return c;
}

}  // namespace accel::test
