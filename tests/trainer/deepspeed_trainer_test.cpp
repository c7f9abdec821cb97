// A DeepSpeed JSON under accel::Trainer means what it means under Hugging Face's Trainer ([.hf_deepspeed];
// run by tests/python/python_crosschecks.sh after tests/python/hf_deepspeed_config.py wrote
// $ACCEL_HF_DS_DIR):
//  - deepspeed_trainer_config fills each "auto" and lists the mismatching numbers as transformers'
//    HfTrainerDeepSpeedConfig.trainer_config_process + trainer_config_finalize do, on the same files and
//    arguments (also after the config's round trip through the YAML accel-launch hands the ranks), and the
//    error names the file, every key, both values and the fix;
//  - deepspeed_schedule_lr gives DeepSpeed 0.19.6's WarmupLR / WarmupDecayLR / WarmupCosineLR rates, bitwise;
//  - a Trainer run with the optimizer and scheduler blocks ("auto" everywhere) steps with those rates, on
//    DeepSpeed's AdamW over every trainable parameter in one group (the block's weight decay on biases too);
//    "Adam" with adam_w_mode false builds torch's Adam (L2 decay); set_optimizer with a block is refused.
#include <catch2/catch.hpp>

#include <accel/config/deepspeed_trainer.hpp>
#include <accel/trainer/trainer.hpp>

#include "temp_dir.hpp"

#include <nlohmann/json.hpp>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;
using Catch::Matchers::Contains;

accel::Config ds_load(const std::string& json_file, int world) {
  return accel::Config::load_string(
      "distributed_type: DEEPSPEED\nuse_cpu: true\nnum_processes: " + std::to_string(world) +
          "\ndeepspeed_config:\n  deepspeed_config_file: " + json_file + "\n",
      "ds.yaml");
}

accel::DeepSpeedTrainerArgs ds_args_of(const Json& c) {
  const Json& a = c.at("args");
  accel::DeepSpeedTrainerArgs v;
  v.per_device_train_batch_size = a.at("per_device_train_batch_size").get<std::int64_t>();
  v.gradient_accumulation_steps = a.at("gradient_accumulation_steps").get<std::int64_t>();
  v.world_size = c.at("world_size").get<std::int64_t>();
  v.max_grad_norm = a.at("max_grad_norm").get<double>();
  v.learning_rate = a.at("learning_rate").get<double>();
  v.adam_beta1 = a.at("adam_beta1").get<double>();
  v.adam_beta2 = a.at("adam_beta2").get<double>();
  v.adam_epsilon = a.at("adam_epsilon").get<double>();
  v.weight_decay = a.at("weight_decay").get<double>();
  v.fp16 = a.at("fp16").get<bool>();
  v.bf16 = a.at("bf16").get<bool>();
  v.num_training_steps = c.at("num_training_steps").get<std::int64_t>();
  v.warmup_steps = c.at("warmup").get<std::int64_t>();
  v.source = "args.yaml";
  return v;
}

Json ds_reference() {
  const char* dir = std::getenv("ACCEL_HF_DS_DIR");
  REQUIRE(dir != nullptr);
  std::ifstream in(fs::path(dir) / "cases.json");
  REQUIRE(in);
  return Json::parse(in);
}

// Samples i -> (i, cos i).
class DsPoints : public torch::data::datasets::Dataset<DsPoints> {
 public:
  torch::data::Example<> get(std::size_t i) override {
    const auto x = static_cast<double>(i);
    return {torch::full({2}, x / 10, torch::kFloat32), torch::full({1}, std::cos(x), torch::kFloat32)};
  }
  torch::optional<std::size_t> size() const override { return 64; }
};

accel::TrainingArguments ds_quiet_args(const fs::path& out) {
  accel::TrainingArguments a;
  a.output_dir = out.string();
  a.per_device_train_batch_size = 4;
  a.logging_strategy = "no";
  a.save_strategy = "no";
  a.disable_tqdm = true;
  a.seed = 42;
  return a;
}

}  // namespace

TEST_CASE("Trainer: a DeepSpeed JSON's auto values and mismatches are transformers' Trainer's",
          "[.hf_deepspeed]") {
  const Json ref = ds_reference();
  std::size_t keys = 0;
  for (const auto& c : ref.at("cases")) {
    const std::string name = c.at("name").get<std::string>();
    INFO(name);
    const auto config = ds_load(c.at("file").get<std::string>(), c.at("world_size").get<int>());
    const auto args = ds_args_of(c);
    // Also as the ranks accel-launch starts read it: the written YAML, without the JSON file.
    for (const auto& cfg : {config, accel::Config::load_string(config.to_yaml(), "written.yaml")}) {
      const auto ours = accel::deepspeed_trainer_config(cfg, args, /*throw_on_mismatch=*/false);
      CHECK(Json::parse(ours.filled) == c.at("filled"));
      CHECK(ours.mismatched_keys == c.at("mismatched_keys").get<std::vector<std::string>>());
    }
    keys += c.at("mismatched_keys").size();
    if (c.at("mismatched_keys").empty()) {
      CHECK_NOTHROW(accel::deepspeed_trainer_config(config, args));
      continue;
    }
    try {
      accel::deepspeed_trainer_config(config, args);
      FAIL("no error for " << name);
    } catch (const accel::ConfigError& e) {
      const std::string what = e.what();
      CHECK_THAT(what,
                 Contains(c.at("file").get<std::string>()) && Contains("args.yaml") && Contains("\"auto\""));
      for (const auto& key : c.at("mismatched_keys"))
        CHECK_THAT(what, Contains(key.get<std::string>() + "="));
      CHECK_THAT(
          what,
          Contains("train_micro_batch_size_per_gpu=8 vs TrainingArguments per_device_train_batch_size=4"));
    }
  }
  std::cout << "hf_deepspeed: " << ref.at("cases").size() << " DeepSpeed files filled and checked as "
            << "transformers' HfTrainerDeepSpeedConfig (" << keys << " mismatches, the same keys)\n";
}

TEST_CASE("Trainer: DeepSpeed's schedules give DeepSpeed's rates", "[.hf_deepspeed]") {
  const Json ref = ds_reference();
  accel::test::TempDir dir;
  std::size_t rates = 0;
  for (const auto& s : ref.at("schedules")) {
    const auto file = (dir.path / "sched.json").string();
    std::ofstream(file) << Json{
        {"scheduler", {{"type", s.at("type")}, {"params", s.at("params")}}},
        {"zero_optimization",
         {{"stage", 0}}}}.dump();
    const auto ds = accel::deepspeed_trainer_config(ds_load(file, 1), {}, /*throw_on_mismatch=*/false);
    REQUIRE(ds.scheduler);
    const auto want = s.at("rates").get<std::vector<double>>();
    for (std::size_t k = 0; k < want.size(); ++k) {
      INFO(s.dump() << " step " << k);
      CHECK(accel::deepspeed_schedule_lr(*ds.scheduler, s.at("lr").get<double>(),
                                         static_cast<std::int64_t>(k)) == want[k]);
    }
    rates += want.size();
  }
  std::cout << "hf_deepspeed: " << ref.at("schedules").size() << " DeepSpeed schedules, " << rates
            << " rates equal to DeepSpeed 0.19.6's lr_schedules.py\n";
}

TEST_CASE(
    "Trainer: the optimizer and scheduler blocks of a DeepSpeed JSON are built as DeepSpeed builds them",
    "[.hf_deepspeed]") {
  const Json ref = ds_reference();
  Json trainer_case;  // the schedule the run below fills: WarmupDecayLR, 3 warmup steps of 12, lr 1e-2
  for (const auto& s : ref.at("schedules"))
    if (s.at("lr") == 1e-2) trainer_case = s;
  REQUIRE(!trainer_case.is_null());
  accel::test::TempDir dir;
  const auto file = (dir.path / "ds.json").string();
  std::ofstream(file) << R"({"zero_optimization": {"stage": 0}, "gradient_clipping": "auto",
    "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "train_batch_size": "auto",
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                  "warmup_num_steps": "auto", "total_num_steps": "auto"}}})";
  auto args = ds_quiet_args(dir.path / "out");
  args.learning_rate = 1e-2;
  args.weight_decay = 0.1;
  args.max_steps = 12;
  args.warmup_steps = 3;
  torch::manual_seed(0);
  torch::nn::Linear model(2, 1), model2(2, 1), model3(2, 1), model4(2, 1);
  std::vector<double> seen;
  accel::detail::TrainerBase* running = nullptr;
  accel::Trainer trainer(
      args, model, DsPoints().map(torch::data::transforms::Stack<>()),
      [&](auto& batch) {
        seen.push_back(running->optimizer()->param_groups().front().options().get_lr());
        return torch::mse_loss(model->forward(batch.data), batch.target);
      },
      accel::AcceleratorOptions().config(ds_load(file, 1)));
  running = &trainer;
  trainer.train();
  const auto want = trainer_case.at("rates").get<std::vector<double>>();
  REQUIRE(seen.size() == 12);
  for (std::size_t k = 0; k < seen.size(); ++k) {
    INFO("step " << k);
    CHECK(seen[k] == want[k]);
  }
  // DeepSpeed's AdamW over every trainable parameter in one group, the block's (filled) weight decay on all.
  auto* adamw = dynamic_cast<torch::optim::AdamW*>(trainer.optimizer());
  REQUIRE(adamw != nullptr);
  REQUIRE(adamw->param_groups().size() == 1);
  CHECK(adamw->param_groups().front().params().size() == 2);  // weight and bias
  const auto& o = static_cast<const torch::optim::AdamWOptions&>(adamw->param_groups().front().options());
  CHECK(o.weight_decay() == 0.1);
  CHECK(std::get<1>(o.betas()) == args.adam_beta2);
  std::cout
      << "hf_deepspeed: Trainer with the blocks: 12 steps at DeepSpeed's WarmupDecayLR rates, AdamW in one "
         "group\n";

  // "Adam" with adam_w_mode false: torch's Adam, the weight decay added to the gradient.
  std::ofstream(file) << R"({"zero_optimization": {"stage": 0}, "optimizer": {"type": "Adam",
    "params": {"lr": 0.001, "weight_decay": 0.01, "adam_w_mode": false}}})";
  args.max_steps = 1;
  args.learning_rate = 0.001;
  args.weight_decay = 0.01;
  accel::Trainer adam(
      args, model2, DsPoints().map(torch::data::transforms::Stack<>()),
      [&](auto& batch) { return torch::mse_loss(model2->forward(batch.data), batch.target); },
      accel::AcceleratorOptions().config(ds_load(file, 1)));
  adam.train();
  CHECK(dynamic_cast<torch::optim::AdamW*>(adam.optimizer()) == nullptr);
  REQUIRE(dynamic_cast<torch::optim::Adam*>(adam.optimizer()) != nullptr);
  CHECK(static_cast<const torch::optim::AdamOptions&>(adam.optimizer()->param_groups().front().options())
            .weight_decay() == 0.01);  // L2, on every parameter (one group)
  CHECK(adam.optimizer()->param_groups().size() == 1);

  // Trainer::set_optimizer with a block: refused, as HF's Trainer refuses optimizers= under DeepSpeed.
  accel::Trainer given(
      args, model3, DsPoints().map(torch::data::transforms::Stack<>()),
      [&](auto& batch) { return torch::mse_loss(model3->forward(batch.data), batch.target); },
      accel::AcceleratorOptions().config(ds_load(file, 1)));
  given.set_optimizer(
      std::make_shared<torch::optim::SGD>(model3->parameters(), torch::optim::SGDOptions(0.1)));
  CHECK_THROWS_WITH(given.train(), Contains("set_optimizer") && Contains(file));

  // A number that differs from TrainingArguments: train() stops before the first step, naming both.
  args.learning_rate = 0.002;
  accel::Trainer mismatch(
      args, model4, DsPoints().map(torch::data::transforms::Stack<>()),
      [&](auto& batch) { return torch::mse_loss(model4->forward(batch.data), batch.target); },
      accel::AcceleratorOptions().config(ds_load(file, 1)));
  CHECK_THROWS_WITH(mismatch.train(),
                    Contains("optimizer.params.lr=0.001 vs TrainingArguments learning_rate=0.002"));
}
