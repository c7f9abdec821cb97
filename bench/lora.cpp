// What accel::peft's LoRA costs per training step over the same adapters written by hand into the forward:
// an MLP of `layers` Linear(width, width) layers, LoRA of rank r on each; one process, forward + backward +
// SGD step on the adapters, interleaved in rounds. The difference is the ATen observer that applies the
// adapters of an unmodified model (it sees every operator while adapters exist).
//
//   build/bench/bench_lora [--rounds 7] [--steps 50] [--width 512] [--layers 4] [--batch 64] [--r 8]
//                          [--device cpu|cuda]
#include <accel/nn/lora.hpp>

#include "bench_args.hpp"

#include <torch/cuda.h>

#include <algorithm>
#include <chrono>
#include <iostream>

namespace bench_lora {

using Clock = std::chrono::steady_clock;

struct MlpImpl : torch::nn::Module {
  MlpImpl(int width, int layers, int r, bool hand) {
    for (int i = 0; i < layers; ++i) {
      fc.push_back(register_module("fc" + std::to_string(i), torch::nn::Linear(width, width)));
      if (hand) {
        A.push_back(register_parameter("A" + std::to_string(i), torch::randn({r, width}) * 0.01));
        B.push_back(register_parameter("B" + std::to_string(i), torch::zeros({width, r})));
      }
    }
  }
  torch::Tensor forward(torch::Tensor x) {
    for (std::size_t i = 0; i < fc.size(); ++i) {
      auto y = fc[i](x);
      if (!A.empty()) y = y + 2.0 * torch::linear(torch::linear(x, A[i]), B[i]);
      x = torch::relu(y);
    }
    return x;
  }
  std::vector<torch::nn::Linear> fc;
  std::vector<torch::Tensor> A, B;
};
TORCH_MODULE(Mlp);

using bench::median;

int run(int argc, char** argv) try {
  int rounds = 7, steps = 50, width = 512, layers = 4, batch = 64, r = 8;
  std::string device_name = "cpu";
  bench::Flags()
      .add("--device", device_name)
      .add("--rounds", rounds)
      .add("--steps", steps)
      .add("--width", width)
      .add("--layers", layers)
      .add("--batch", batch)
      .add("--r", r)
      .parse(argc, argv);
  const torch::Device device(device_name);
  torch::manual_seed(0);
  Mlp hand(width, layers, r, true);
  hand->to(device);
  for (auto& f : hand->fc)
    for (auto& p : f->parameters())
      p.set_requires_grad(false);
  Mlp peft_model(width, layers, r, false);
  torch::optim::SGD hand_opt(std::vector<torch::Tensor>{hand->A[0]}, torch::optim::SGDOptions(1e-3));
  const auto x = torch::randn({batch, width}, device);
  const auto sync = [&] {
    if (device.is_cuda()) torch::cuda::synchronize();
  };
  auto run = [&](Mlp& m, torch::optim::Optimizer& opt) {
    sync();
    const auto t0 = Clock::now();
    for (int s = 0; s < steps; ++s) {
      opt.zero_grad();
      m(x).pow(2).mean().backward();
      opt.step();
    }
    sync();
    return std::chrono::duration<double>(Clock::now() - t0).count() / steps;
  };
  // The hand-written adapters before any adapter exists (no observer installed).
  run(hand, hand_opt);
  std::vector<double> bare;
  for (int i = 0; i < rounds; ++i)
    bare.push_back(run(hand, hand_opt));
  accel::peft::LoraConfig config;
  config.r = r;
  config.lora_alpha = 2.0 * r;
  config.target_modules_regex = "fc[0-9]+";
  auto adapters = accel::peft::get_peft_model(peft_model, config);
  peft_model->to(device);
  auto trainable = [](Mlp& m) {
    std::vector<torch::Tensor> out;
    for (auto& p : m->parameters())
      if (p.requires_grad()) out.push_back(p);
    return out;
  };
  hand_opt = torch::optim::SGD(trainable(hand), torch::optim::SGDOptions(1e-3));
  torch::optim::SGD peft_opt(trainable(peft_model), torch::optim::SGDOptions(1e-3));
  run(hand, hand_opt);
  run(peft_model, peft_opt);
  std::vector<double> h, p;
  for (int i = 0; i < rounds; ++i) {
    h.push_back(run(hand, hand_opt));
    p.push_back(run(peft_model, peft_opt));
  }
  const double mb = median(bare), mh = median(h), mp = median(p);
  std::cout << "lora on " << device << " (" << layers << " x Linear(" << width << ", " << width << "), r "
            << r << ", batch " << batch << ", " << steps << " steps x " << rounds
            << " rounds): adapters written in the forward " << mb * 1e3 << " ms/step without the observer, "
            << mh * 1e3 << " ms/step with it installed; get_peft_model on "
            << "the unmodified model " << mp * 1e3 << " ms/step: " << mp / mb << "x the hand-written forward"
            << std::endl;
  return 0;
} catch (const std::exception& e) {
  std::cerr << "error: " << e.what() << std::endl;
  return 1;
}

}  // namespace bench_lora
