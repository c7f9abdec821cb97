#pragma once
// Small models and datasets shared by the LibTorch tests.

#include <accel/accelerator/accelerator.hpp>

#include <torch/torch.h>

#include "temp_dir.hpp"

#include <unistd.h>

#include <filesystem>
#include <string>

namespace accel::test {

/// A regression dataset with a fixed seed: x ~ N(0,1)^in, y = x.w + noise.
struct Regression : torch::data::datasets::Dataset<Regression> {
  explicit Regression(std::int64_t n, std::int64_t in = 6, std::uint64_t seed = 7) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
    x = torch::randn({n, in}, gen);
    y = x.matmul(torch::linspace(-1, 1, in)).unsqueeze(1) + 0.1 * torch::randn({n, 1}, gen);
  }
  torch::data::Example<> get(std::size_t i) override {
    return {x[static_cast<std::int64_t>(i)], y[static_cast<std::int64_t>(i)]};
  }
  torch::optional<std::size_t> size() const override { return static_cast<std::size_t>(x.size(0)); }
  torch::Tensor x, y;
};

struct MlpImpl : torch::nn::Module {
  explicit MlpImpl(std::int64_t in = 6, double dropout = 0.0)
      : fc1(register_module("fc1", torch::nn::Linear(in, 16))),
        drop(register_module("drop", torch::nn::Dropout(dropout))),
        fc2(register_module("fc2", torch::nn::Linear(16, 1))) {}
  torch::Tensor forward(torch::Tensor x) { return fc2(drop(torch::relu(fc1(x)))); }
  torch::nn::Linear fc1;
  torch::nn::Dropout drop;
  torch::nn::Linear fc2;
};
TORCH_MODULE(Mlp);

/// A config with defaults and the given overrides, as a user's YAML would give.
inline Config make_config(MixedPrecision mp = MixedPrecision::No, int accumulation = 1) {
  Config c;
  c.mixed_precision = mp;
  c.gradient_accumulation_steps = accumulation;
  c.use_cpu = true;
  return c;
}

/// Copies every parameter of a module (detached, cloned) in registration order.
inline std::vector<torch::Tensor> snapshot(const torch::nn::Module& m) {
  std::vector<torch::Tensor> out;
  for (const auto& p : m.parameters())
    out.push_back(p.detach().clone());
  return out;
}

}  // namespace accel::test
