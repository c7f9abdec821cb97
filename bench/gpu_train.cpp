// Samples per second of a single-GPU bf16 training loop through the Accelerator (issue 27), the loop a user
// writes: a prepared, shuffling, pinned-memory loader, autocast from mixed_precision, accelerator.backward,
// AdamW. Two models:
//   cnn          the Fashion-MNIST CNN of examples/fashion_mnist on the real training images
//   transformer  a small transformer encoder classifier (d_model 256, 4 heads, FF 1024, 4 layers, 128 tokens)
//                on random tokens
// With --impl trainer the same training goes through accel::Trainer (HF's defaults: constant schedule here,
// clipping at 1.0, AdamW), timed by a callback from the end of step `warmup` to the end of the last step.
// bench/peers/gpu_train.py runs the same models and loop in PyTorch, in HF Accelerate and through HF's
// Trainer; bench/gpu_bench.sh runs all of them side by side and prints the ratios.
//   bench_gpu_train --model cnn|transformer [--impl loop|trainer] [--batch 256] [--steps 300] [--warmup 30]
//                   [--optim fused|torch] [--precision bf16|no] [--limit 20000]
#include <accel/accelerator/accelerator.hpp>
#include <accel/optim/optim.hpp>
#include <accel/trainer/trainer.hpp>

#include <torch/cuda.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <memory>
#include <string>

#include "../examples/fashion_mnist/fashion_mnist.hpp"
#include "bench_args.hpp"

namespace bench_gpu_train {

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

// The end of step `from` and of step `to`, after a device synchronisation.
struct StepClock : accel::TrainerCallback {
  StepClock(std::int64_t f, std::int64_t t, bool cuda) : from(f), to(t), on_cuda(cuda) {}
  std::string name() const override { return "StepClock"; }
  void on_step_end(const accel::TrainingArguments&, accel::TrainerState& s, accel::TrainerControl&) override {
    if (s.global_step != from && s.global_step != to) return;
    if (on_cuda) torch::cuda::synchronize();
    (s.global_step == from ? start : stop) = std::chrono::steady_clock::now();
  }
  std::int64_t from, to;
  bool on_cuda;
  std::chrono::steady_clock::time_point start, stop;
};

template <class Model, class Dataset>
void run_trainer(Model& model, Dataset dataset, const std::string& name, const std::string& optim,
                 const std::string& precision, int batch, int steps, int warmup) {
  accel::TrainingArguments args;
  args.output_dir = "/tmp/accel_bench_gpu_trainer";
  args.per_device_train_batch_size = batch;
  args.max_steps = warmup + steps;
  args.learning_rate = 1e-3;
  args.lr_scheduler_type = "constant";
  args.optim = optim == "fused" ? "adamw_torch_fused" : "adamw_torch";
  args.bf16 = precision == "bf16";
  args.save_strategy = "no";
  args.disable_tqdm = true;
  args.seed = 0;
  args.validate();
  accel::Trainer trainer(
      args, model, std::move(dataset).map(torch::data::transforms::Stack<>()),
      [&](auto& b) { return torch::cross_entropy_loss(model->forward(b.data), b.target); });
  const bool cuda = trainer.accelerator().device().is_cuda();
  auto clock = std::make_shared<StepClock>(warmup, warmup + steps, cuda);
  trainer.add_callback(clock);
  const auto out = trainer.train();
  const double s = std::chrono::duration<double>(clock->stop - clock->start).count();
  std::printf(
      "gpu_train impl=accelerate-cpp-trainer(%s) model=%s precision=%s batch=%d steps=%d device=%s "
      "samples/s=%.1f training_loss=%.4f\n",
      args.optim.c_str(), name.c_str(), precision.c_str(), batch, steps,
      trainer.accelerator().device().str().c_str(), steps * static_cast<double>(batch) / s,
      out.training_loss);
}

int run(int argc, char** argv) try {
  std::string model = "cnn", optim = "fused", precision = "bf16", impl = "loop";
  int batch = 256, steps = 300, warmup = 30;
  std::int64_t limit = 20000;
  bench::Flags()
      .add("--impl", impl)
      .add("--model", model)
      .add("--optim", optim)
      .add("--precision", precision)
      .add("--batch", batch)
      .add("--steps", steps)
      .add("--warmup", warmup)
      .add("--limit", limit)
      .parse(argc, argv);
  if (impl != "loop" && impl != "trainer") {
    std::fprintf(stderr, "bench_gpu_train: --impl must be loop or trainer, not '%s'\n", impl.c_str());
    return 2;
  }
  torch::manual_seed(0);
  if (model == "cnn") {
    fashion::Net net;
    fashion::Dataset data(fashion::default_data_dir(), /*train=*/true, limit);
    if (impl == "trainer") {
      run_trainer(net, std::move(data), model, optim, precision, batch, steps, warmup);
    } else {
      run(net, std::move(data), model, optim, precision, batch, steps, warmup);
    }
  } else if (model == "transformer") {
    TinyTransformer net;
    if (impl == "trainer") {
      run_trainer(net, Tokens(limit), model, optim, precision, batch, steps, warmup);
    } else {
      run(net, Tokens(limit), model, optim, precision, batch, steps, warmup);
    }
  } else {
    std::fprintf(stderr, "bench_gpu_train: --model must be cnn or transformer, not '%s'\n", model.c_str());
    return 2;
  }
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "bench_gpu_train: %s\n", e.what());
  return 1;
}

}  // namespace bench_gpu_train
