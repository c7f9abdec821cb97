#pragma once
/// \file gradient_state.hpp
/// The accumulation clock of an `Accelerator` (Hugging Face Accelerate's `GradientState`): which `backward`
/// calls belong to one micro-step (a batch), where that micro-step stands in its accumulation cycle, whether
/// it synchronises gradients, and the step counters that checkpoints save. Torch-free: every rule of "a
/// micro-step is a batch, never a backward call" lives here and is unit-tested on its own.

#include <cstddef>
#include <cstdint>
#include <memory>

namespace accel {

/// Where a checkpoint puts the clock: what `save_state` writes and `load_state` restores.
struct GradientCounters {
  std::int64_t micro_steps = 0;      ///< micro-steps (batches) that ran a backward
  std::int64_t cycle_position = 0;   ///< micro-steps into the open accumulation cycle (0: none open)
  std::int64_t completed_steps = 0;  ///< optimizer steps taken (sync micro-steps not skipped)
};

/// The accumulation clock. One per Accelerator; not thread-safe.
///
/// A micro-step is, in this order of precedence: an `Accelerator::accumulate()` scope; else what a prepared
/// data loader yielded since the last backward (the loaders advance `batch_clock()`); else one backward call.
/// Gradients synchronise on the last micro-step of each cycle of `accumulation_steps` and at the end of a
/// loader's epoch.
class GradientState {
 public:
  /// `accumulation_steps` >= 1 (`gradient_accumulation_steps`).
  explicit GradientState(int accumulation_steps = 1);

  int accumulation_steps() const noexcept { return steps_; }
  /// The counter that prepared data loaders advance each time one yields a batch (shared with them).
  const std::shared_ptr<std::uint64_t>& batch_clock() const noexcept { return batch_clock_; }

  /// An `accumulate()` scope opens: every backward until it closes is one micro-step.
  void open_scope() noexcept;
  /// The innermost open scope closes.
  void close_scope() noexcept;

  /// Called at the start of every backward. `end_of_data`: the active loader has just yielded the last batch
  /// of its epoch. `optimizers`: how many are prepared. Returns true when this backward starts a new
  /// micro-step (then `sync_gradients()` is decided anew and the step is not yet counted). UsageError when
  /// accumulation needs batch boundaries that nothing gives (several optimizers, no loader, no scope).
  bool begin_backward(bool end_of_data, std::size_t optimizers);
  /// True when the current micro-step ends an accumulation cycle: gradients are reduced and optimizers step.
  bool sync_gradients() const noexcept { return sync_gradients_; }
  /// Counts the current micro-step's optimizer step (once, however many backward calls it makes).
  void count_step() noexcept;
  /// A pipeline step: one whole cycle of `micro_batches` at once, always synchronising; `stepped`: an
  /// optimizer step was taken (not skipped).
  void pipeline_step(std::int64_t micro_batches, bool stepped) noexcept;

  std::int64_t micro_steps() const noexcept { return micro_steps_; }
  std::int64_t completed_steps() const noexcept { return completed_steps_; }
  /// What a checkpoint saves: a cycle that just synced counts as closed (position 0).
  GradientCounters counters() const noexcept;
  /// Continues from a checkpoint's counters: the next backward starts a new micro-step.
  void restore(const GradientCounters& counters) noexcept;

 private:
  int steps_;
  std::shared_ptr<std::uint64_t> batch_clock_ = std::make_shared<std::uint64_t>(0);
  bool sync_gradients_ = true;
  std::int64_t micro_steps_ = 0;
  std::int64_t cycle_position_ = 0;  // micro-steps into the current accumulation cycle
  bool cycle_done_ = false;          // the current micro-step synced: the next one starts a new cycle
  bool in_micro_step_ = false;       // a backward ran in the current micro-step
  std::uint64_t scope_serial_ = 0;   // accumulate() scopes opened so far
  int scope_depth_ = 0;
  std::uint64_t last_scope_ = 0;  // scope_serial_ at the last backward
  std::uint64_t last_clock_ = 0;  // *batch_clock_ at the last backward
  std::int64_t completed_steps_ = 0;
  bool step_counted_ = false;  // completed_steps_ already counts the current micro-step
};

}  // namespace accel
