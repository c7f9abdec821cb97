#pragma once
/// \file schedulers.hpp
/// Learning-rate schedules users expect from transformers and PyTorch, as `torch::optim::LRScheduler`
/// subclasses that `Accelerator::prepare` accepts and `save_state` checkpoints: linear, cosine, constant
/// and polynomial decay with warmup (transformers' `get_*_schedule_with_warmup`), `OneCycleLR` and
/// `ReduceLROnPlateau` (PyTorch's). Each sets the learning rate of step 0 when constructed, as PyTorch does.
///
/// Prepared, a schedule steps once per real optimizer step: `step()` does nothing on accumulation
/// micro-steps and after an fp16-skipped step (as Accelerate's AcceleratedScheduler), so the loop calls it
/// after every `optimizer.step()`:
/// \code
///   torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(3e-4));
///   auto sched = accel::sched::cosine_with_warmup(opt, 100, 10000);
///   accelerator.prepare(model, opt, *sched);
///   ... accelerator.backward(loss); opt.step(); sched->step(); opt.zero_grad();
/// \endcode
/// Not prepared, `step()` always steps. LibTorch's own schedulers (StepLR) step whenever called: guard them
/// with `if (accelerator.sync_gradients())`.

#include <torch/optim/optimizer.h>
#include <torch/optim/schedulers/lr_scheduler.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace accel::sched {

/// What `Accelerator::prepare` and `save_state` use of a schedule besides LRScheduler's step count.
class Preparable {
 public:
  virtual ~Preparable() = default;
  /// `step()` then steps only when `gate()` is true (the optimizer really stepped).
  virtual void set_step_gate(std::function<bool()> gate) = 0;
  /// State beyond the step count, saved and restored with checkpoints (empty for pure schedules).
  virtual std::vector<double> schedule_state() const { return {}; }
  virtual void load_schedule_state(const std::vector<double>& /*state*/) {}
};

/// A schedule that steps only when the optimizer really stepped, once prepared (the base of Schedule and
/// OneCycleLR).
class GatedSchedule : public torch::optim::LRScheduler, public Preparable {
 public:
  explicit GatedSchedule(torch::optim::Optimizer& optimizer) : LRScheduler(optimizer) {}
  /// Advances one step and sets the groups' rates, unless a prepared accelerator says the optimizer did not
  /// really step (accumulation micro-step, fp16-skipped step). Hides LRScheduler::step.
  void step() {
    if (gate_ && !gate_()) return;
    before_step();
    LRScheduler::step();
    after_step();
  }
  /// Steps taken (what save_state stores).
  std::int64_t steps() const noexcept { return step_count_; }
  /// The groups' current rates.
  std::vector<double> last_lr() const { return get_current_lrs(); }
  void set_step_gate(std::function<bool()> gate) override { gate_ = std::move(gate); }

 protected:
  virtual void before_step() {}
  virtual void after_step() {}

 private:
  std::function<bool()> gate_;
};

/// A learning-rate schedule: after `k` steps each group's rate is `base_rate * factor(k)` (LambdaLR). The
/// base rates are the groups' rates when constructed.
class Schedule : public GatedSchedule {
 public:
  Schedule(torch::optim::Optimizer& optimizer, std::function<double(std::int64_t step)> factor);

 protected:
  std::vector<double> get_lrs() override;

 private:
  torch::optim::Optimizer& optimizer_;
  std::vector<double> base_;
  std::function<double(std::int64_t)> factor_;
};

/// transformers' get_constant_schedule_with_warmup: rises linearly from 0 over `warmup` steps, then 1.
std::unique_ptr<Schedule> constant_with_warmup(torch::optim::Optimizer& optimizer, std::int64_t warmup);
/// transformers' get_linear_schedule_with_warmup: rises over `warmup` steps, then falls linearly to 0 at
/// `total`.
std::unique_ptr<Schedule> linear_with_warmup(torch::optim::Optimizer& optimizer, std::int64_t warmup,
                                             std::int64_t total);
/// transformers' get_cosine_schedule_with_warmup: rises over `warmup` steps, then follows a cosine to 0 at
/// `total` (`cycles` 0.5: half a cosine wave).
std::unique_ptr<Schedule> cosine_with_warmup(torch::optim::Optimizer& optimizer, std::int64_t warmup,
                                             std::int64_t total, double cycles = 0.5);
/// transformers' get_cosine_with_min_lr_schedule_with_warmup: as cosine_with_warmup, but the cosine ends at
/// `min_lr_rate` times each group's rate instead of 0 (factor `cos * (1 - min_lr_rate) + min_lr_rate`). Give
/// `min_lr_rate`, or `min_lr` (then min_lr_rate = min_lr / the optimizer's default rate, as transformers
/// divides by optimizer.defaults["lr"]), not both: UsageError otherwise.
std::unique_ptr<Schedule> cosine_with_min_lr(torch::optim::Optimizer& optimizer, std::int64_t warmup,
                                             std::int64_t total, std::optional<double> min_lr,
                                             std::optional<double> min_lr_rate, double cycles = 0.5);
/// transformers' get_polynomial_decay_schedule_with_warmup: rises over `warmup` steps, then decays as
/// `(lr - lr_end) * (1 - progress)^power + lr_end` to `lr_end` at `total`, then stays there.
std::unique_ptr<Schedule> polynomial_with_warmup(torch::optim::Optimizer& optimizer, std::int64_t warmup,
                                                 std::int64_t total, double lr_end = 1e-7,
                                                 double power = 1.0);

/// PyTorch's OneCycleLR options (cos annealing, two phases; momentum cycling for SGD's momentum and
/// Adam/AdamW's beta1 when `cycle_momentum`).
struct OneCycleOptions {
  double max_lr = 0.1;
  std::int64_t total_steps = 100;
  double pct_start = 0.3;
  bool cos_anneal = true;  ///< false: linear annealing
  double div_factor = 25.0;
  double final_div_factor = 1e4;
  bool three_phase = false;
  bool cycle_momentum = true;
  double base_momentum = 0.85;
  double max_momentum = 0.95;
};

/// PyTorch's OneCycleLR: from max_lr / div_factor up to max_lr, then down to that / final_div_factor.
/// Stepping beyond total_steps throws UsageError, as PyTorch does.
class OneCycleLR : public GatedSchedule {
 public:
  OneCycleLR(torch::optim::Optimizer& optimizer, OneCycleOptions options);

 protected:
  std::vector<double> get_lrs() override;
  void before_step() override;
  void after_step() override;

 private:
  double anneal(double start, double end, double pct) const;
  std::pair<double, double> at(std::int64_t step) const;  // (lr, momentum)
  void set_momentum(double momentum);

  torch::optim::Optimizer& optimizer_;
  OneCycleOptions o_;
};

/// PyTorch's ReduceLROnPlateau options.
struct PlateauOptions {
  bool minimize = true;  ///< mode "min" (false: "max")
  double factor = 0.1;
  std::int64_t patience = 10;
  double threshold = 1e-4;
  bool relative_threshold = true;  ///< threshold_mode "rel" (false: "abs")
  std::int64_t cooldown = 0;
  double min_lr = 0.0;
  double eps = 1e-8;
};

/// PyTorch's ReduceLROnPlateau, preparable and checkpointed (LibTorch's ReduceLROnPlateauScheduler is
/// neither): `step(metric)` once per evaluation; the rate falls by `factor` after `patience` evaluations
/// without improvement. Prepared, the metric should be the same on every rank (reduce it first).
class ReduceLROnPlateau : public torch::optim::LRScheduler, public Preparable {
 public:
  ReduceLROnPlateau(torch::optim::Optimizer& optimizer, PlateauOptions options = {});
  void step(double metric);
  std::vector<double> last_lr() const { return get_current_lrs(); }
  /// Steps once per evaluation, whatever the optimizer did: no gate.
  void set_step_gate(std::function<bool()> /*gate*/) override {}
  /// Best metric, evaluations without improvement, cooldown left, evaluations seen.
  std::vector<double> schedule_state() const override;
  void load_schedule_state(const std::vector<double>& state) override;

 protected:
  std::vector<double> get_lrs() override;  // the current rates (step(metric) sets them)

 private:
  bool better(double metric) const;

  torch::optim::Optimizer& optimizer_;
  PlateauOptions o_;
  double best_;
  std::int64_t bad_ = 0;
  std::int64_t cooldown_left_ = 0;
  std::int64_t evaluations_ = 0;
};

}  // namespace accel::sched
