// The device the GPU tests run on: cuda:0, or the CPU in gpu_main.cpp's --on-cpu dry run.
#pragma once

#include <c10/core/Device.h>

namespace accel::test {

inline c10::Device& gpu_device() {
  static c10::Device device(c10::kCUDA, 0);
  return device;
}

}  // namespace accel::test
