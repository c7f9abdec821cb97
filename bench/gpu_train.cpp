// Samples per second of a single-GPU bf16 training loop through the Accelerator (issue 27), the loop a user
// writes: a prepared, shuffling, pinned-memory loader, autocast from mixed_precision, accelerator.backward,
// AdamW. Two models:
//   cnn          the Fashion-MNIST CNN of examples/fashion_mnist on the real training images
//   transformer  a small transformer encoder classifier (d_model 256, 4 heads, FF 1024, 4 layers, 128 tokens)
//                on random tokens
// bench/peers/gpu_train.py runs the same models and loop in PyTorch and in HF Accelerate; bench/gpu_bench.sh
// runs all of them side by side and prints the ratios.
//   bench_gpu_train --model cnn|transformer [--batch 256] [--steps 300] [--warmup 30] [--optim fused|torch]
//                   [--precision bf16|no] [--limit 20000]
#include <accel/accelerator/accelerator.hpp>
#include <accel/optim/optim.hpp>

#include <torch/cuda.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <memory>
#include <string>

#include "../examples/fashion_mnist/fashion_mnist.hpp"
#include "bench_args.hpp"

namespace {

struct TinyTransformerImpl : torch::nn::Module {
  TinyTransformerImpl()
      : embed(register_module("embed", torch::nn::Embedding(1000, 256))),
        encoder(register_module(
            "encoder", torch::nn::TransformerEncoder(torch::nn::TransformerEncoderOptions(
                           torch::nn::TransformerEncoderLayerOptions(256, 4).dim_feedforward(1024), 4)))),
        head(register_module("head", torch::nn::Linear(256, 10))) {}
  torch::Tensor forward(const torch::Tensor& tokens) {  // [N, S] -> [N, 10]
    auto x = encoder(embed(tokens).transpose(0, 1));    // [S, N, 256], as PyTorch's batch_first=False
    return head(x.mean(0));
  }
  torch::nn::Embedding embed;
  torch::nn::TransformerEncoder encoder;
  torch::nn::Linear head;
};
TORCH_MODULE(TinyTransformer);

// Random tokens, label = token sum mod 10 (learnable, not trivial).
struct Tokens : torch::data::datasets::Dataset<Tokens> {
  explicit Tokens(std::int64_t n) {
    torch::manual_seed(0);
    x = torch::randint(1000, {n, 128}, torch::kInt64);
    y = x.sum(1).remainder(10);
  }
  torch::data::Example<> get(std::size_t i) override {
    return {x[static_cast<std::int64_t>(i)], y[static_cast<std::int64_t>(i)]};
  }
  torch::optional<std::size_t> size() const override { return static_cast<std::size_t>(x.size(0)); }
  torch::Tensor x, y;
};

template <class Model, class Dataset>
void run(Model& model, Dataset dataset, const std::string& name, const std::string& optim,
         const std::string& precision, int batch, int steps, int warmup) {
  accel::Accelerator acc(accel::AcceleratorOptions().mixed_precision(
      precision == "bf16" ? accel::MixedPrecision::Bf16 : accel::MixedPrecision::No));
  std::unique_ptr<torch::optim::Optimizer> opt;
  if (optim == "fused") {
    opt = std::make_unique<accel::optim::AdamW>(model->parameters(), torch::optim::AdamWOptions(1e-3));
  } else {
    opt = std::make_unique<torch::optim::AdamW>(model->parameters(), torch::optim::AdamWOptions(1e-3));
  }
  acc.prepare(model, *opt);
  auto loader = acc.prepare_data_loader(
      std::move(dataset).map(torch::data::transforms::Stack<>()),
      accel::DataLoaderOptions(static_cast<std::size_t>(batch)).shuffle(true).pin_memory(true));
  int done = 0;
  double loss_sum = 0;
  auto start = std::chrono::steady_clock::now();
  while (done < warmup + steps) {
    for (auto& b : *loader) {
      if (done == warmup) {
        if (acc.device().is_cuda()) torch::cuda::synchronize();
        start = std::chrono::steady_clock::now();
      }
      auto loss = torch::cross_entropy_loss(model->forward(b.data), b.target);
      acc.backward(loss);
      opt->step();
      opt->zero_grad();
      if (++done >= warmup + steps) {
        loss_sum = loss.template item<double>();
        break;
      }
    }
  }
  if (acc.device().is_cuda()) torch::cuda::synchronize();
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf(
      "gpu_train impl=accelerate-cpp(%s) model=%s precision=%s batch=%d steps=%d device=%s "
      "samples/s=%.1f last_loss=%.4f\n",
      optim == "fused" ? "accel::optim::AdamW" : "torch::optim::AdamW", name.c_str(), precision.c_str(),
      batch, steps, acc.device().str().c_str(), steps * static_cast<double>(batch) / s, loss_sum);
}

}  // namespace

int main(int argc, char** argv) {
  std::string model = "cnn", optim = "fused", precision = "bf16";
  int batch = 256, steps = 300, warmup = 30;
  std::int64_t limit = 20000;
  bench::Flags()
      .add("--model", model)
      .add("--optim", optim)
      .add("--precision", precision)
      .add("--batch", batch)
      .add("--steps", steps)
      .add("--warmup", warmup)
      .add("--limit", limit)
      .parse(argc, argv);
  torch::manual_seed(0);
  if (model == "cnn") {
    fashion::Net net;
    run(net, fashion::Dataset(fashion::default_data_dir(), /*train=*/true, limit), model, optim, precision,
        batch, steps, warmup);
  } else if (model == "transformer") {
    TinyTransformer net;
    run(net, Tokens(limit), model, optim, precision, batch, steps, warmup);
  } else {
    std::fprintf(stderr, "bench_gpu_train: --model must be cnn or transformer, not '%s'\n", model.c_str());
    return 2;
  }
  return 0;
}
