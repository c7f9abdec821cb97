// What QLoRA's 4-bit base costs and saves against the full-precision layer: bytes held per base parameter
// (measured from the tensors a Linear4bit holds) and the time of forward + backward (to the input, as under
// LoRA adapters) of Linear4bit (NF4, double quantisation, dequantised per call) against torch::nn::Linear
// with the same weights, interleaved in rounds; and the same for a LoRA-adapted layer (r 8) over each base.
//
//   build/bench/bench_qlora [--rounds 7] [--steps 20] [--width 4096] [--batch 16] [--device cpu|cuda]
#include <accel/nn/lora.hpp>
#include <accel/nn/quant4bit.hpp>

#include "bench_args.hpp"

#include <torch/cuda.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <iostream>

namespace bench_qlora {

using Clock = std::chrono::steady_clock;

struct NetImpl : torch::nn::Module {
  explicit NetImpl(int width) { register_module("proj", torch::nn::Linear(width, width)); }
  torch::Tensor forward(const torch::Tensor& x) {
    auto m = named_children()["proj"];
    if (auto q = m->as<accel::quant::Linear4bit>()) return q->forward(x);
    return m->as<torch::nn::Linear>()->forward(x);
  }
};
TORCH_MODULE(Net);

int run(int argc, char** argv) try {
  int rounds = 7, steps = 20, width = 4096, batch = 16;
  std::string device_name = "cpu";
  bench::Flags()
      .add("--device", device_name)
      .add("--rounds", rounds)
      .add("--steps", steps)
      .add("--width", width)
      .add("--batch", batch)
      .parse(argc, argv);
  const torch::Device device(device_name);
  auto sync = [&] {
    if (device.is_cuda()) torch::cuda::synchronize();
  };
  torch::manual_seed(0);
  Net full(width), quant(width);
  {
    torch::NoGradGuard no_grad;
    auto w = full->named_parameters()["proj.weight"];
    w.normal_(0, 0.02);  // weights as trained models have them (NF4 is built for normal weights)
    quant->named_parameters()["proj.weight"].copy_(w);
    quant->named_parameters()["proj.bias"].copy_(full->named_parameters()["proj.bias"]);
  }
  accel::quant::quantize_linears(*quant);
  full->to(device);
  quant->to(device);
  auto q4 = quant->named_children()["proj"]->as<accel::quant::Linear4bit>();
  const double params = static_cast<double>(width) * width;
  const double bytes4 = static_cast<double>(q4->quantized().bytes());
  const auto w = full->named_parameters()["proj.weight"].detach();
  const double err =
      ((q4->dequantized_weight().to(w.device()) - w).abs().mean() / w.abs().mean()).item<double>();
  std::printf(
      "qlora base %dx%d on %s: bytes per parameter fp32 4.000, bf16 2.000, nf4+double-quant %.4f "
      "(%.1fx less than bf16); mean |dequantised - w| / mean |w| = %.4f\n",
      width, width, device.str().c_str(), bytes4 / params, 2.0 / (bytes4 / params), err);
  auto x = torch::randn({batch, width}, device);
  auto time_model = [&](Net& net) {
    const auto start = Clock::now();
    for (int s = 0; s < steps; ++s) {
      auto in = x.clone().requires_grad_(true);
      net->forward(in).sum().backward();
    }
    sync();
    return std::chrono::duration<double, std::milli>(Clock::now() - start).count() / steps;
  };
  // The base is frozen in both (as under LoRA): backward computes the input's gradient only.
  for (auto& p : full->parameters())
    p.set_requires_grad(false);
  for (auto& p : quant->parameters())
    p.set_requires_grad(false);
  for (const bool lora : {false, true}) {
    if (lora) {
      accel::peft::LoraConfig c;
      c.r = 8;
      c.lora_alpha = 16;
      c.target_modules = {"proj"};
      accel::peft::get_peft_model(full.ptr(), c);  // both stay adapted for the rest of the program
      accel::peft::get_peft_model(quant.ptr(), c);
    }
    time_model(full);  // warm-up
    time_model(quant);
    std::vector<double> tf, tq;
    for (int r = 0; r < rounds; ++r) {
      tf.push_back(time_model(full));
      tq.push_back(time_model(quant));
    }
    const double mf = bench::median(tf), mq = bench::median(tq);
    std::printf("qlora %s batch %d: forward+backward Linear %.3f ms, Linear4bit %.3f ms, ratio %.2fx\n",
                lora ? "with LoRA r 8" : "base only", batch, mf, mq, mq / mf);
  }
  return 0;
} catch (const std::exception& e) {
  std::cerr << "bench_qlora: " << e.what() << "\n";
  return 1;
}

}  // namespace bench_qlora
