#pragma once
/// \file callbacks.hpp
/// The Trainer's state and events, as Hugging Face's: `TrainerState` (written as `trainer_state.json` in
/// every checkpoint), `TrainerControl` (what a callback asks the Trainer to do next) and `TrainerCallback`
/// with HF's event set, plus the built-in `EarlyStoppingCallback` and `ThroughputMonitor`. Torch-free.

#include <accel/trainer/training_arguments.hpp>

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace accel {

/// One entry of the log history: {"loss": 0.41, "learning_rate": 3e-4, "epoch": 0.5, "step": 100}.
using LogEntry = std::map<std::string, double>;

/// HF's TrainerState: what `trainer_state.json` holds. The same on every rank.
struct TrainerState {
  double epoch = 0;              ///< epochs done, fractional
  std::int64_t global_step = 0;  ///< optimizer steps done (skipped ones included)
  std::int64_t max_steps = 0;
  std::int64_t logging_steps = 500;
  std::int64_t eval_steps = 500;
  std::int64_t save_steps = 500;
  std::int64_t train_batch_size = 0;  ///< per rank
  double num_train_epochs = 0;
  std::int64_t num_input_tokens_seen = 0;
  std::int64_t num_samples_seen = 0;  ///< accelerate-cpp: training samples over all ranks
  std::int64_t skipped_steps = 0;     ///< accelerate-cpp: steps whose update a non-finite loss dropped
  std::optional<double> best_metric;
  std::optional<std::int64_t> best_global_step;
  std::optional<std::string> best_model_checkpoint;
  std::vector<LogEntry> log_history;
  bool is_local_process_zero = true;
  bool is_world_process_zero = true;
  /// Per callback name, its saved attributes (HF's `stateful_callbacks`).
  std::map<std::string, std::map<std::string, double>> stateful_callbacks;

  /// HF's trainer_state.json text.
  std::string to_json() const;
  /// Reads trainer_state.json; `source` names it in errors.
  static TrainerState from_json(const std::string& text, const std::string& source);
};

/// What the Trainer does at the next decision point; callbacks set it (HF's TrainerControl).
struct TrainerControl {
  bool should_training_stop = false;
  bool should_epoch_stop = false;
  bool should_save = false;
  bool should_evaluate = false;
  bool should_log = false;
};

/// HF's TrainerCallback events. Every rank runs every callback, so a decision taken from the (rank-agreed)
/// state and metrics is the same everywhere; a callback that decides from rank-local data must agree first.
class TrainerCallback {
 public:
  virtual ~TrainerCallback() = default;
  /// Its key in trainer_state.json's stateful_callbacks.
  virtual std::string name() const = 0;
  virtual void on_train_begin(const TrainingArguments&, TrainerState&, TrainerControl&) {}
  virtual void on_train_end(const TrainingArguments&, TrainerState&, TrainerControl&) {}
  virtual void on_epoch_begin(const TrainingArguments&, TrainerState&, TrainerControl&) {}
  virtual void on_epoch_end(const TrainingArguments&, TrainerState&, TrainerControl&) {}
  virtual void on_step_begin(const TrainingArguments&, TrainerState&, TrainerControl&) {}
  /// After each micro-batch that did not end an accumulation window.
  virtual void on_substep_end(const TrainingArguments&, TrainerState&, TrainerControl&) {}
  /// After clipping, before optimizer.step().
  virtual void on_pre_optimizer_step(const TrainingArguments&, TrainerState&, TrainerControl&) {}
  virtual void on_optimizer_step(const TrainingArguments&, TrainerState&, TrainerControl&) {}
  virtual void on_step_end(const TrainingArguments&, TrainerState&, TrainerControl&) {}
  virtual void on_evaluate(const TrainingArguments&, TrainerState&, TrainerControl&,
                           const std::map<std::string, double>& metrics) {}
  virtual void on_save(const TrainingArguments&, TrainerState&, TrainerControl&) {}
  /// `logs` may be extended (the ThroughputMonitor adds its figures) before trackers see them.
  virtual void on_log(const TrainingArguments&, TrainerState&, TrainerControl&, LogEntry& logs) {}
  /// Saved in every checkpoint and restored on resume.
  virtual std::map<std::string, double> attributes() const { return {}; }
  virtual void load_attributes(const std::map<std::string, double>&) {}
};

/// HF's EarlyStoppingCallback: stops training after `patience` evaluations in a row whose
/// metric_for_best_model did not improve on the best by more than `threshold`. Needs
/// load_best_model_at_end, metric_for_best_model and an eval_strategy (as HF asserts). Metrics come from
/// gather_for_metrics, identical on every rank, so every rank stops at the same step.
class EarlyStoppingCallback : public TrainerCallback {
 public:
  explicit EarlyStoppingCallback(int patience = 1, double threshold = 0.0);
  std::string name() const override { return "EarlyStoppingCallback"; }
  void on_train_begin(const TrainingArguments& args, TrainerState&, TrainerControl&) override;
  void on_evaluate(const TrainingArguments& args, TrainerState& state, TrainerControl& control,
                   const std::map<std::string, double>& metrics) override;
  std::map<std::string, double> attributes() const override;
  void load_attributes(const std::map<std::string, double>& a) override;
  int patience_counter() const noexcept { return counter_; }

 private:
  int patience_;
  double threshold_;
  int counter_ = 0;
};

/// Lightning's ThroughputMonitor: adds samples/s (and tokens/s) over the logging interval, and model FLOPs
/// utilisation against the peak the user gives, to every log entry ("throughput/..." keys).
class ThroughputMonitor : public TrainerCallback {
 public:
  /// `flops_per_sample`: forward + backward FLOPs of one sample (about 6 x parameters x tokens for a
  /// transformer); `peak_flops_per_device`: the device's peak FLOP/s in the training precision.
  /// `world_size`: ranks that share the samples.
  ThroughputMonitor(double flops_per_sample, double peak_flops_per_device, int world_size);
  std::string name() const override { return "ThroughputMonitor"; }
  void on_train_begin(const TrainingArguments&, TrainerState& state, TrainerControl&) override;
  void on_log(const TrainingArguments&, TrainerState& state, TrainerControl&, LogEntry& logs) override;

 private:
  double flops_per_sample_;
  double peak_;
  int world_;
  double last_time_ = 0;
  std::int64_t last_samples_ = 0;
  std::int64_t last_tokens_ = 0;
};

/// HF's checkpoint rotation: of `checkpoints` (directories, sorted oldest first), those to delete so that
/// `limit` remain, never the best (kept as if it were the second newest); with limit 1 and a best that is
/// not the newest, two remain.
std::vector<std::string> checkpoints_to_delete(std::vector<std::string> checkpoints, int limit,
                                               const std::optional<std::string>& best);

}  // namespace accel
