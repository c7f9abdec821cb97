#pragma once
/// \file deepspeed_trainer.hpp
/// What Hugging Face's Trainer makes of a DeepSpeed JSON file (transformers' HfTrainerDeepSpeedConfig, its
/// `trainer_config_process` and `trainer_config_finalize`, and `deepspeed_optim_sched`), for accel::Trainer:
/// each "auto" of train_micro_batch_size_per_gpu, gradient_accumulation_steps, train_batch_size,
/// gradient_clipping, fp16.enabled, bf16.enabled and the optimizer and scheduler blocks' parameters is filled
/// from TrainingArguments; a number that differs from the TrainingArguments value is a mismatch, and every
/// mismatch is listed in one ConfigError (HF raises ValueError "Please correct the following DeepSpeed config
/// values that mismatch TrainingArguments values"). The `optimizer` block (DeepSpeed's Adam / AdamW) and the
/// `scheduler` block (WarmupLR, WarmupDecayLR, WarmupCosineLR, with the formulas of DeepSpeed 0.19.6's
/// deepspeed/runtime/lr_schedules.py) are then what the Trainer builds. Torch-free.

#include <accel/config/config.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace accel {

/// The TrainingArguments values HF's Trainer fills a DeepSpeed JSON's "auto" values with and checks its
/// numbers against (HF's names; `world_size` is DeepSpeed's data-parallel ranks).
struct DeepSpeedTrainerArgs {
  std::int64_t per_device_train_batch_size = 8;
  std::int64_t gradient_accumulation_steps = 1;
  std::int64_t world_size = 1;
  double max_grad_norm = 1.0;
  double learning_rate = 5e-5;
  double adam_beta1 = 0.9;
  double adam_beta2 = 0.999;
  double adam_epsilon = 1e-8;
  double weight_decay = 0.0;
  bool fp16 = false;
  bool bf16 = false;
  /// The optimizer steps of the run (HF's num_training_steps, max_steps); filled at train().
  std::int64_t num_training_steps = 0;
  /// `get_warmup_steps(num_training_steps)`: HF fills warmup_num_steps with max(1, this).
  std::int64_t warmup_steps = 0;
  /// The TrainingArguments file, for messages ("" for defaults).
  std::string source;
};

/// DeepSpeed's optimizer block, "auto" filled (deepspeed/runtime/engine.py _configure_basic_optimizer).
struct DeepSpeedOptimizer {
  std::string type;  ///< as written: "Adam" or "AdamW" (any case, as DeepSpeed lowercases it)
  /// Decoupled weight decay (AdamW): type AdamW, or Adam with adam_w_mode (DeepSpeed's default true); false:
  /// Adam with L2 weight decay added to the gradient.
  bool adamw_mode = true;
  /// params.torch_adam: torch.optim.Adam / AdamW (their defaults, AdamW's weight_decay 0.01) instead of
  /// DeepSpeed's FusedAdam / DeepSpeedCPUAdam (weight_decay 0): the same update.
  bool torch_adam = false;
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  /// params.bias_correction (FusedAdam / CPU Adam; default true): false uses the moments without dividing
  /// by 1 - beta^t (accel::optim::DeepSpeedAdamW / DeepSpeedAdam).
  bool bias_correction = true;
};

/// DeepSpeed's scheduler block, "auto" filled (lr_schedules.py WarmupLR, WarmupDecayLR, WarmupCosineLR).
struct DeepSpeedScheduler {
  std::string type;            ///< "WarmupLR", "WarmupDecayLR" or "WarmupCosineLR"
  double warmup_min_lr = 0.0;  ///< WarmupLR, WarmupDecayLR
  /// WarmupLR, WarmupDecayLR; unset: the optimizer's rate (WarmupLR) or 0.001 (WarmupDecayLR's default).
  std::optional<double> warmup_max_lr;
  /// As written (DeepSpeed then uses max(2, it)); positive.
  std::int64_t warmup_num_steps = 1000;
  bool log_warmup = true;            ///< warmup_type "log" (DeepSpeed's default) or "linear"
  std::int64_t total_num_steps = 0;  ///< WarmupDecayLR, WarmupCosineLR
  double warmup_min_ratio = 0.0;     ///< WarmupCosineLR
  double cos_min_ratio = 0.0001;     ///< WarmupCosineLR
};

/// A DeepSpeed JSON as HF's Trainer leaves it.
struct DeepSpeedTrainerConfig {
  /// The file (Config::zero.config_file).
  std::string file;
  /// The keys the Trainer fills or checks (Config::zero.trainer_keys), "auto" filled, as JSON text.
  std::string filled;
  /// One line per mismatch, in HF's order: "KEY=VALUE (FILE) vs TrainingArguments NAME=VALUE".
  std::vector<std::string> mismatches;
  /// The DeepSpeed keys that mismatch, in the same order ("optimizer.params.lr").
  std::vector<std::string> mismatched_keys;
  std::optional<DeepSpeedOptimizer> optimizer;
  std::optional<DeepSpeedScheduler> scheduler;
};

/// Fills and checks the DeepSpeed JSON keys of `config` (Config::zero.trainer_keys) against `args`, as HF's
/// trainer_config_process + trainer_config_finalize do. With `throw_on_mismatch`, any mismatch is a
/// ConfigError that lists them all, naming the file, each key, both values and the fix. An unsupported
/// optimizer or scheduler type or parameter is a ConfigError naming it. Without a JSON file: nothing set.
DeepSpeedTrainerConfig deepspeed_trainer_config(const Config& config, const DeepSpeedTrainerArgs& args,
                                                bool throw_on_mismatch = true);

/// Whether the DeepSpeed JSON of `config` sets `key` ("gradient_accumulation_steps", "bf16.enabled") to a
/// value other than "auto" (HF then checks it against TrainingArguments rather than filling it).
bool deepspeed_trainer_sets(const Config& config, const std::string& key);

/// The learning rate DeepSpeed's `schedule` gives after `steps` scheduler steps (its last_batch_iteration
/// is steps - 1; DeepSpeed sets the rate of the first step, last_batch_iteration -1, when constructed), for
/// an optimizer whose rate was `optimizer_lr` when the schedule was built.
double deepspeed_schedule_lr(const DeepSpeedScheduler& schedule, double optimizer_lr, std::int64_t steps);

}  // namespace accel
