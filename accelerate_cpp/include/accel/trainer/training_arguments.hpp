#pragma once
/// \file training_arguments.hpp
/// `accel::TrainingArguments`: the Trainer's settings, with Hugging Face's `TrainingArguments` names,
/// defaults and rules. Read from a YAML or JSON file (the `training_args.json` HF writes loads as is) and
/// overridden from the command line (`--learning_rate 3e-4`, `--bf16`), validated with errors that name the
/// file, line, key and value. Torch-free.
///
///   auto args = accel::TrainingArguments::from_command_line(argc, argv);  // --training_args run.yaml --seed
///   1 accel::Trainer trainer(args, model, train_set, compute_loss);
///
/// Keys of HF's TrainingArguments that this Trainer does not implement are accepted while they hold HF's
/// default (or null), ignored when they only concern the Hugging Face Hub or Python, and otherwise refused
/// with an error that says what to do (see unsupported_training_keys()).

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace accel {

/// One key of a TrainingArguments file (name, HF meaning, default), for documentation and `--help`.
struct TrainingKey {
  std::string name;
  std::string default_value;  ///< as written in YAML; "null" for none
  std::string doc;
};

/// HF's TrainingArguments, the keys accel::Trainer implements. Steps given below 1 (logging/eval/save) are a
/// ratio of the total number of optimizer steps, as in HF.
struct TrainingArguments {
  std::string output_dir = "trainer_output";
  bool overwrite_output_dir = false;
  double num_train_epochs = 3.0;
  std::int64_t max_steps = -1;  ///< > 0 overrides num_train_epochs
  std::int64_t per_device_train_batch_size = 8;
  std::int64_t per_device_eval_batch_size = 8;
  double learning_rate = 5e-5;
  double weight_decay = 0.0;  ///< not applied to biases and LayerNorm weights, as HF
  double adam_beta1 = 0.9;
  double adam_beta2 = 0.999;
  double adam_epsilon = 1e-8;
  /// adamw_torch | adamw_torch_fused (accel::optim::AdamW, ATen's fused kernel) | adamw_bnb_8bit | adamw_8bit
  /// | paged_adamw_8bit | paged_adamw_32bit (accel::optim::AdamW8bit: bitsandbytes' AdamW; paging has no
  /// meaning on a CPU) | sgd | lamb
  std::string optim = "adamw_torch";
  /// linear | cosine | cosine_with_min_lr | constant | constant_with_warmup | polynomial
  std::string lr_scheduler_type = "linear";
  /// HF's lr_scheduler_kwargs, the schedule's own arguments: cosine: num_cycles; cosine_with_min_lr: min_lr
  /// or min_lr_rate (one of them, as transformers requires), num_cycles; polynomial: lr_end, power.
  std::map<std::string, double> lr_scheduler_kwargs;
  std::int64_t warmup_steps = 0;  ///< > 0 wins over warmup_ratio
  double warmup_ratio = 0.0;
  int gradient_accumulation_steps = 1;
  /// HF's average_tokens_across_devices (transformers 5's default true): a loss summed over label tokens
  /// (Trainer::set_num_items) is divided by the accumulation window's label tokens of every rank; false: by
  /// each rank's own, the ranks' gradients then averaged (other numbers on 2 or more ranks, as HF's).
  bool average_tokens_across_devices = true;
  double max_grad_norm = 1.0;  ///< 0 disables clipping
  bool bf16 = false;
  bool fp16 = false;
  bool gradient_checkpointing = false;
  /// HF's gradient_checkpointing_kwargs (torch.utils.checkpoint's keyword arguments): use_reentrant (true
  /// and false give the same gradients here: one recomputing autograd node, docs/trainer.md) and
  /// preserve_rng_state (default true).
  std::map<std::string, bool> gradient_checkpointing_kwargs;
  std::string logging_dir;                 ///< where trackers write; default output_dir/runs
  std::string logging_strategy = "steps";  ///< no | steps | epoch
  double logging_steps = 500;
  bool logging_first_step = false;
  bool logging_nan_inf_filter = true;   ///< a non-finite loss is left out of the logged mean
  std::string eval_strategy = "no";     ///< no | steps | epoch
  std::optional<double> eval_steps;     ///< default: logging_steps
  std::string save_strategy = "steps";  ///< no | steps | epoch
  double save_steps = 500;
  std::optional<int> save_total_limit;  ///< keep this many newest checkpoints (plus the best); null keeps all
  bool save_only_model = false;         ///< checkpoints hold the model only (no resume from them)
  bool load_best_model_at_end = false;
  std::optional<std::string> metric_for_best_model;  ///< default "loss" with load_best_model_at_end
  std::optional<bool> greater_is_better;             ///< default: false for a loss, true otherwise
  std::vector<std::string> report_to{"none"};        ///< tensorboard | jsonl | csv | all | none
  std::optional<std::string> run_name;
  std::uint64_t seed = 42;
  std::optional<std::uint64_t> data_seed;             ///< shuffling seed; default seed
  std::optional<std::string> resume_from_checkpoint;  ///< a checkpoint directory, or "latest"
  int dataloader_num_workers = 0;
  bool dataloader_drop_last = false;
  bool dataloader_pin_memory = true;  ///< batches built in page-locked memory when training on a GPU
  bool disable_tqdm = false;
  /// accelerate-cpp: what a non-finite loss does, decided alike on every rank: "skip" drops the update of
  /// that accumulation window (the step still counts), "stop" ends training with an error naming the ranks.
  std::string nonfinite_loss = "skip";

  /// Reads a YAML or JSON file (HF's training_args.json as written by `TrainingArguments.to_json_string`).
  /// Unknown keys are ConfigErrors naming the file, line and the closest known key.
  static TrainingArguments load_file(const std::string& path);
  static TrainingArguments load_string(const std::string& text, const std::string& source = "<string>");
  /// `[--training_args FILE] [--key value | --key=value | --bool_key]...`: the file first, then the
  /// overrides in order. Arguments that are not TrainingArguments keys go to `remaining` when it is given
  /// (an argument one typo away from a key is still an error); without it they are errors.
  static TrainingArguments from_command_line(int argc, const char* const* argv,
                                             std::vector<std::string>* remaining = nullptr);
  /// Sets one key from its text as written in a file or on the command line ("3e-4", "true", "[a, b]").
  void set(const std::string& key, const std::string& value, const std::string& source = "command line");
  /// HF's __post_init__ rules: throws ConfigError naming the key and value. Fills the defaults that depend
  /// on other keys (metric_for_best_model, greater_is_better, eval_steps, logging_dir).
  void validate();
  /// As YAML (every key), readable by load_string.
  std::string to_yaml() const;
  /// As HF's JSON (`training_args.json`), every key this struct has.
  std::string to_json() const;

  /// Where the keys came from ("run.yaml", "command line"), for messages.
  std::string source;
  /// Keys of HF's TrainingArguments read from the file and ignored (Hub, Python-only settings).
  std::vector<std::string> notices;
  /// Keys set by the file or the command line (others hold defaults): a Trainer compares only those with the
  /// Accelerate config.
  std::vector<std::string> explicit_keys;
  bool is_explicit(const std::string& key) const;

  /// The keys this struct reads, with defaults and one-line docs.
  static const std::vector<TrainingKey>& keys();
};

/// A key of HF's TrainingArguments that accel::Trainer does not implement: accepted while it holds
/// `accepted_when` (HF's default), else refused with `instead`. `ignored`: it never changes training (Hub
/// upload, Python logging), so any value is accepted with a notice.
struct UnsupportedTrainingKey {
  std::string name;
  std::string accepted_when;
  bool ignored = false;
  std::string instead;
};
const std::vector<UnsupportedTrainingKey>& unsupported_training_keys();

}  // namespace accel
