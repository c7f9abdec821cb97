// accel::Trainer with LoRA and against transformers' Trainer:
//  - a LoRA run's checkpoints hold the adapter in PEFT's files and the trainable state only (no frozen base),
//    and resuming from one gives the losses of the uninterrupted run;
//  - a checkpoint written during a second train() (or after an fp16-skipped step) resumes, in the same
//    Trainer and in a new one, to the uninterrupted run's losses and weights;
//  - gradient_checkpointing with blocks in a ModuleList (GradientCheckpointingLayer) trains as without;
//  - [.hf_order]: the sample order of each epoch is transformers' Trainer's (tests/python/hf_trainer_order.py
//    writes it, python_crosschecks.sh runs both).
#include <catch2/catch.hpp>

#include <accel/checkpoint/safetensors.hpp>
#include <accel/nn/activation_checkpoint.hpp>
#include <accel/nn/lora.hpp>
#include <accel/optim/deepspeed_adam.hpp>
#include <accel/trainer/trainer.hpp>

#include "checkpoint/manifest.hpp"
#include "temp_dir.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace {

namespace fs = std::filesystem;
using Catch::Matchers::Contains;

// Samples that are their own index (data) with a regression target.
class PeftIndexDataset : public torch::data::datasets::Dataset<PeftIndexDataset> {
 public:
  explicit PeftIndexDataset(std::size_t n, std::int64_t features = 1) : n_(n), features_(features) {}
  torch::data::Example<> get(std::size_t i) override {
    auto x = torch::full({features_}, static_cast<double>(i), torch::kFloat32);
    if (features_ > 1) x = torch::sin(x * torch::arange(1, features_ + 1, torch::kFloat32));
    return {x, torch::full({1}, std::cos(static_cast<double>(i)), torch::kFloat32)};
  }
  torch::optional<std::size_t> size() const override { return n_; }

 private:
  std::size_t n_;
  std::int64_t features_;
};

using accel::test::TempDir;

accel::TrainingArguments peft_quiet_args(const fs::path& out) {
  accel::TrainingArguments a;
  a.output_dir = out.string();
  a.per_device_train_batch_size = 4;
  a.learning_rate = 1e-2;
  a.logging_steps = 1;
  a.save_strategy = "no";
  a.disable_tqdm = true;
  a.seed = 42;
  return a;
}

std::vector<double> peft_step_losses(const accel::TrainerState& s) {
  std::vector<double> out;
  for (const auto& log : s.log_history)
    if (log.count("loss") > 0 && log.count("train_runtime") == 0) out.push_back(log.at("loss"));
  return out;
}

// A frozen base with LoRA on its two Linear layers and the head trained in full.
std::pair<torch::nn::Sequential, std::shared_ptr<accel::peft::LoraModel>> peft_lora_model() {
  torch::manual_seed(0);
  torch::nn::Sequential model(torch::nn::Linear(6, 32), torch::nn::Tanh(), torch::nn::Linear(32, 32),
                              torch::nn::Tanh(), torch::nn::Linear(32, 1));
  accel::peft::LoraConfig c;
  c.r = 4;
  c.lora_alpha = 8;
  c.target_modules = {"0", "2"};
  c.modules_to_save = {"4"};
  auto lora = accel::peft::get_peft_model(model.ptr(), c);
  return {model, lora};
}

// Trains the LoRA model for 6 steps (a checkpoint every 3), from `resume` if given; the per-step losses.
std::vector<double> peft_lora_run(const fs::path& out, const std::string& resume) {
  auto [model, lora] = peft_lora_model();
  auto args = peft_quiet_args(out);
  args.max_steps = 6;
  args.save_strategy = "steps";
  args.save_steps = 3;
  auto data = PeftIndexDataset(40, 6).map(torch::data::transforms::Stack<>());
  accel::Trainer trainer(args, model, std::move(data), [&model = model](auto& batch) {
    return torch::mse_loss(model->forward(batch.data), batch.target);
  });
  trainer.set_peft_model(lora);
  trainer.train(resume);
  return peft_step_losses(trainer.state());
}

}  // namespace

TEST_CASE("Trainer: a LoRA run checkpoints the adapter and the trainable state, and resumes exactly") {
  TempDir whole, resumed;
  const auto uninterrupted = peft_lora_run(whole.path, "");
  REQUIRE(uninterrupted.size() == 6);
  const fs::path ckpt = whole.path / "checkpoint-3";
  // PEFT's files, as Hugging Face's Trainer writes a PeftModel's checkpoint.
  REQUIRE(fs::exists(ckpt / "adapter_model.safetensors"));
  REQUIRE(fs::exists(ckpt / "adapter_config.json"));
  const auto adapter = accel::safetensors::File::open((ckpt / "adapter_model.safetensors").string());
  CHECK(adapter.contains("base_model.model.0.lora_A.weight"));
  CHECK(adapter.contains("base_model.model.2.lora_B.weight"));
  CHECK_FALSE(adapter.contains("base_model.model.0.weight"));
  // The model file holds the trainable parameters only: adapters and the head, never the frozen base.
  const auto model_file = accel::safetensors::File::open((ckpt / "model.safetensors").string());
  CHECK(model_file.names() == std::vector<std::string>{"0.lora_A.weight", "0.lora_B.weight",
                                                       "2.lora_A.weight", "2.lora_B.weight", "4.bias",
                                                       "4.weight"});
  CHECK(model_file.metadata().at("accelerate_cpp.model_part") == "trainable");
  // Resumed from checkpoint-3 onto a freshly built base: steps 4-6 lose what the uninterrupted run lost.
  fs::copy(ckpt, resumed.path / "checkpoint-3", fs::copy_options::recursive);
  const auto after = peft_lora_run(resumed.path, (resumed.path / "checkpoint-3").string());
  REQUIRE(after.size() >= 3);
  const std::vector<double> tail(after.end() - 3, after.end());
  const std::vector<double> want(uninterrupted.begin() + 3, uninterrupted.end());
  CHECK(tail == want);
}

namespace {

struct PeftCkBlockImpl : torch::nn::Module, accel::GradientCheckpointingLayer {
  torch::nn::Linear fc{nullptr};
  PeftCkBlockImpl() { fc = register_module("fc", torch::nn::Linear(6, 6)); }
  torch::Tensor forward(const torch::Tensor& x) {
    return checkpointed_call([this](const torch::Tensor& h) { return h + torch::tanh(fc->forward(h)); }, x,
                             is_training());
  }
};
TORCH_MODULE(PeftCkBlock);

struct PeftCkModelImpl : torch::nn::Module {
  torch::nn::ModuleList layers;
  torch::nn::Linear head{nullptr};
  PeftCkModelImpl() {
    for (int i = 0; i < 3; ++i)
      layers->push_back(PeftCkBlock());
    register_module("layers", layers);
    head = register_module("head", torch::nn::Linear(6, 1));
  }
  torch::Tensor forward(torch::Tensor x) {
    for (const auto& l : *layers)
      x = l->as<PeftCkBlockImpl>()->forward(x);
    return head->forward(x);
  }
};
TORCH_MODULE(PeftCkModel);

std::vector<double> peft_checkpointing_run(bool on, const fs::path& out) {
  torch::manual_seed(1);
  PeftCkModel model;
  auto args = peft_quiet_args(out);
  args.max_steps = 5;
  args.gradient_checkpointing = on;
  args.gradient_checkpointing_kwargs = {{"use_reentrant", false}};
  auto data = PeftIndexDataset(32, 6).map(torch::data::transforms::Stack<>());
  accel::Trainer trainer(args, model, std::move(data), [&model](auto& batch) {
    return torch::mse_loss(model->forward(batch.data), batch.target);
  });
  trainer.train();
  if (on)
    for (const auto& l : *model->layers)
      CHECK(l->as<PeftCkBlockImpl>()->gradient_checkpointing());
  return peft_step_losses(trainer.state());
}

}  // namespace

TEST_CASE("Trainer: gradient_checkpointing over a ModuleList of blocks gives the losses of the plain run") {
  TempDir a, b;
  const auto plain = peft_checkpointing_run(false, a.path);
  const auto checkpointed = peft_checkpointing_run(true, b.path);
  REQUIRE(plain.size() == 5);
  CHECK(plain == checkpointed);
}

// transformers' Trainer order, from tests/python/hf_trainer_order.py ($ACCEL_HF_ORDER_FILE).
TEST_CASE("Trainer: each epoch's sample order is transformers' Trainer's", "[.hf_order]") {
  const char* file = std::getenv("ACCEL_HF_ORDER_FILE");
  REQUIRE(file != nullptr);
  std::ifstream in(file);
  REQUIRE(in);
  struct Case {
    std::size_t n;
    std::int64_t batch;
    std::uint64_t seed;
    std::optional<std::uint64_t> data_seed;
  };
  const std::map<std::string, Case> cases = {{"seed42", {10, 4, 42, std::nullopt}},
                                             {"seed7_data_seed3", {13, 3, 7, 3}},
                                             {"seed0", {40, 8, 0, std::nullopt}}};
  std::map<std::string, std::vector<std::vector<std::int64_t>>> hf;
  for (std::string line; std::getline(in, line);) {
    std::istringstream words(line);
    std::string name;
    int epoch = 0;
    words >> name >> epoch;
    auto& epochs = hf[name];
    epochs.resize(static_cast<std::size_t>(epoch) + 1);
    for (std::int64_t i = 0; words >> i;)
      epochs[static_cast<std::size_t>(epoch)].push_back(i);
  }
  REQUIRE(hf.size() == cases.size());
  for (const auto& [name, c] : cases) {
    INFO(name);
    TempDir out;
    auto args = peft_quiet_args(out.path);
    args.per_device_train_batch_size = c.batch;
    args.num_train_epochs = 2;
    args.seed = c.seed;
    args.data_seed = c.data_seed;
    args.logging_strategy = "no";
    torch::nn::Linear model(1, 1);
    std::vector<std::int64_t> seen;
    auto data = PeftIndexDataset(c.n).map(torch::data::transforms::Stack<>());
    accel::Trainer trainer(args, model, std::move(data), [&](auto& batch) {
      for (std::int64_t i = 0; i < batch.data.size(0); ++i)
        seen.push_back(static_cast<std::int64_t>(batch.data[i][0].template item<float>()));
      return torch::mse_loss(model->forward(batch.data), batch.target);
    });
    trainer.train();
    REQUIRE(seen.size() == 2 * c.n);
    const std::vector<std::int64_t> first(seen.begin(), seen.begin() + static_cast<std::ptrdiff_t>(c.n));
    const std::vector<std::int64_t> second(seen.begin() + static_cast<std::ptrdiff_t>(c.n), seen.end());
    CHECK(first == hf.at(name).at(0));
    CHECK(second == hf.at(name).at(1));
    std::cout << "hf_order: " << name << ": both epochs in transformers' Trainer's order" << std::endl;
  }
}

namespace {

// A DeepSpeed config for one CPU process whose JSON file (written into `dir`) holds `json`.
accel::Config ds_json_config(const fs::path& dir, const std::string& json) {
  const auto file = (dir / "ds.json").string();
  std::ofstream(file) << json;
  return accel::Config::load_string(
      "distributed_type: DEEPSPEED\nuse_cpu: true\nnum_processes: 1\n"
      "deepspeed_config:\n  deepspeed_config_file: " +
          file + "\n",
      "ds.yaml");
}

// The model's parameters, by name, whole (gathered under sharding).
std::map<std::string, torch::Tensor> whole_params(accel::Accelerator& acc, torch::nn::Linear& model) {
  std::map<std::string, torch::Tensor> out;
  for (const auto& [name, t] : acc.get_state_dict(model))
    out[name] = t.to(torch::kFloat64);
  return out;
}

// Records the learning rate of each step of the Trainer's runs (the loss runs once per step: one batch of the
// whole data set per step).
struct RateLog {
  accel::detail::TrainerBase* trainer = nullptr;
  std::vector<double> rates;
  void record() { rates.push_back(trainer->optimizer()->param_groups().front().options().get_lr()); }
  std::vector<double> take() { return std::exchange(rates, {}); }
};

}  // namespace

TEST_CASE("Trainer: a DeepSpeed JSON's Adam with bias_correction false trains as DeepSpeed's Adam (ZeRO-2)") {
  TempDir dir;
  // ZeRO-2 with the optimizer offloaded to the CPU: DeepSpeed would build its CPU Adam from this block.
  const auto config = ds_json_config(dir.path, R"({"zero_optimization": {"stage": 2,
      "offload_optimizer": {"device": "cpu"}}, "train_micro_batch_size_per_gpu": "auto",
      "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                    "weight_decay": "auto", "bias_correction": false}}})");
  auto args = peft_quiet_args(dir.path / "out");
  args.per_device_train_batch_size = 8;  // the whole data set in every step: its order does not matter
  args.max_steps = 3;
  args.weight_decay = 0.1;
  args.lr_scheduler_type = "constant";
  args.max_grad_norm = 0;  // no clipping (the JSON has no gradient_clipping)
  torch::manual_seed(0);
  torch::nn::Linear model(3, 1);
  std::map<std::string, torch::Tensor> w;
  for (const auto& p : model->named_parameters())
    w[p.key()] = p.value().detach().to(torch::kFloat64).clone();
  accel::Trainer trainer(
      args, model, PeftIndexDataset(8, 3).map(torch::data::transforms::Stack<>()),
      [&](auto& batch) { return torch::mse_loss(model->forward(batch.data), batch.target); },
      accel::AcceleratorOptions().config(config));
  trainer.train();
  auto* adamw = dynamic_cast<accel::optim::DeepSpeedAdamW*>(trainer.optimizer());
  REQUIRE(adamw != nullptr);
  CHECK_FALSE(adamw->bias_correction());
  const auto got = whole_params(trainer.accelerator(), model);
  // DeepSpeed's update (csrc/includes/cpu_adam.h, bias correction 1) in doubles on the full-batch gradient.
  std::vector<torch::Tensor> xs, ys;
  for (std::size_t i = 0; i < 8; ++i) {
    const auto e = PeftIndexDataset(8, 3).get(i);
    xs.push_back(e.data.to(torch::kFloat64));
    ys.push_back(e.target.to(torch::kFloat64));
  }
  const auto x = torch::stack(xs), y = torch::stack(ys);
  const auto reference = [&](bool bias_correction) {
    auto weight = w.at("weight").clone().requires_grad_(), bias = w.at("bias").clone().requires_grad_();
    torch::Tensor m[2] = {torch::zeros_like(weight), torch::zeros_like(bias)};
    torch::Tensor v[2] = {torch::zeros_like(weight), torch::zeros_like(bias)};
    const double lr = args.learning_rate, b1 = args.adam_beta1, b2 = args.adam_beta2, eps = args.adam_epsilon;
    for (int t = 1; t <= 3; ++t) {
      weight.mutable_grad() = torch::Tensor();
      bias.mutable_grad() = torch::Tensor();
      torch::mse_loss(torch::nn::functional::linear(x, weight, bias), y).backward();
      torch::NoGradGuard no_grad;
      const double bc1 = bias_correction ? 1 - std::pow(b1, t) : 1.0;
      const double bc2 = bias_correction ? 1 / std::sqrt(1 - std::pow(b2, t)) : 1.0;
      torch::Tensor* params[2] = {&weight, &bias};
      for (int k = 0; k < 2; ++k) {
        auto& p = *params[k];
        const auto g = p.grad();
        m[k] = m[k] * b1 + g * (1 - b1);
        v[k] = v[k] * b2 + g * g * (1 - b2);
        const auto update = m[k] / (v[k].sqrt() * bc2 + eps);
        p.mul_(1 - lr * args.weight_decay);  // the block's weight decay on every parameter, bias too
        p.add_(update * (-lr / bc1));
      }
    }
    return std::map<std::string, torch::Tensor>{{"weight", weight.detach()}, {"bias", bias.detach()}};
  };
  const auto want = reference(false), corrected = reference(true);
  for (const auto& [name, t] : want) {
    INFO(name << ": " << got.at(name) << " vs DeepSpeed's " << t);
    CHECK(torch::allclose(got.at(name), t, 0, 1e-6));
    CHECK_FALSE(torch::allclose(corrected.at(name), t, 0, 1e-4));  // the switch shows in these weights
  }
}

TEST_CASE("Trainer: a second train() starts a new schedule, and under DeepSpeed a new optimizer, as HF's") {
  // transformers' Trainer at each train(): a new TrainerState; the schedule it built is built again
  // (_prepare_for_training: "We need to reset the scheduler"); without DeepSpeed the optimizer is kept
  // (create_optimizer builds one only when there is none), with DeepSpeed deepspeed_init sets it to None and
  // DeepSpeed builds a new one from the JSON block, with a new schedule from the scheduler block.
  TempDir dir;
  auto args = peft_quiet_args(dir.path / "out");
  args.per_device_train_batch_size = 8;  // the whole data set in every step: its order does not matter
  args.max_steps = 4;
  args.warmup_steps = 1;
  args.weight_decay = 0.1;
  const auto data = [] { return PeftIndexDataset(8, 3).map(torch::data::transforms::Stack<>()); };
  const auto adam_steps = [](torch::optim::Optimizer* opt) {
    REQUIRE(opt != nullptr);
    REQUIRE(!opt->state().empty());
    return static_cast<const torch::optim::AdamWParamState&>(*opt->state().begin()->second).step();
  };
  SECTION("TrainingArguments' optimizer and schedule") {
    torch::manual_seed(0);
    torch::nn::Linear model(3, 1);
    RateLog log;
    accel::Trainer trainer(args, model, data(), [&](auto& batch) {
      log.record();
      return torch::mse_loss(model->forward(batch.data), batch.target);
    });
    log.trainer = &trainer;
    trainer.train();
    const auto first = log.take();
    auto* optimizer = trainer.optimizer();
    const auto second = trainer.train();
    REQUIRE(first.size() == 4);
    CHECK(log.rates == first);  // the linear schedule again from its warmup, not its end
    CHECK(second.global_step == 4);
    CHECK(peft_step_losses(trainer.state()).size() == 4);  // this run's log only
    CHECK(trainer.optimizer() == optimizer);
    CHECK(adam_steps(optimizer) == 8);  // kept, with its state
  }
  SECTION("a DeepSpeed JSON's optimizer and scheduler blocks") {
    const auto config = ds_json_config(dir.path, R"({"zero_optimization": {"stage": 0},
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                      "weight_decay": "auto"}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                      "warmup_num_steps": "auto", "total_num_steps": "auto"}}})");
    torch::manual_seed(0);
    torch::nn::Linear model(3, 1), fresh(3, 1);
    RateLog log;
    accel::Trainer trainer(
        args, model, data(),
        [&](auto& batch) {
          log.record();
          return torch::mse_loss(model->forward(batch.data), batch.target);
        },
        accel::AcceleratorOptions().config(config));
    log.trainer = &trainer;
    trainer.train();
    const auto first = log.take();
    const auto after_first = whole_params(trainer.accelerator(), model);
    trainer.train();
    REQUIRE(first.size() == 4);
    CHECK(log.rates == first);                    // WarmupDecayLR from its first step again
    CHECK(adam_steps(trainer.optimizer()) == 4);  // a new optimizer: its state counts this run's steps
    // The second run is a new Trainer's run from the first run's weights.
    {
      torch::NoGradGuard no_grad;
      for (auto& p : fresh->named_parameters())
        p.value().copy_(after_first.at(p.key()));
    }
    accel::Trainer again(
        args, fresh, data(),
        [&](auto& batch) { return torch::mse_loss(fresh->forward(batch.data), batch.target); },
        accel::AcceleratorOptions().config(config));
    again.train();
    const auto want = whole_params(again.accelerator(), fresh),
               got = whole_params(trainer.accelerator(), model);
    for (const auto& [name, t] : want) {
      INFO(name << ": " << got.at(name) << " vs a new Trainer's " << t);
      CHECK(torch::allclose(got.at(name), t, 0, 1e-7));
    }
  }
}

namespace {

// A small net with dropout (the random stream is part of what a resume restores).
torch::nn::Sequential peft_dropout_net(std::uint64_t seed) {
  torch::manual_seed(seed);
  return torch::nn::Sequential(torch::nn::Linear(3, 8), torch::nn::Tanh(), torch::nn::Dropout(0.2),
                               torch::nn::Linear(8, 1));
}

struct PeftRunResult {
  std::vector<double> losses;  // of the run's log, from its first step (a resumed run's from its checkpoint)
  std::map<std::string, torch::Tensor> weights;
};

PeftRunResult peft_run_result(accel::detail::TrainerBase& trainer, accel::Accelerator& acc,
                              torch::nn::Sequential& model) {
  PeftRunResult r;
  r.losses = peft_step_losses(trainer.state());
  for (const auto& [name, t] : acc.get_state_dict(model))
    r.weights[name] = t.clone();
  return r;
}

}  // namespace

TEST_CASE("Trainer: a checkpoint of a second train(), or after an fp16-skipped step, resumes as HF's") {
  // transformers' Trainer: each train() is a run with a new TrainerState, and its checkpoints are that run's
  // (global_step from 0): the same Trainer, or a new one, resumes from them to the uninterrupted run's
  // losses. Mid-epoch (step 4 of 3-step epochs, the last window of each epoch one batch short), with warmup,
  // dropout, accumulation, and the Accelerator's own count of optimizer steps ahead of the run's global_step
  // by the first run's 8, or behind it by a step the fp16 loss scaler skipped (the checkpoint records the
  // difference; both were refused as damaged checkpoints before).
  TempDir dir;
  auto args = peft_quiet_args(dir.path / "out");
  args.max_steps = 8;
  args.gradient_accumulation_steps = 2;
  args.warmup_steps = 2;
  args.weight_decay = 0.1;
  args.save_strategy = "steps";
  args.save_steps = 4;
  const auto data = [] { return PeftIndexDataset(20, 3).map(torch::data::transforms::Stack<>()); };
  const auto checkpoint = (dir.path / "out" / "checkpoint-4").string();
  // Runs train() `runs` times on one Trainer (each run's checkpoints replace the last's); the same Trainer
  // and a new one resume the last run's checkpoint-4. The accelerator's steps minus global_step it recorded.
  // With `overflow`, the loss of each run's first step is multiplied by 1e36: finite, but the fp16 loss
  // scaler's product is not, and the scaler skips that step (HF counts it in global_step; the Accelerator
  // does not count it as an optimizer step).
  bool overflow = false;
  const accel::detail::TrainerBase* running = nullptr;
  const auto loss = [&](torch::nn::Sequential& m, const torch::data::Example<>& batch) {
    const auto l = torch::mse_loss(m->forward(batch.data), batch.target);
    return overflow && running->state().global_step == 0 ? l * 1e36 : l;
  };
  const auto check = [&](const std::optional<accel::Config>& config, int runs) {
    INFO(runs << " run(s) before the resume");
    const auto options = [&] {
      return config ? accel::AcceleratorOptions().config(*config) : accel::AcceleratorOptions();
    };
    auto model = peft_dropout_net(0);
    accel::Trainer trainer(
        args, model, data(), [&](auto& batch) { return loss(model, batch); }, options());
    running = &trainer;
    std::vector<double> first;
    for (int r = 0; r < runs; ++r) {
      if (r == 1) first = peft_step_losses(trainer.state());
      trainer.train();
    }
    const auto last = peft_run_result(trainer, trainer.accelerator(), model);
    REQUIRE(last.losses.size() == 8);
    if (runs > 1) CHECK(first != last.losses);  // the second run starts from the first's weights
    std::ifstream in(fs::path(checkpoint) / "trainer_state.json");
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const auto saved = accel::TrainerState::from_json(text, checkpoint);
    const auto key = saved.stateful_callbacks.find("accelerate-cpp:AcceleratorStepOffset");
    const double offset = key == saved.stateful_callbacks.end() ? 0.0 : key->second.at("offset");
    const auto checkpoint8 = (dir.path / "out" / "checkpoint-8").string();
    {
      INFO("the same Trainer resumes its last run's checkpoint-4");
      fs::remove_all(checkpoint8);  // written again below by the resumed run
      trainer.train(checkpoint);
      const auto again = peft_run_result(trainer, trainer.accelerator(), model);
      CHECK(again.losses == last.losses);
      for (const auto& [name, t] : last.weights)
        CHECK(torch::equal(again.weights.at(name), t));
    }
    {
      INFO("the resumed run's own checkpoint-8 records the same difference and resumes (review R2)");
      std::ifstream in8(fs::path(checkpoint8) / "trainer_state.json");
      const std::string text8((std::istreambuf_iterator<char>(in8)), std::istreambuf_iterator<char>());
      const auto saved8 = accel::TrainerState::from_json(text8, checkpoint8);
      const auto key8 = saved8.stateful_callbacks.find("accelerate-cpp:AcceleratorStepOffset");
      CHECK((key8 == saved8.stateful_callbacks.end() ? 0.0 : key8->second.at("offset")) == offset);
      auto fresh = peft_dropout_net(98);
      accel::Trainer resumed(
          args, fresh, data(), [&](auto& batch) { return loss(fresh, batch); }, options());
      running = &resumed;
      resumed.train(checkpoint8);  // at max_steps: loads, checks the counters, trains nothing
      const auto got = peft_run_result(resumed, resumed.accelerator(), fresh);
      for (const auto& [name, t] : last.weights)
        CHECK(torch::equal(got.weights.at(name), t));
    }
    {
      INFO("a new Trainer (another initial model) resumes the last run's checkpoint-4");
      auto fresh = peft_dropout_net(99);
      accel::Trainer resumed(
          args, fresh, data(), [&](auto& batch) { return loss(fresh, batch); }, options());
      running = &resumed;
      resumed.train(checkpoint);
      const auto got = peft_run_result(resumed, resumed.accelerator(), fresh);
      CHECK(got.losses == last.losses);
      for (const auto& [name, t] : last.weights)
        CHECK(torch::equal(got.weights.at(name), t));
    }
    return offset;
  };
  SECTION("TrainingArguments' optimizer and schedule") {
    CHECK(check(std::nullopt, 2) == 8);
    // Such a checkpoint whose global_step or recorded difference was edited (its manifest rewritten to agree)
    // is still refused before anything loads, naming the counters.
    for (const auto& [from, to, want] : std::vector<std::array<std::string, 3>>{
             {"\"global_step\": 4,", "\"global_step\": 3,",
              "says global_step 3 and accelerate-cpp:AcceleratorStepOffset 8 (the accelerator's optimizer "
              "steps "
              "minus global_step), but the accelerator state in the same checkpoint completed 12 optimizer "
              "steps; the checkpoint is damaged or was edited. Resume from another checkpoint; nothing was "
              "loaded"},
             {"\"offset\": 8.0", "\"offset\": 8.5",
              "stateful_callbacks[\"accelerate-cpp:AcceleratorStepOffset\"] has no attributes.offset that is "
              "an "
              "integer in [-2^48, 2^48]"}}) {
      const auto file = fs::path(checkpoint) / "trainer_state.json";
      std::ifstream in(file);
      std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      in.close();
      const auto edited = text;
      REQUIRE(text.find(from) != std::string::npos);
      text.replace(text.find(from), from.size(), to);
      std::ofstream(file, std::ios::trunc) << text;
      const auto m = accel::detail::read_manifest(checkpoint);
      accel::detail::write_manifest(checkpoint,
                                    accel::detail::build_manifest(checkpoint, m.checkpoint_id, m.facts, {}));
      auto fresh = peft_dropout_net(99);
      accel::Trainer refused(args, fresh, data(), [&](auto& batch) {
        return torch::mse_loss(fresh->forward(batch.data), batch.target);
      });
      CHECK_THROWS_WITH(refused.train(checkpoint), Contains(want));
      std::ofstream(file, std::ios::trunc) << edited;
    }
  }
  SECTION("a first run's checkpoint, resumed by a later train() of the same Trainer") {
    CHECK(check(std::nullopt, 1) == 0);
  }
  SECTION("ZeRO-2 with a DeepSpeed JSON's optimizer and scheduler blocks") {
    CHECK(check(ds_json_config(dir.path, R"({"zero_optimization": {"stage": 2},
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                      "weight_decay": "auto"}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                      "warmup_num_steps": "auto", "total_num_steps": "auto"}}})"),
                2) == 8);
  }
  SECTION("fp16: a step the loss scaler skipped counts in global_step only") {
    args.fp16 = true;
    overflow = true;
    CHECK(check(std::nullopt, 1) == -1);  // the first run's checkpoint-4, 1 step behind (refused before)
  }
}
