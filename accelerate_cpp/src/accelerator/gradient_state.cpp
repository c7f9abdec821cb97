#include <accel/accelerator/gradient_state.hpp>
#include <accel/errors.hpp>

#include <fmt/format.h>

namespace accel {

GradientState::GradientState(int accumulation_steps) : steps_(accumulation_steps) {
  if (accumulation_steps < 1) {
    throw UsageError(
        fmt::format("gradient_accumulation_steps is {}; it must be at least 1", accumulation_steps));
  }
}

void GradientState::open_scope() noexcept {
  scope_serial_ += 1;
  scope_depth_ += 1;
}

void GradientState::close_scope() noexcept {
  if (scope_depth_ > 0) scope_depth_ -= 1;
}

bool GradientState::begin_backward(bool end_of_data, std::size_t optimizers) {
  bool new_micro_step = true;
  if (scope_depth_ > 0) {
    new_micro_step = !in_micro_step_ || scope_serial_ != last_scope_;
  } else if (*batch_clock_ > 0) {
    new_micro_step = !in_micro_step_ || *batch_clock_ != last_clock_;
  } else if (steps_ > 1 && optimizers > 1) {
    throw UsageError(fmt::format(
        "backward: gradient_accumulation_steps is {} and {} optimizers are prepared, but the batches come "
        "from no prepared data loader, so backward() cannot tell which calls belong to one batch (a GAN "
        "calls it twice per batch); open `auto batch = accelerator.accumulate(model);` at the top of each "
        "batch, or iterate a loader from accelerator.prepare_data_loader()",
        steps_, optimizers));
  }
  last_scope_ = scope_serial_;
  last_clock_ = *batch_clock_;
  if (!new_micro_step) return false;
  in_micro_step_ = true;
  if (cycle_done_) cycle_position_ = 0;
  cycle_position_ += 1;
  micro_steps_ += 1;
  step_counted_ = false;
  sync_gradients_ = cycle_position_ >= steps_ || end_of_data;
  cycle_done_ = sync_gradients_;
  return true;
}

void GradientState::count_step() noexcept {
  if (step_counted_) return;
  completed_steps_ += 1;
  step_counted_ = true;
}

void GradientState::pipeline_step(std::int64_t micro_batches, bool stepped) noexcept {
  sync_gradients_ = true;
  if (stepped) completed_steps_ += 1;
  micro_steps_ += micro_batches;
}

GradientCounters GradientState::counters() const noexcept {
  GradientCounters c;
  c.micro_steps = micro_steps_;
  c.cycle_position = cycle_done_ ? 0 : cycle_position_;
  c.completed_steps = completed_steps_;
  return c;
}

void GradientState::restore(const GradientCounters& counters) noexcept {
  micro_steps_ = counters.micro_steps;
  cycle_position_ = counters.cycle_position;
  completed_steps_ = counters.completed_steps;
  cycle_done_ = false;
  in_micro_step_ = false;
}

}  // namespace accel
