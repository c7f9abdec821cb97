// The CUDA path on one GPU (issue 27): training on cuda:0 through the Accelerator in fp32, bf16 and fp16
// against the same loop on the CPU, the GradScaler on CUDA tensors, accel::optim's fused CUDA kernels against
// torch::optim, activation checkpointing with the CUDA RNG state, the pinned-memory loader, NCCL at world
// size 1 through the Communicator, save_state / load_state across CPU and GPU runs, and ZeRO-Offload on one
// GPU (optimizer state on the CPU). Built everywhere; gpu_main.cpp skips the whole executable (exit 77,
// counted by CTest as skipped) where there is no GPU.
//
// Tolerances, and why:
//  - fp32 on the GPU vs the CPU: rtol 1e-4, atol 1e-5 after 10 SGD steps (cuBLAS sums in another order;
//    LibTorch leaves TF32 off for matmul by default, so the products are fp32).
//  - bf16 / fp16 autocast on the GPU vs fp32 on the CPU: 2e-2 (the forward's rounding, as the CPU bf16 test).
//  - fused accel::optim vs torch::optim, both on CUDA: 1e-5, as on the CPU.
//  - ZeRO-Offload (fused AdamW on the CPU) vs the GPU-only run (fused AdamW on the GPU): 1e-5.
//  - activation checkpointing: bitwise (the same kernels replay the same CUDA RNG draws).
#include <catch2/catch.hpp>

#include "distributed/one_process_collectives.hpp"
#include "free_port.hpp"
#include "gpu_device.hpp"
#include "test_support.hpp"

#include <accel/distributed/open_communicator.hpp>
#include <accel/nn/activation_checkpoint.hpp>
#include <accel/optim/optim.hpp>

#include <ATen/autocast_mode.h>
#include <torch/cuda.h>
#include <torch/torch.h>

#include <limits>
#include <memory>
#include <string>
#include <vector>

using accel::Accelerator;
using accel::AcceleratorOptions;
using accel::Config;
using accel::MixedPrecision;
using accel::test::gpu_config;
using accel::test::Mlp;
using accel::test::Regression;

namespace {

// cuda:0; gpu_main.cpp's --on-cpu dry run (the tests' own logic checked where there is no GPU) sets the CPU.
torch::Device& kGpu = accel::test::gpu_device();

// Every parameter on the CPU, detached.
std::vector<torch::Tensor> cpu_snapshot(const torch::nn::Module& m) {
  std::vector<torch::Tensor> out;
  for (const auto& p : m.parameters())
    out.push_back(p.detach().to(torch::kCPU).clone());
  return out;
}

void require_close(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b, double rtol,
                   double atol) {
  REQUIRE(a.size() == b.size());
  for (std::size_t k = 0; k < a.size(); ++k) {
    INFO("tensor " << k << ": max difference " << (a[k] - b[k]).abs().max().item<double>());
    REQUIRE(torch::allclose(a[k], b[k], rtol, atol));
  }
}

struct Run {
  std::vector<torch::Tensor> params;
  torch::Device device = torch::kCPU;
  torch::ScalarType output_dtype = torch::kFloat32;
  torch::ScalarType master_dtype = torch::kFloat32;
  int skipped = 0;
  double scale = 0;  // the loss scale at the end (fp16)
};

// 10 SGD steps of the regression MLP through the Accelerator with `config`; the data lives on the CPU and
// goes to the accelerator's device as a user's batches would.
Run train_mlp(const Config& config, int steps = 10) {
  Regression data(64);
  torch::manual_seed(0);
  Mlp model;
  torch::optim::SGD opt(model->parameters(), 0.05);
  Accelerator acc(AcceleratorOptions().config(config));
  acc.prepare(model, opt);
  Run r;
  r.device = acc.device();
  for (int s = 0; s < steps; ++s) {
    opt.zero_grad();
    auto out = model(data.x.to(acc.device()));
    r.output_dtype = out.scalar_type();
    acc.backward(torch::mse_loss(out.to(torch::kFloat32), data.y.to(acc.device())));
    r.skipped += acc.optimizer_step_was_skipped() ? 1 : 0;
    opt.step();
  }
  r.master_dtype = model->fc1->weight.scalar_type();
  if (acc.scaler() != nullptr) r.scale = acc.scaler()->get_scale();
  REQUIRE(model->fc1->weight.device() == acc.device());
  r.params = cpu_snapshot(*model);
  return r;
}

}  // namespace

namespace accel::test {
void run_gpu_tests_on_cpu() {
  kGpu = torch::kCPU;
}
}  // namespace accel::test

TEST_CASE("gpu: the local backend trains on cuda:0 in fp32, bf16 and fp16 like the same loop on the CPU") {
  const Run cpu = train_mlp(accel::test::make_config());
  REQUIRE(cpu.device == torch::Device(torch::kCPU));

  const Run fp32 = train_mlp(gpu_config());
  CHECK(fp32.device == kGpu);
  CHECK(fp32.output_dtype == torch::kFloat32);
  require_close(cpu.params, fp32.params, 1e-4, 1e-5);

  const Run bf16 = train_mlp(gpu_config(MixedPrecision::Bf16));
  CHECK(bf16.output_dtype == torch::kBFloat16);  // CUDA autocast ran the forward in bf16
  CHECK(bf16.master_dtype == torch::kFloat32);   // master weights stay fp32
  require_close(cpu.params, bf16.params, 2e-2, 2e-2);
  REQUIRE_FALSE(at::autocast::is_autocast_enabled(torch::kCUDA));  // restored by the destructor

  // fp16: the scaler starts at 65536, as PyTorch's, and may skip the first steps (overflowed fp16 gradients),
  // halving the scale each time. Every step sees the same full batch, so the fp16 run equals the fp32 run
  // with that many fewer steps.
  const Run fp16 = train_mlp(gpu_config(MixedPrecision::Fp16));
  CHECK(fp16.output_dtype == torch::kHalf);
  CHECK(fp16.master_dtype == torch::kFloat32);
  INFO("fp16 steps skipped: " << fp16.skipped << ", final scale " << fp16.scale);
  REQUIRE(fp16.skipped < 5);
  CHECK(fp16.scale == 65536.0 / (1 << fp16.skipped));
  const Run cpu_fewer = train_mlp(accel::test::make_config(), 10 - fp16.skipped);
  require_close(cpu_fewer.params, fp16.params, 2e-2, 2e-2);
}

TEST_CASE("gpu: fp16 on CUDA skips the step on inf/NaN gradients, backs off and grows the scale") {
  Regression data(8);
  torch::manual_seed(0);
  Mlp model;
  torch::optim::SGD opt(model->parameters(), 0.1);
  Accelerator acc(AcceleratorOptions().config(gpu_config(MixedPrecision::Fp16)));
  acc.prepare(model, opt);
  REQUIRE(acc.scaler() != nullptr);
  REQUIRE(acc.scaler()->get_scale() == 65536.0);
  const auto x = data.x.to(kGpu), y = data.y.to(kGpu);

  bool poison = false;
  float poison_value = std::numeric_limits<float>::infinity();
  model->fc1->weight.register_hook(
      [&](torch::Tensor g) { return poison ? torch::full_like(g, poison_value) : g; });
  for (float bad : {std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()}) {
    poison = true;
    poison_value = bad;
    const auto before = cpu_snapshot(*model);
    const double scale_before = acc.scaler()->get_scale();
    opt.zero_grad();
    acc.backward(torch::mse_loss(model(x).to(torch::kFloat32), y));
    REQUIRE(acc.optimizer_step_was_skipped());
    opt.step();
    const auto after = cpu_snapshot(*model);
    for (std::size_t k = 0; k < after.size(); ++k)
      REQUIRE(torch::equal(before[k], after[k]));
    REQUIRE(acc.scaler()->get_scale() == scale_before * 0.5);
  }
  poison = false;
  const auto before = cpu_snapshot(*model);
  opt.zero_grad();
  acc.backward(torch::mse_loss(model(x).to(torch::kFloat32), y));
  REQUIRE_FALSE(acc.optimizer_step_was_skipped());
  opt.step();
  REQUIRE_FALSE(torch::equal(before[0], cpu_snapshot(*model)[0]));

  // The scaler alone on CUDA tensors: growth after growth_interval clean steps, unscale finds inf.
  accel::GradScaler scaler(accel::GradScalerOptions().init_scale(8.0).growth_interval(2), kGpu);
  auto w = torch::ones({4}, torch::TensorOptions().device(kGpu).requires_grad(true));
  scaler.scale((w * 2).sum()).backward();
  REQUIRE(torch::allclose(w.grad().cpu(), torch::full({4}, 16.0)));
  REQUIRE_FALSE(scaler.unscale_({w}));
  REQUIRE(torch::allclose(w.grad().cpu(), torch::full({4}, 2.0)));
  scaler.update(false);
  CHECK(scaler.get_scale() == 8.0);
  scaler.update(false);
  CHECK(scaler.get_scale() == 16.0);
  w.mutable_grad().fill_(std::numeric_limits<float>::infinity());
  REQUIRE(scaler.unscale_({w}));
  scaler.update(true);
  CHECK(scaler.get_scale() == 8.0);
  CHECK(scaler.growth_tracker() == 0);
}

namespace {

template <typename Fused, typename Lib, typename Options>
void compare_optimizers_on_gpu(const Options& options) {
  Regression data(32);
  const auto x = data.x.to(kGpu), y = data.y.to(kGpu);
  torch::manual_seed(0);
  Mlp a;
  torch::manual_seed(0);
  Mlp b;
  a->to(kGpu);
  b->to(kGpu);
  const auto initial = cpu_snapshot(*a);
  Fused fused(a->parameters(), options);
  Lib lib(b->parameters(), options);
  for (int s = 0; s < 8; ++s) {
    fused.zero_grad();
    torch::mse_loss(a(x), y).backward();
    fused.step();
    lib.zero_grad();
    torch::mse_loss(b(x), y).backward();
    lib.step();
  }
  const auto pa = cpu_snapshot(*a), pb = cpu_snapshot(*b);
  require_close(pa, pb, 1e-5, 1e-5);
  for (std::size_t k = 0; k < pa.size(); ++k)
    REQUIRE_FALSE(torch::equal(pa[k], initial[k]));  // it trained
}

}  // namespace

TEST_CASE("gpu: accel::optim's fused CUDA kernels give torch::optim's numbers") {
  compare_optimizers_on_gpu<accel::optim::AdamW, torch::optim::AdamW>(
      torch::optim::AdamWOptions(1e-2).weight_decay(0.05));
  compare_optimizers_on_gpu<accel::optim::AdamW, torch::optim::AdamW>(
      torch::optim::AdamWOptions(1e-2).weight_decay(0.05).amsgrad(true));
  compare_optimizers_on_gpu<accel::optim::Adam, torch::optim::Adam>(
      torch::optim::AdamOptions(1e-2).weight_decay(1e-3));
  compare_optimizers_on_gpu<accel::optim::SGD, torch::optim::SGD>(
      torch::optim::SGDOptions(0.05).momentum(0.9).nesterov(true));
}

TEST_CASE("gpu: activation checkpointing replays the CUDA RNG state (dropout) and CUDA autocast bitwise") {
  namespace nn = torch::nn;
  for (const bool bf16 : {false, true}) {
    INFO("autocast bf16: " << bf16);
    torch::manual_seed(3);
    nn::Sequential model(nn::Linear(32, 64), nn::GELU(), nn::Dropout(0.5), nn::Linear(64, 8));
    model->to(kGpu);
    const auto input = torch::randn({16, 32}, kGpu);
    auto grads = [&](bool checkpointed) {
      torch::manual_seed(11);  // CPU and CUDA generators
      model->zero_grad();
      auto x = input.clone().requires_grad_(true);
      at::autocast::set_autocast_enabled(kGpu.type(), bf16);
      at::autocast::set_autocast_dtype(kGpu.type(), torch::kBFloat16);
      auto out = checkpointed
                     ? accel::checkpoint([&](const torch::Tensor& t) { return model->forward(t); }, x)
                     : model->forward(x);
      at::autocast::set_autocast_enabled(kGpu.type(), false);
      at::autocast::clear_cache();
      CHECK(out.scalar_type() == (bf16 ? torch::kBFloat16 : torch::kFloat32));
      out.to(torch::kFloat32).pow(2).sum().backward();
      std::vector<torch::Tensor> g{x.grad().cpu()};
      for (const auto& p : model->parameters())
        g.push_back(p.grad().cpu());
      g.push_back(torch::rand({4}, kGpu).cpu());  // the generator ends where the plain run's ends
      return g;
    };
    const auto plain = grads(false), ckpt = grads(true);
    for (std::size_t k = 0; k < plain.size(); ++k) {
      INFO("tensor " << k);
      REQUIRE(torch::equal(plain[k], ckpt[k]));
    }
  }
}

TEST_CASE("gpu: a pinned-memory prepared loader hands out CUDA batches in order, with the dataset's values") {
  Regression data(40);
  Accelerator acc(AcceleratorOptions().config(gpu_config()));
  REQUIRE(acc.device() == kGpu);
  for (const bool pin : {false, true}) {
    for (const std::size_t workers : {std::size_t{0}, std::size_t{2}}) {
      INFO("pin_memory " << pin << ", workers " << workers);
      auto loader = acc.prepare_data_loader(Regression(40).map(torch::data::transforms::Stack<>()),
                                            accel::DataLoaderOptions(8).pin_memory(pin).workers(workers));
      std::int64_t row = 0;
      for (auto& batch : *loader) {
        REQUIRE(batch.data.device() == kGpu);
        REQUIRE(batch.target.device() == kGpu);
        REQUIRE(torch::equal(batch.data.cpu(), data.x.slice(0, row, row + batch.data.size(0))));
        REQUIRE(torch::equal(batch.target.cpu(), data.y.slice(0, row, row + batch.target.size(0))));
        row += batch.data.size(0);
      }
      REQUIRE(row == 40);
    }
  }
}

TEST_CASE("gpu: NCCL at world size 1 through the Communicator") {
  accel::ProcessState state;
  state.master_port = accel::test::free_port();
  auto comm = accel::open_communicator(state, kGpu);
  accel::test::check_one_process_collectives(*comm, kGpu);
  // A CPU tensor on the same communicator goes through Gloo.
  auto c = torch::ones({3});
  comm->all_reduce(c, accel::ReduceOp::Sum);
  REQUIRE(torch::equal(c, torch::ones({3})));
}

namespace {

// Trains `steps` AdamW steps of the MLP through an Accelerator on `config`'s device, starting from
// `resume_from` when given, saving to `save_to` when given; returns the parameters.
std::vector<torch::Tensor> adam_run(const Config& config, int first, int steps,
                                    const std::string& resume_from, const std::string& save_to) {
  Regression data(32);
  torch::manual_seed(0);
  Mlp model;
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-2));
  Accelerator acc(AcceleratorOptions().config(config));
  acc.prepare(model, opt);
  if (!resume_from.empty()) acc.load_state(resume_from);
  for (int s = first; s < first + steps; ++s) {
    auto x = data.x.slice(0, s % 4 * 8, s % 4 * 8 + 8).to(acc.device());
    auto y = data.y.slice(0, s % 4 * 8, s % 4 * 8 + 8).to(acc.device());
    opt.zero_grad();
    acc.backward(torch::mse_loss(model(x), y));
    opt.step();
  }
  if (!save_to.empty()) acc.save_state(save_to);
  return cpu_snapshot(*model);
}

}  // namespace

TEST_CASE("gpu: save_state on the GPU resumes on the CPU and the other way round") {
  accel::test::TempDir dir;
  const auto cpu = accel::test::make_config(), gpu = gpu_config();
  const auto straight = adam_run(cpu, 0, 8, "", "");
  // GPU for 4 steps, then the CPU for 4 more; and CPU, then GPU.
  const auto gpu_saved = (dir.path / "gpu").string(), cpu_saved = (dir.path / "cpu").string();
  adam_run(gpu, 0, 4, "", gpu_saved);
  const auto gpu_then_cpu = adam_run(cpu, 4, 4, gpu_saved, "");
  adam_run(cpu, 0, 4, "", cpu_saved);
  const auto cpu_then_gpu = adam_run(gpu, 4, 4, cpu_saved, "");
  require_close(straight, gpu_then_cpu, 1e-4, 1e-5);
  require_close(straight, cpu_then_gpu, 1e-4, 1e-5);
}

TEST_CASE("gpu: ZeRO-Offload on one GPU keeps the optimizer state on the CPU and trains like the GPU run") {
  auto run = [](Config config, torch::Device* state_device) {
    Regression data(32);
    const auto x = data.x.to(kGpu), y = data.y.to(kGpu);
    torch::manual_seed(0);
    Mlp model;
    accel::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.01));
    Accelerator acc(AcceleratorOptions().config(config));
    acc.prepare(model, opt);
    for (int s = 0; s < 6; ++s) {
      opt.zero_grad();
      acc.backward(torch::mse_loss(model(x), y));
      opt.step();
    }
    REQUIRE(model->fc1->weight.device() == kGpu);  // the model stays on the GPU
    REQUIRE_FALSE(opt.state().empty());
    for (const auto& [key, state] : opt.state()) {
      auto& adam = static_cast<torch::optim::AdamWParamState&>(*state);
      *state_device = adam.exp_avg().device();
    }
    return cpu_snapshot(*model);
  };
  torch::Device gpu_only_state = torch::kCPU, offload_state = kGpu;
  const auto gpu_only = run(gpu_config(), &gpu_only_state);
  Config offload = gpu_config();
  offload.backend = "zero";
  offload.zero.stage = 2;
  offload.zero.offload_optimizer_device = accel::OffloadDevice::Cpu;
  const auto offloaded = run(offload, &offload_state);
  CHECK(gpu_only_state == kGpu);
  CHECK(offload_state == torch::Device(torch::kCPU));
  require_close(gpu_only, offloaded, 1e-5, 1e-6);
}

TEST_CASE(
    "gpu: prepare moves a gradient left on the CPU to the GPU with its parameter, as PyTorch's to() does") {
  // A loop ran on the CPU before prepare and left its gradients; LibTorch's Module::to moves the parameters
  // but not them, and the first backward on the GPU that accumulates into one failed with "Expected all
  // tensors to be on the same device" (the finetune example under accel::Trainer, on the H200).
  torch::manual_seed(0);
  Mlp model;
  Regression data(8);
  torch::mse_loss(model(data.x), data.y).backward();
  std::vector<torch::Tensor> stale;
  for (const auto& p : model->parameters())
    stale.push_back(p.grad().clone());
  torch::optim::SGD opt(model->parameters(), 0.1);
  Accelerator acc(AcceleratorOptions().config(gpu_config()));
  acc.prepare(model, opt);
  const auto params = model->parameters();
  for (std::size_t k = 0; k < params.size(); ++k) {
    REQUIRE(params[k].grad().device() == acc.device());
    CHECK(torch::equal(params[k].grad().cpu(), stale[k]));
  }
  // A backward without zero_grad accumulates into the moved gradient, as in PyTorch.
  acc.backward(torch::mse_loss(model(data.x.to(acc.device())), data.y.to(acc.device())));
  for (std::size_t k = 0; k < params.size(); ++k)
    CHECK(torch::allclose(params[k].grad().cpu(), 2 * stale[k], 1e-4, 1e-6));
}
