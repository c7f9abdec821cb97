// The device the GPU tests run on: cuda:0, or the CPU in gpu_main.cpp's --on-cpu dry run.
#pragma once

#include <c10/core/Device.h>

#include "test_support.hpp"

#include <algorithm>
#include <limits>
#include <string>
#include <utility>
#include <vector>

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

/// A state dict's tensors on the CPU in fp32, in its order.
inline std::vector<torch::Tensor> on_cpu(const std::vector<std::pair<std::string, torch::Tensor>>& state) {
  std::vector<torch::Tensor> out;
  for (const auto& [name, t] : state)
    out.push_back(t.detach().to(torch::kCPU, torch::kFloat32).clone());
  return out;
}

/// The largest elementwise difference between two lists of tensors (infinity when the lists differ in
/// length).
inline double max_difference(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  if (a.size() != b.size()) return std::numeric_limits<double>::infinity();
  double d = 0;
  for (std::size_t k = 0; k < a.size(); ++k)
    d = std::max(d, (a[k] - b[k]).abs().max().item<double>());
  return d;
}

}  // namespace accel::test
