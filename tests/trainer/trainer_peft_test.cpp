// accel::Trainer with LoRA and against transformers' Trainer:
//  - a LoRA run's checkpoints hold the adapter in PEFT's files and the trainable state only (no frozen base),
//    and resuming from one gives the losses of the uninterrupted run;
//  - gradient_checkpointing with blocks in a ModuleList (GradientCheckpointingLayer) trains as without;
//  - [.hf_order]: the sample order of each epoch is transformers' Trainer's (tests/python/hf_trainer_order.py
//    writes it, python_crosschecks.sh runs both).
#include <catch2/catch.hpp>

#include <accel/checkpoint/safetensors.hpp>
#include <accel/nn/activation_checkpoint.hpp>
#include <accel/nn/lora.hpp>
#include <accel/trainer/trainer.hpp>

#include "temp_dir.hpp"

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <optional>
#include <sstream>
#include <string>
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
