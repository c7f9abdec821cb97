// The layers above the facade on one GPU (issue 27): the Trainer and LoRA adapters on cuda:0.
//
// Tolerances, and why:
//  - Trainer, fp32 on the GPU vs the CPU: max difference 1.1e-4 after 10 AdamW steps (cuBLAS sums in another
//    order; TF32 stays off for matmul in LibTorch).
//  - Trainer, bf16 autocast on the GPU vs fp32 on the CPU: atol 5e-2. AdamW divides each gradient by its own
//    running scale, so a bf16-rounded gradient moves a weight by up to lr (2e-2) per step in the other
//    direction where the gradient is near zero; the --on-cpu dry run (CPU bf16 autocast) measured 1.5e-2.
//  - Trainer, resumed from a checkpoint written on the GPU: bitwise (the CUDA generator's state is in the
//    checkpoint; dropout draws the same masks; the kernels are deterministic for this model).
//  - LoRA on the GPU vs the CPU: 1e-5 (fp32), and under CUDA bf16 autocast 3e-2 relative to the output's
//    scale, while leaving the adapters out moves the output by more than 10x that.
#include <catch2/catch.hpp>

#include "gpu_device.hpp"
#include "test_support.hpp"
#include "trainer/trainer_fixture.hpp"

#include <accel/nn/lora.hpp>
#include <accel/nn/quant4bit.hpp>
#include <accel/optim/optim.hpp>
#include <accel/trainer/trainer.hpp>

#include <torch/torch.h>

#include <cmath>
#include <filesystem>
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

using Data = decltype(Regression(1).map(torch::data::transforms::Stack<>()));

struct TrainerRun {
  std::vector<torch::Tensor> weights;
  torch::Device device = torch::kCPU;
  std::int64_t steps = 0;
  double loss = 0;
};

TrainerRun run_trainer(accel::TrainingArguments a, const Config& config, double dropout,
                       const std::string& resume = "", std::uint64_t init_seed = 3) {
  torch::manual_seed(init_seed);
  Mlp model(6, dropout);
  accel::Trainer<Data> trainer(
      std::move(a), model, Regression(40).map(torch::data::transforms::Stack<>()),
      [&](torch::data::Example<>& b) { return torch::mse_loss(model(b.data).to(torch::kFloat32), b.target); },
      AcceleratorOptions().config(config));
  const auto output = trainer.train(resume);
  TrainerRun r;
  r.device = model->fc1->weight.device();
  r.steps = trainer.state().global_step;
  r.loss = output.training_loss;
  r.weights = on_cpu(trainer.accelerator().get_state_dict(model));
  return r;
}

}  // namespace

TEST_CASE(
    "gpu: the Trainer trains on cuda:0 like on the CPU (fp32, bf16) and resumes a GPU checkpoint "
    "bit for bit") {
  accel::test::TempDir dir;
  const auto out = (dir.path / "run").string();
  const TrainerRun cpu = run_trainer(accel::test::small_trainer_args(out), accel::test::make_config(), 0.0);
  REQUIRE(cpu.device == torch::Device(torch::kCPU));
  REQUIRE(cpu.steps == 10);

  const TrainerRun fp32 = run_trainer(accel::test::small_trainer_args(out), gpu_config(), 0.0);
  CHECK(fp32.device == gpu_device());
  CHECK(fp32.steps == cpu.steps);
  INFO("fp32: max difference to the CPU run " << max_difference(cpu.weights, fp32.weights));
  CHECK(max_difference(cpu.weights, fp32.weights) <= 1e-5 + 1e-4);

  auto bf16_args = accel::test::small_trainer_args(out);
  bf16_args.bf16 = true;
  const TrainerRun bf16 = run_trainer(bf16_args, gpu_config(), 0.0);
  INFO("bf16: max difference to the CPU fp32 run " << max_difference(cpu.weights, bf16.weights));
  CHECK(max_difference(cpu.weights, bf16.weights) <= 5e-2);
  CHECK(std::isfinite(bf16.loss));
  CHECK(std::abs(bf16.loss - cpu.loss) <= 0.05 * cpu.loss);

  // Dropout on the GPU draws from the CUDA generator: a run cut at step 4 and resumed by a fresh Trainer
  // (another initialisation) ends where the uninterrupted run ends.
  auto saving = accel::test::small_trainer_args(out);
  saving.save_strategy = "steps";
  saving.save_steps = 2;
  const TrainerRun straight = run_trainer(saving, gpu_config(), 0.3);
  REQUIRE(std::filesystem::exists(std::filesystem::path(out) / "checkpoint-4" / "trainer_state.json"));
  const TrainerRun resumed =
      run_trainer(saving, gpu_config(), 0.3, (std::filesystem::path(out) / "checkpoint-4").string(),
                  /*init_seed=*/99);
  CHECK(resumed.steps == straight.steps);
  INFO("resumed at step 4: max difference to the uninterrupted run "
       << max_difference(straight.weights, resumed.weights));
  CHECK(max_difference(straight.weights, resumed.weights) == 0.0);
  // The uninterrupted run repeated gives the same weights: the GPU kernels are deterministic here, so the
  // bitwise check above tests the checkpoint, not luck.
  const TrainerRun fresh = run_trainer(saving, gpu_config(), 0.3, "", /*init_seed=*/3);
  CHECK(max_difference(straight.weights, fresh.weights) == 0.0);  // determinism of the straight run itself
}

namespace {

struct BlockImpl : torch::nn::Module {
  BlockImpl()
      : q_proj(register_module("q_proj", torch::nn::Linear(16, 32))),
        v_proj(register_module("v_proj", torch::nn::Linear(16, 32))),
        out(register_module("out", torch::nn::Linear(32, 4))) {}
  torch::Tensor forward(torch::Tensor x) { return out(torch::relu(q_proj(x)) + v_proj(x)); }
  torch::nn::Linear q_proj, v_proj, out;
};
TORCH_MODULE(Block);

// The block with seeded weights and LoRA adapters on q_proj and v_proj, B drawn so that the term shows.
std::pair<Block, std::shared_ptr<accel::peft::LoraModel>> adapted_block() {
  torch::manual_seed(5);
  Block model;
  accel::peft::LoraConfig config;
  config.r = 4;
  config.lora_alpha = 8;
  config.target_modules = {"q_proj", "v_proj"};
  auto lora = accel::peft::get_peft_model(model, config);
  torch::NoGradGuard no_grad;
  for (auto& p : model->named_parameters())
    if (p.key().find("lora_B") != std::string::npos) p.value().normal_();
  return {model, lora};
}

}  // namespace

TEST_CASE(
    "gpu: LoRA adapters on cuda:0 compute PEFT's term in fp32 and under bf16 autocast, train only the "
    "adapters, and their file loads on the CPU") {
  const auto x = torch::randn({8, 16}, torch::TensorOptions().dtype(torch::kFloat32));
  auto [reference, ref_lora] = adapted_block();
  const auto want = reference(x).detach();
  const auto base_only = [&] {  // the same base weights without adapters
    torch::manual_seed(5);
    Block plain;
    return plain(x).detach();
  }();
  const double scale = want.abs().max().item<double>();
  REQUIRE((want - base_only).abs().max().item<double>() > 0.3 * scale);  // the adapters matter

  // fp32 on the GPU, through prepare (which moves the adapted model, adapters included, to cuda:0).
  auto [model, lora] = adapted_block();
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-2));
  {
    Accelerator acc(AcceleratorOptions().config(gpu_config()));
    acc.prepare(model, opt);
    REQUIRE(model->q_proj->named_children()["lora_A"]->parameters()[0].device() == gpu_device());
    const auto got = model(x.to(acc.device())).cpu();
    INFO("fp32: max difference " << (got - want).abs().max().item<double>());
    CHECK(torch::allclose(got, want, 1e-5, 1e-5));

    // Training on the GPU changes the adapters only, exactly as the same steps on the CPU.
    const auto frozen = model->q_proj->weight.detach().cpu().clone();
    auto [cpu_model, cpu_lora] = adapted_block();
    torch::optim::AdamW cpu_opt(cpu_model->parameters(), torch::optim::AdamWOptions(1e-2));
    const auto y = torch::randn({8, 4});
    for (int s = 0; s < 5; ++s) {
      opt.zero_grad();
      acc.backward(torch::mse_loss(model(x.to(acc.device())), y.to(acc.device())));
      opt.step();
      cpu_opt.zero_grad();
      torch::mse_loss(cpu_model(x), y).backward();
      cpu_opt.step();
    }
    CHECK(torch::equal(model->q_proj->weight.detach().cpu(), frozen));
    const auto trained = model(x.to(acc.device())).detach().cpu();
    INFO("after 5 steps: max difference to the CPU " << (trained - cpu_model(x)).abs().max().item<double>());
    CHECK(torch::allclose(trained, cpu_model(x).detach(), 1e-4, 1e-5));

    // The adapter file written from the GPU model loads into a CPU model and gives the same outputs.
    accel::test::TempDir dir;
    lora->save_adapter(dir.path.string());
    auto [loaded, loaded_lora] = adapted_block();
    loaded_lora->load_adapter(dir.path.string());
    CHECK(torch::allclose(loaded(x), trained, 1e-5, 1e-5));
  }

  // bf16 autocast on the GPU: the adapters' term is added to the bf16 output.
  auto [half, half_lora] = adapted_block();
  torch::optim::SGD sgd(half->parameters(), 0.0);
  Accelerator acc(AcceleratorOptions().config(gpu_config(MixedPrecision::Bf16)));
  acc.prepare(half, sgd);
  const auto got = half(x.to(acc.device()));
  CHECK(got.scalar_type() == torch::kBFloat16);
  const double err = (got.to(torch::kFloat32).cpu() - want).abs().max().item<double>();
  INFO("bf16: max difference " << err << " (output scale " << scale << ")");
  CHECK(err <= 3e-2 * scale);
}

TEST_CASE("gpu: the Trainer in fp16 on cuda:0 scales the loss (PyTorch's scaler; DeepSpeed's under zero)") {
  accel::test::TempDir dir;
  const auto out = (dir.path / "run").string();
  const TrainerRun cpu = run_trainer(accel::test::small_trainer_args(out), accel::test::make_config(), 0.0);
  auto args = accel::test::small_trainer_args(out);
  args.fp16 = true;
  for (const char* backend : {"local", "zero"}) {
    INFO(backend);
    Config c = gpu_config();
    c.backend = backend;
    c.zero.stage = 2;
    c.zero.fp16_initial_scale_power = 10;
    torch::manual_seed(3);
    Mlp model(6, 0.0);
    torch::ScalarType output_dtype = torch::kFloat32;
    accel::Trainer<Data> trainer(
        args, model, Regression(40).map(torch::data::transforms::Stack<>()),
        [&](torch::data::Example<>& b) {
          auto y = model(b.data);
          output_dtype = y.scalar_type();
          return torch::mse_loss(y.to(torch::kFloat32), b.target);
        },
        AcceleratorOptions().config(c));
    const auto output = trainer.train();
    CHECK(output_dtype == torch::kHalf);  // the forward ran under CUDA fp16 autocast
    REQUIRE(trainer.accelerator().scaler() != nullptr);
    const auto& scaler = *trainer.accelerator().scaler();
    CHECK(scaler.options().deepspeed_schedule() == (std::string(backend) == "zero"));
    // PyTorch's scaler starts at 65536, DeepSpeed's here at 2^10; neither grows within 10 steps.
    CHECK(scaler.get_scale() <= (std::string(backend) == "zero" ? 1024.0 : 65536.0));
    CHECK(trainer.state().global_step == cpu.steps);
    CHECK(std::isfinite(output.training_loss));
    // The loss over the run is the fp32 CPU run's within 10%: fp16 rounding plus a skipped overflow step or
    // two at the first scales (AdamW moves each weight by at most about lr = 2e-2 per step).
    INFO("training loss " << output.training_loss << " vs the CPU's " << cpu.loss);
    CHECK(std::abs(output.training_loss - cpu.loss) <= 0.1 * cpu.loss);
  }
}

TEST_CASE(
    "gpu: LoRA adapters train with the fused accel::optim::AdamW on cuda:0 as with LibTorch's on the CPU") {
  const auto x = torch::randn({8, 16});
  const auto y = torch::randn({8, 4});
  auto [model, lora] = adapted_block();
  const auto frozen = model->v_proj->weight.detach().clone();
  accel::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.01));
  Accelerator acc(AcceleratorOptions().config(gpu_config()));
  acc.prepare(model, opt);
  auto [cpu_model, cpu_lora] = adapted_block();
  torch::optim::AdamW cpu_opt(cpu_model->parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.01));
  for (int s = 0; s < 5; ++s) {
    opt.zero_grad();
    acc.backward(torch::mse_loss(model(x.to(acc.device())), y.to(acc.device())));
    opt.step();
    cpu_opt.zero_grad();
    torch::mse_loss(cpu_model(x), y).backward();
    cpu_opt.step();
  }
  CHECK(torch::equal(model->v_proj->weight.detach().cpu(), frozen));  // frozen base: no grad, no decay
  const auto trained = model(x.to(acc.device())).detach().cpu();
  const auto want = cpu_model(x).detach();
  INFO("max difference to the CPU " << (trained - want).abs().max().item<double>());
  CHECK(torch::allclose(trained, want, 1e-4, 1e-5));
  auto [untrained, untrained_lora] = adapted_block();
  CHECK_FALSE(torch::allclose(untrained(x), want, 1e-3, 1e-3));  // the steps moved the adapters
}

namespace {

// Block's layers called through the registry (what quantize_linears can swap; Block's member handles cannot).
struct QBlockImpl : torch::nn::Module {
  QBlockImpl() {
    register_module("q_proj", torch::nn::Linear(16, 32));
    register_module("v_proj", torch::nn::Linear(16, 32));
    register_module("out", torch::nn::Linear(32, 4));
  }
  torch::Tensor layer(const std::string& name, const torch::Tensor& x) {
    auto m = named_children()[name];
    if (auto q = m->as<accel::quant::Linear4bit>()) return q->forward(x);
    return m->as<torch::nn::Linear>()->forward(x);
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return layer("out", torch::relu(layer("q_proj", x)) + layer("v_proj", x));
  }
};
TORCH_MODULE(QBlock);

}  // namespace

TEST_CASE("gpu: QLoRA on cuda:0: a 4-bit base dequantised on the GPU, adapters trained like on the CPU") {
  // The same quantised block and adapters on the CPU and, through prepare, on cuda:0: the 4-bit buffers
  // move with the module and are dequantised there; five AdamW steps give the CPU's outputs.
  auto build = [] {
    torch::manual_seed(5);
    QBlock model;
    accel::quant::quantize_linears(*model, {}, {"^out$"});
    accel::peft::LoraConfig config;
    config.r = 4;
    config.lora_alpha = 8;
    config.target_modules = {"q_proj", "v_proj"};
    auto lora = accel::peft::get_peft_model(model.ptr(), config);
    return std::make_pair(model, lora);
  };
  const auto x = torch::randn({8, 16});
  const auto y = torch::randn({8, 4});
  auto [cpu_model, cpu_lora] = build();
  auto [gpu_model, gpu_lora] = build();
  torch::optim::AdamW cpu_opt(cpu_model->parameters(), torch::optim::AdamWOptions(1e-2));
  torch::optim::AdamW gpu_opt(gpu_model->parameters(), torch::optim::AdamWOptions(1e-2));
  Accelerator acc(AcceleratorOptions().config(gpu_config()));
  acc.prepare(gpu_model, gpu_opt);
  REQUIRE(gpu_model->named_buffers()["q_proj.weight_packed"].device() == gpu_device());
  for (int s = 0; s < 5; ++s) {
    cpu_opt.zero_grad();
    torch::mse_loss(cpu_model(x), y).backward();
    cpu_opt.step();
    gpu_opt.zero_grad();
    acc.backward(torch::mse_loss(gpu_model(x.to(acc.device())), y.to(acc.device())));
    gpu_opt.step();
  }
  const auto want = cpu_model(x).detach();
  const auto got = gpu_model(x.to(acc.device())).detach().cpu();
  INFO("max difference to the CPU " << (got - want).abs().max().item<double>());
  CHECK(torch::allclose(got, want, 1e-4, 1e-5));
  // bf16 autocast on the GPU: the 4-bit weight is dequantised straight to bf16.
  Accelerator half(AcceleratorOptions().config(gpu_config(MixedPrecision::Bf16)));
  auto [bf_model, bf_lora] = build();
  torch::optim::SGD sgd(bf_model->parameters(), 0.0);
  half.prepare(bf_model, sgd);
  const auto out = bf_model(x.to(half.device()));
  CHECK(out.scalar_type() == torch::kBFloat16);
  const double scale = want.abs().max().item<double>();
  const auto fresh = build().first(x).detach();
  CHECK((out.to(torch::kFloat32).cpu() - fresh).abs().max().item<double>() <= 3e-2 * std::max(scale, 1.0));
}
