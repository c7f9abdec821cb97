// accel::TrainingArguments: HF's names and defaults, HF's training_args.json loaded as is, command-line
// overrides, and errors that name the file, line, key and value.
#include <accel/config/config.hpp>
#include <accel/errors.hpp>
#include <accel/trainer/training_arguments.hpp>
#include "build_paths.hpp"

#include <catch2/catch.hpp>

#include <filesystem>
#include <map>
#include <string>
#include <vector>

using accel::ConfigError;
using accel::TrainingArguments;
using Catch::Matchers::Contains;

TEST_CASE("TrainingArguments: HF's defaults") {
  TrainingArguments a;
  a.validate();
  CHECK(a.output_dir == "trainer_output");
  CHECK(a.num_train_epochs == 3.0);
  CHECK(a.max_steps == -1);
  CHECK(a.per_device_train_batch_size == 8);
  CHECK(a.learning_rate == 5e-5);
  CHECK(a.adam_epsilon == 1e-8);
  CHECK(a.optim == "adamw_torch");
  CHECK(a.lr_scheduler_type == "linear");
  CHECK(a.max_grad_norm == 1.0);
  CHECK(a.logging_steps == 500);
  CHECK(a.save_steps == 500);
  CHECK(a.eval_steps == 500);  // defaults to logging_steps
  CHECK(a.seed == 42);
  CHECK(a.logging_dir == "trainer_output/runs");
  CHECK_FALSE(a.metric_for_best_model);
  CHECK(a.dataloader_pin_memory);  // HF pins batches on a GPU by default
  CHECK_FALSE(
      TrainingArguments::load_string("dataloader_pin_memory: false\n", "run.yaml").dataloader_pin_memory);
}

TEST_CASE("TrainingArguments: a training_args.json written by HF's TrainingArguments loads as is") {
  // Every key of transformers 4.46's TrainingArguments.to_json_string(), with non-default values where
  // accel::Trainer implements the key.
  auto a = TrainingArguments::load_file(accel::test::test_data_dir() + "/trainer/hf_training_args.json");
  a.validate();
  CHECK(a.output_dir == "out/fashion");
  CHECK(a.eval_strategy == "steps");
  CHECK(a.per_device_train_batch_size == 16);
  CHECK(a.per_device_eval_batch_size == 32);
  CHECK(a.gradient_accumulation_steps == 2);
  CHECK(a.learning_rate == 3e-4);
  CHECK(a.weight_decay == 0.01);
  CHECK(a.lr_scheduler_type == "cosine");
  CHECK(a.warmup_ratio == 0.1);
  CHECK(a.logging_steps == 50);
  CHECK(a.save_steps == 200);
  CHECK(a.save_total_limit == 2);
  CHECK(a.eval_steps == 100);
  CHECK(a.load_best_model_at_end);
  CHECK(a.metric_for_best_model == "accuracy");
  CHECK(a.greater_is_better == true);
  CHECK_FALSE(a.average_tokens_across_devices);  // transformers 4.46's default; 5's is true
  CHECK(a.report_to == std::vector<std::string>{"tensorboard"});
  CHECK(a.is_explicit("gradient_accumulation_steps"));
  CHECK_FALSE(a.is_explicit("nonfinite_loss"));
  // The non-empty accelerator_config and fsdp_config mappings are ignored with a notice.
  CHECK(a.notices.size() == 2);
  // Round trip through our YAML and JSON.
  auto b = TrainingArguments::load_string(a.to_yaml(), "yaml");
  CHECK(b.to_yaml() == a.to_yaml());
  auto c = TrainingArguments::load_string(a.to_json(), "json");
  CHECK(c.to_yaml() == a.to_yaml());
}

TEST_CASE("TrainingArguments: unknown and unsupported keys are errors naming file, line, key") {
  try {
    TrainingArguments::load_string("output_dir: x\nlearnig_rate: 1e-3\n", "run.yaml");
    FAIL("no error");
  } catch (const ConfigError& e) {
    CHECK_THAT(e.what(), Contains("run.yaml:2") && Contains("learnig_rate") && Contains("learning_rate"));
    CHECK(e.line() == 2);
    CHECK(e.key() == "learnig_rate");
  }
  // An HF key we do not implement: fine at HF's default, refused otherwise, saying what to do.
  CHECK_NOTHROW(TrainingArguments::load_string("label_smoothing_factor: 0.0\n", "run.yaml"));
  CHECK_THROWS_WITH(TrainingArguments::load_string("label_smoothing_factor: 0.1\n", "run.yaml"),
                    Contains("run.yaml:1") && Contains("label_smoothing_factor") && Contains("compute_loss"));
  CHECK_THROWS_WITH(TrainingArguments::load_string("deepspeed: ds.json\n", "run.yaml"),
                    Contains("deepspeed_config_file"));
  CHECK_THROWS_WITH(TrainingArguments::load_string("optim: adafactor\n", "run.yaml"),
                    Contains("'adafactor' is not one of") && Contains("Trainer::set_optimizer"));
  CHECK_THROWS_WITH(TrainingArguments::load_string("learning_rate: fast\n", "run.yaml"),
                    Contains("learning_rate") && Contains("expected a number, got 'fast'"));
  CHECK_THROWS_WITH(TrainingArguments::load_string("- a\n- b\n", "run.yaml"), Contains("a mapping"));
  // A NUL byte (UTF-16, binary): yaml-cpp read such a file as empty, all defaults, without a word.
  CHECK_THROWS_WITH(TrainingArguments::load_string(std::string("learning_rate: 1\n\0", 18), "run.yaml"),
                    Contains("run.yaml:2: the file holds a NUL byte (byte 17)"));
  CHECK_THROWS_WITH(TrainingArguments::load_string("\xFF\xFEl\0r\0", "run.yaml"),
                    Contains("run.yaml:1: the file is UTF-16 encoded"));
  // Hub keys never change a run: accepted, noted.
  auto a = TrainingArguments::load_string("hub_model_id: me/model\n", "run.yaml");
  CHECK(a.notices.size() == 1);
  // Old HF name of eval_strategy.
  CHECK(TrainingArguments::load_string("evaluation_strategy: epoch\n").eval_strategy == "epoch");
}

TEST_CASE("TrainingArguments: HF's __post_init__ rules") {
  auto invalid = [](const std::string& yaml) {
    auto a = TrainingArguments::load_string(yaml, "run.yaml");
    a.validate();
  };
  CHECK_THROWS_WITH(invalid("fp16: true\nbf16: true\n"), Contains("choose one"));
  CHECK_THROWS_WITH(invalid("load_best_model_at_end: true\n"), Contains("eval_strategy"));
  CHECK_THROWS_WITH(invalid("load_best_model_at_end: true\neval_strategy: steps\nsave_strategy: epoch\n"),
                    Contains("save_strategy to match eval_strategy"));
  CHECK_THROWS_WITH(
      invalid("load_best_model_at_end: true\neval_strategy: steps\neval_steps: 30\nsave_steps: 50\n"),
      Contains("round multiple of eval_steps"));
  CHECK_THROWS_WITH(invalid("per_device_train_batch_size: 0\n"), Contains("must be positive"));
  CHECK_THROWS_WITH(invalid("warmup_ratio: 1.5\n"), Contains("[0, 1]"));
  CHECK_THROWS_WITH(invalid("report_to: wandb\n"), Contains("wandb") && Contains("tensorboard"));
  auto a = TrainingArguments::load_string(
      "load_best_model_at_end: true\neval_strategy: steps\neval_steps: 10\nsave_steps: 20\n", "run.yaml");
  a.validate();
  CHECK(a.metric_for_best_model == "loss");  // HF's default with load_best_model_at_end
  CHECK(a.greater_is_better == false);
  auto w = TrainingArguments::load_string("warmup_steps: 0.25\n");
  CHECK(w.warmup_ratio == 0.25);  // HF 5: warmup_steps below 1 is a ratio
  CHECK(w.warmup_steps == 0);
  // save_strategy best (HF 4.46+): needs metric_for_best_model and an evaluation, and frees
  // load_best_model_at_end from matching the strategies.
  CHECK_THROWS_WITH(invalid("save_strategy: best\neval_strategy: steps\n"),
                    Contains("metric_for_best_model") && Contains("save_strategy best"));
  CHECK_THROWS_WITH(invalid("save_strategy: best\nmetric_for_best_model: accuracy\n"),
                    Contains("set eval_strategy to steps or epoch"));
  auto best = TrainingArguments::load_string(
      "save_strategy: best\neval_strategy: steps\neval_steps: 3\nload_best_model_at_end: true\n"
      "metric_for_best_model: accuracy\n",
      "run.yaml");
  CHECK_NOTHROW(best.validate());
  CHECK(best.greater_is_better == true);
  // HF: greater_is_better defaults to false for every metric whose name ends with "loss".
  auto val = TrainingArguments::load_string(
      "save_strategy: best\neval_strategy: epoch\nmetric_for_best_model: val_loss\n", "run.yaml");
  val.validate();
  CHECK(val.greater_is_better == false);
  CHECK_THROWS_WITH(invalid("save_strategy: sometimes\n"), Contains("'sometimes' is not one of"));
}

TEST_CASE("TrainingArguments: the command line overrides the file") {
  const std::string file = accel::test::test_data_dir() + "/trainer/hf_training_args.json";
  std::vector<const char*> argv = {"prog",       "--learning_rate", "1e-3",     "--training_args",
                                   file.c_str(), "--bf16",          "--seed=7", "--data-dir",
                                   "/data"};
  std::vector<std::string> rest;
  auto a = TrainingArguments::from_command_line(static_cast<int>(argv.size()), argv.data(), &rest);
  CHECK(a.learning_rate == 1e-3);
  CHECK(a.bf16);
  CHECK(a.seed == 7);
  CHECK(a.per_device_train_batch_size == 16);  // from the file
  CHECK(rest == std::vector<std::string>{"--data-dir", "/data"});
  // One typo away from a key is an error even with `remaining`.
  std::vector<const char*> typo = {"prog", "--learning_rat", "1e-3"};
  CHECK_THROWS_WITH(TrainingArguments::from_command_line(3, typo.data(), &rest),
                    Contains("--learning_rat") && Contains("--learning_rate"));
  std::vector<const char*> bad = {"prog", "--max_steps", "ten"};
  CHECK_THROWS_WITH(TrainingArguments::from_command_line(3, bad.data()),
                    Contains("max_steps") && Contains("'ten'"));
  std::vector<const char*> list = {"prog", "--report_to", "tensorboard,jsonl"};
  CHECK(TrainingArguments::from_command_line(3, list.data()).report_to ==
        std::vector<std::string>{"tensorboard", "jsonl"});
}

TEST_CASE("TrainingArguments: every training type of config_templates/trainer loads and validates") {
  namespace fs = std::filesystem;
  int types = 0;
  for (const auto& e : fs::directory_iterator(fs::path(accel::test::config_template_dir()) / "trainer")) {
    const std::string name = e.path().filename().string();
    const std::string suffix = ".accelerate.yaml";
    if (name.size() <= suffix.size() || name.compare(name.size() - suffix.size(), suffix.size(), suffix) != 0)
      continue;
    INFO(name);
    CHECK_NOTHROW(accel::Config::load_file(e.path().string()));
    const auto args_file = e.path().parent_path() / (name.substr(0, name.size() - suffix.size()) + ".yaml");
    REQUIRE(fs::exists(args_file));
    auto a = TrainingArguments::load_file(args_file.string());
    CHECK_NOTHROW(a.validate());
    ++types;
  }
  CHECK(types >= 7);  // full, lora, qlora, deepspeed, stage2_offload, stage3, minimal
}

TEST_CASE("TrainingArguments: lr_scheduler_kwargs and gradient_checkpointing_kwargs, as HF's") {
  auto a = TrainingArguments::load_string(
      "lr_scheduler_type: cosine_with_min_lr\nlr_scheduler_kwargs: {min_lr_rate: 0.1}\n"
      "gradient_checkpointing: true\ngradient_checkpointing_kwargs: {use_reentrant: false}\n",
      "run.yaml");
  a.validate();
  CHECK(a.lr_scheduler_kwargs == std::map<std::string, double>{{"min_lr_rate", 0.1}});
  CHECK(a.gradient_checkpointing_kwargs == std::map<std::string, bool>{{"use_reentrant", false}});
  // Written back and read again (to_yaml, HF's JSON).
  auto b = TrainingArguments::load_string(a.to_yaml(), "again.yaml");
  CHECK(b.lr_scheduler_kwargs == a.lr_scheduler_kwargs);
  CHECK(b.gradient_checkpointing_kwargs == a.gradient_checkpointing_kwargs);
  CHECK(TrainingArguments::load_string(a.to_json(), "again.json").lr_scheduler_kwargs ==
        a.lr_scheduler_kwargs);
  // HF's command line takes the mapping as JSON.
  std::vector<const char*> argv = {"prog",
                                   "--lr_scheduler_type",
                                   "cosine_with_min_lr",
                                   "--lr_scheduler_kwargs",
                                   "{\"min_lr\": 1e-5}",
                                   "--gradient_checkpointing_kwargs",
                                   "{\"use_reentrant\": true}"};
  auto c = TrainingArguments::from_command_line(static_cast<int>(argv.size()), argv.data());
  c.validate();
  CHECK(c.lr_scheduler_kwargs.at("min_lr") == 1e-5);
  CHECK(c.gradient_checkpointing_kwargs.at("use_reentrant"));
  // transformers' rules: one of min_lr / min_lr_rate; a schedule refuses arguments it does not take.
  auto none = TrainingArguments::load_string("lr_scheduler_type: cosine_with_min_lr\n", "run.yaml");
  CHECK_THROWS_WITH(none.validate(), Contains("needs min_lr or min_lr_rate"));
  auto both = TrainingArguments::load_string(
      "lr_scheduler_type: cosine_with_min_lr\nlr_scheduler_kwargs: {min_lr: 1.0e-5, min_lr_rate: 0.1}\n",
      "run.yaml");
  CHECK_THROWS_WITH(both.validate(), Contains("not both"));
  auto wrong = TrainingArguments::load_string(
      "lr_scheduler_type: linear\nlr_scheduler_kwargs: {min_lr: 1.0e-5}\n", "run.yaml");
  CHECK_THROWS_WITH(wrong.validate(), Contains("'min_lr' is not an argument of lr_scheduler_type linear"));
  CHECK_THROWS_WITH(TrainingArguments::load_string(
                        "gradient_checkpointing_kwargs: {determinism_check: none}\n", "run.yaml"),
                    Contains("run.yaml:1") && Contains("determinism_check"));
  CHECK_THROWS_WITH(TrainingArguments::load_string("lr_scheduler_kwargs: {min_lr: low}\n", "run.yaml"),
                    Contains("lr_scheduler_kwargs.min_lr") && Contains("'low'"));
  CHECK_THROWS_WITH(TrainingArguments::load_string("optim: adam_weird\n", "run.yaml"),
                    Contains("Trainer::set_optimizer"));
}
