// What one GPU can run of the sharded backends (issue 27), never run on CUDA before: ZeRO stages 1-3 and FSDP
// at world size 1 on cuda:0 (an NCCL group of one) against the local backend on the same GPU; DeepSpeed's
// loss-scale schedule on CUDA tensors under ZeRO fp16; ZeRO-3 parameter offload and FSDP's
// fsdp_offload_params from a GPU run; save_model of a GPU model, verified by its manifest and read back on
// the CPU.
//
// Tolerances, and why:
//  - a sharded backend vs the local backend, both on the GPU, fused AdamW, fp32: 1e-5 (the same elementwise
//    AdamW over flat master slices instead of one tensor per parameter; the reductions of one rank add
//    nothing).
//  - offloaded (CPU fused AdamW on the master) vs the GPU-only run: 1e-5, as ZeRO-Offload in gpu_test.cpp.
//  - ZeRO fp16 with overflowing steps vs the same backend's fp16 run of the clean steps alone: 1e-6 (a
//    skipped step must leave nothing behind; the loss scales differ by powers of two).
#include <catch2/catch.hpp>

#include "gpu_device.hpp"
#include "test_support.hpp"

#include <accel/optim/optim.hpp>

#include <torch/torch.h>

#include <filesystem>
#include <functional>
#include <limits>
#include <set>
#include <string>
#include <vector>

using accel::Accelerator;
using accel::AcceleratorOptions;
using accel::Config;
using accel::MixedPrecision;
using accel::test::gpu_config;
using accel::test::gpu_device;
using accel::test::max_difference;
using accel::test::Mlp;
using accel::test::on_cpu;
using accel::test::Regression;

namespace {

std::vector<torch::Tensor> weights_on_cpu(Accelerator& acc, Mlp& model) {
  return accel::test::on_cpu(acc.get_state_dict(model));
}

struct Row {
  const char* name;
  std::function<void(Config&)> set;
};

const std::vector<Row>& sharded_rows() {
  static const std::vector<Row> rows = {
      {"zero stage 1", [](Config& c) { c.backend = "zero", c.zero.stage = 1; }},
      {"zero stage 2", [](Config& c) { c.backend = "zero", c.zero.stage = 2; }},
      {"zero stage 3", [](Config& c) { c.backend = "zero", c.zero.stage = 3; }},
      {"fsdp FULL_SHARD", [](Config& c) { c.backend = "fsdp"; }},
      {"fsdp SHARD_GRAD_OP",
       [](Config& c) {
         c.backend = "fsdp", c.fsdp.sharding_strategy = accel::ShardingStrategy::ShardGradOp;
       }},
  };
  return rows;
}

struct Trained {
  std::vector<torch::Tensor> weights;
  torch::Device output_device = torch::kCPU;
  torch::ScalarType output_dtype = torch::kFloat32;
};

// `steps` fused-AdamW steps of the MLP on the full batch through an Accelerator with `config`.
Trained adam_steps(const Config& config, int steps = 6) {
  Regression data(32);
  torch::manual_seed(0);
  Mlp model;
  accel::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.01));
  Accelerator acc(AcceleratorOptions().config(config));
  acc.prepare(model, opt);
  const auto x = data.x.to(acc.device()), y = data.y.to(acc.device());
  Trained t;
  for (int s = 0; s < steps; ++s) {
    opt.zero_grad();
    auto out = model(x);
    t.output_device = out.device();
    t.output_dtype = out.scalar_type();
    acc.backward(torch::mse_loss(out.to(torch::kFloat32), y));
    opt.step();
  }
  t.weights = weights_on_cpu(acc, model);
  return t;
}

}  // namespace

TEST_CASE("gpu: ZeRO 1-3 and FSDP at world size 1 on cuda:0 train like the local backend on the GPU") {
  const Trained local = adam_steps(gpu_config());
  REQUIRE(local.output_device == gpu_device());
  for (const auto& row : sharded_rows()) {
    INFO(row.name);
    Config c = gpu_config();
    row.set(c);
    const Trained sharded = adam_steps(c);
    CHECK(sharded.output_device == gpu_device());
    INFO("max difference to the local backend " << max_difference(local.weights, sharded.weights));
    CHECK(max_difference(local.weights, sharded.weights) <= 1e-5);
  }
  // bf16 under a sharded backend: CUDA autocast runs the forward in bf16, the weights stay near fp32's.
  for (const char* backend : {"zero", "fsdp"}) {
    INFO(backend << " bf16");
    Config c = gpu_config(MixedPrecision::Bf16);
    c.backend = backend;
    const Trained bf16 = adam_steps(c);
    CHECK(bf16.output_dtype == torch::kBFloat16);
    INFO("max difference to fp32 " << max_difference(local.weights, bf16.weights));
    CHECK(max_difference(local.weights, bf16.weights) <= 5e-2);
  }
}

TEST_CASE(
    "gpu: ZeRO and FSDP offload to the CPU (and ZeRO the optimizer state to NVMe) from a GPU run and train "
    "like the GPU-only run") {
  const Trained gpu_only = adam_steps(gpu_config());
  const std::vector<Row> offloads = {
      {"zero stage 3, offload_param_device and offload_optimizer_device cpu",
       [](Config& c) {
         c.backend = "zero", c.zero.stage = 3;
         c.zero.offload_param_device = accel::OffloadDevice::Cpu;
         c.zero.offload_optimizer_device = accel::OffloadDevice::Cpu;
       }},
      {"zero stage 3, offload_optimizer_device cpu",
       [](Config& c) {
         c.backend = "zero", c.zero.stage = 3;
         c.zero.offload_optimizer_device = accel::OffloadDevice::Cpu;
       }},
      {"zero stage 1, offload_optimizer_device cpu",
       [](Config& c) {
         c.backend = "zero", c.zero.stage = 1;
         c.zero.offload_optimizer_device = accel::OffloadDevice::Cpu;
       }},
      {"zero stage 3, offload_optimizer_device nvme (the state in files between steps)",
       [](Config& c) {
         c.backend = "zero", c.zero.stage = 3;
         c.zero.offload_optimizer_device = accel::OffloadDevice::Nvme;
         c.zero.offload_optimizer_nvme_path = std::filesystem::temp_directory_path().string();
       }},
      {"zero stage 2, offload_optimizer_device nvme, small sub-groups",
       [](Config& c) {
         c.backend = "zero", c.zero.stage = 2;
         c.zero.sub_group_size = 100;
         c.zero.offload_optimizer_device = accel::OffloadDevice::Nvme;
         c.zero.offload_optimizer_nvme_path = std::filesystem::temp_directory_path().string();
         c.zero.offload_optimizer_buffer_count = 2;
       }},
      {"fsdp FULL_SHARD, fsdp_offload_params",
       [](Config& c) { c.backend = "fsdp", c.fsdp.offload_params = true; }},
      {"fsdp SHARD_GRAD_OP, fsdp_offload_params",
       [](Config& c) {
         c.backend = "fsdp", c.fsdp.offload_params = true;
         c.fsdp.sharding_strategy = accel::ShardingStrategy::ShardGradOp;
       }},
  };
  for (const auto& row : offloads) {
    INFO(row.name);
    Config c = gpu_config();
    row.set(c);
    const Trained offloaded = adam_steps(c);
    CHECK(offloaded.output_device == gpu_device());  // the forward still runs on the GPU
    INFO("max difference to the GPU-only run " << max_difference(gpu_only.weights, offloaded.weights));
    CHECK(max_difference(gpu_only.weights, offloaded.weights) <= 1e-5);
  }
}

namespace {

struct Fp16Run {
  std::vector<torch::Tensor> weights;
  std::vector<double> scales;
};

// `steps` SGD steps of the MLP on the full batch under ZeRO `stage` in fp16 with DeepSpeed's scaler starting
// at 2^8; the steps in `poisoned` overflow (the loss times infinity). Checks that each overflowing step is
// skipped and leaves the weights as they were, and that each clean step moves them.
Fp16Run zero_fp16(int stage, const std::set<int>& poisoned, int steps) {
  Config c = gpu_config(MixedPrecision::Fp16);
  c.backend = "zero";
  c.zero.stage = stage;
  c.zero.fp16_initial_scale_power = 8;
  Regression data(64);
  torch::manual_seed(0);
  Mlp model;
  torch::optim::SGD opt(model->parameters(), 0.05);
  Accelerator acc(AcceleratorOptions().config(c));
  acc.prepare(model, opt);
  REQUIRE(acc.scaler() != nullptr);
  CHECK(acc.scaler()->options().deepspeed_schedule());
  const auto x = data.x.to(acc.device()), y = data.y.to(acc.device());
  Fp16Run r;
  for (int s = 0; s < steps; ++s) {
    INFO("step " << s);
    const bool overflow = poisoned.count(s) != 0;
    const auto before = weights_on_cpu(acc, model);
    opt.zero_grad();
    auto out = model(x);
    CHECK(out.scalar_type() == torch::kHalf);
    auto loss = torch::mse_loss(out.to(torch::kFloat32), y);
    if (overflow) loss = loss * std::numeric_limits<float>::infinity();
    acc.backward(loss);
    REQUIRE(acc.optimizer_step_was_skipped() == overflow);
    opt.step();
    r.scales.push_back(acc.scaler()->get_scale());
    const double moved = max_difference(before, weights_on_cpu(acc, model));
    if (overflow)
      CHECK(moved == 0.0);
    else
      CHECK(moved > 0.0);
  }
  r.weights = weights_on_cpu(acc, model);
  return r;
}

}  // namespace

TEST_CASE("gpu: fp16 under ZeRO follows DeepSpeed's loss-scale schedule on CUDA tensors") {
  // DeepSpeed's DynamicLossScaler with initial_scale_power 8 and its default hysteresis 2, window 1000:
  // the first overflow is absorbed by the hysteresis (the step is still skipped, the scale stays), each
  // later one halves the scale; clean steps leave it (no growth before 1001 clean steps).
  const std::set<int> poisoned = {1, 2, 4};
  const std::vector<double> want_scales = {256, 256, 128, 128, 64, 64, 64, 64};
  for (int stage : {0, 1, 2, 3}) {
    INFO("zero stage " << stage);
    const Fp16Run run = zero_fp16(stage, poisoned, 8);
    CHECK(run.scales == want_scales);
    // The skipped steps left nothing behind (no master slice, momentum or step count moved): the run equals
    // the same backend's run of the five clean steps alone. The scales differ by powers of two, which fp16
    // gradients represent exactly away from underflow.
    const Fp16Run clean = zero_fp16(stage, {}, 5);
    INFO("max difference to the clean steps alone " << max_difference(run.weights, clean.weights));
    CHECK(max_difference(run.weights, clean.weights) <= 1e-6);
  }
}

TEST_CASE("gpu: save_model of a model trained on cuda:0 writes a verified export that loads on the CPU") {
  for (const char* backend : {"local", "zero"}) {
    INFO(backend);
    Config c = gpu_config();
    c.backend = backend;
    c.zero.stage = 3;
    Regression data(32);
    torch::manual_seed(0);
    Mlp model;
    accel::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-2));
    Accelerator acc(AcceleratorOptions().config(c));
    acc.prepare(model, opt);
    for (int s = 0; s < 3; ++s) {
      opt.zero_grad();
      acc.backward(torch::mse_loss(model(data.x.to(acc.device())), data.y.to(acc.device())));
      opt.step();
    }
    accel::test::TempDir dir;
    const auto where = dir.path / "export";
    const auto exported = acc.save_model(model, where.string());
    REQUIRE_FALSE(exported.files.empty());
    CHECK(std::filesystem::exists(where / "model.safetensors.manifest.json"));
    const auto trained = weights_on_cpu(acc, model);

    torch::manual_seed(1);  // another initialisation, overwritten by the load
    Mlp loaded;
    torch::optim::SGD sgd(loaded->parameters(), 0.0);
    Accelerator cpu(AcceleratorOptions().config(accel::test::make_config()));
    cpu.prepare(loaded, sgd);
    cpu.load_model(loaded, where.string());
    CHECK(max_difference(trained, weights_on_cpu(cpu, loaded)) == 0.0);
  }
}
