// Learning-rate schedules (transformers' warmup schedules, PyTorch's OneCycleLR and ReduceLROnPlateau).
#include <accel/errors.hpp>
#include <accel/optim/schedulers.hpp>

#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>

namespace accel::sched {
namespace {

void set_rates(torch::optim::Optimizer& optimizer, const std::vector<double>& rates) {
  auto& groups = optimizer.param_groups();
  for (std::size_t g = 0; g < groups.size(); ++g)
    groups[g].options().set_lr(rates.at(g));
}

std::vector<double> rates_of(torch::optim::Optimizer& optimizer) {
  std::vector<double> out;
  for (auto& group : optimizer.param_groups())
    out.push_back(group.options().get_lr());
  return out;
}

double warmup_factor(std::int64_t step, std::int64_t warmup) {
  return static_cast<double>(step) / static_cast<double>(std::max<std::int64_t>(1, warmup));
}

void check_steps(const char* what, std::int64_t warmup, std::int64_t total) {
  if (warmup < 0 || total < 0) {
    throw UsageError(
        fmt::format("{}: warmup ({}) and total ({}) steps must not be negative", what, warmup, total));
  }
}

constexpr double kPi = 3.14159265358979323846;

}  // namespace

// --- Schedule ---------------------------------------------------------------------------------------------

Schedule::Schedule(torch::optim::Optimizer& optimizer, std::function<double(std::int64_t)> factor)
    : GatedSchedule(optimizer),
      optimizer_(optimizer),
      base_(rates_of(optimizer)),
      factor_(std::move(factor)) {
  std::vector<double> rates;
  for (double base : base_)
    rates.push_back(base * factor_(0));
  set_rates(optimizer_, rates);  // the rate of step 0, as PyTorch's LambdaLR sets it when constructed
}

std::vector<double> Schedule::get_lrs() {
  // Called by LRScheduler::step before it counts the step: the rates of the next one.
  std::vector<double> out;
  const double f = factor_(static_cast<std::int64_t>(step_count_) + 1);
  for (double base : base_)
    out.push_back(base * f);
  return out;
}

std::unique_ptr<Schedule> constant_with_warmup(torch::optim::Optimizer& optimizer, std::int64_t warmup) {
  check_steps("constant_with_warmup", warmup, 0);
  return std::make_unique<Schedule>(
      optimizer, [warmup](std::int64_t s) { return s < warmup ? warmup_factor(s, warmup) : 1.0; });
}

std::unique_ptr<Schedule> linear_with_warmup(torch::optim::Optimizer& optimizer, std::int64_t warmup,
                                             std::int64_t total) {
  check_steps("linear_with_warmup", warmup, total);
  return std::make_unique<Schedule>(optimizer, [warmup, total](std::int64_t s) {
    if (s < warmup) return warmup_factor(s, warmup);
    return std::max(
        0.0, static_cast<double>(total - s) / static_cast<double>(std::max<std::int64_t>(1, total - warmup)));
  });
}

std::unique_ptr<Schedule> cosine_with_warmup(torch::optim::Optimizer& optimizer, std::int64_t warmup,
                                             std::int64_t total, double cycles) {
  check_steps("cosine_with_warmup", warmup, total);
  return std::make_unique<Schedule>(optimizer, [warmup, total, cycles](std::int64_t s) {
    if (s < warmup) return warmup_factor(s, warmup);
    const double progress =
        static_cast<double>(s - warmup) / static_cast<double>(std::max<std::int64_t>(1, total - warmup));
    return std::max(0.0, 0.5 * (1.0 + std::cos(kPi * cycles * 2.0 * progress)));
  });
}

std::unique_ptr<Schedule> cosine_with_min_lr(torch::optim::Optimizer& optimizer, std::int64_t warmup,
                                             std::int64_t total, std::optional<double> min_lr,
                                             std::optional<double> min_lr_rate, double cycles) {
  check_steps("cosine_with_min_lr", warmup, total);
  if (min_lr.has_value() == min_lr_rate.has_value())
    throw UsageError(min_lr ? "cosine_with_min_lr: give min_lr or min_lr_rate, not both"
                            : "cosine_with_min_lr: give min_lr or min_lr_rate (the rate the cosine ends at)");
  // transformers: min_lr_rate = min_lr / optimizer.defaults["lr"].
  const double rate = min_lr_rate ? *min_lr_rate : *min_lr / optimizer.defaults().get_lr();
  return std::make_unique<Schedule>(optimizer, [warmup, total, cycles, rate](std::int64_t s) {
    if (s < warmup) return warmup_factor(s, warmup);
    const double progress =
        static_cast<double>(s - warmup) / static_cast<double>(std::max<std::int64_t>(1, total - warmup));
    const double factor = 0.5 * (1.0 + std::cos(kPi * cycles * 2.0 * progress));
    return std::max(0.0, factor * (1 - rate) + rate);
  });
}

std::unique_ptr<Schedule> polynomial_with_warmup(torch::optim::Optimizer& optimizer, std::int64_t warmup,
                                                 std::int64_t total, double lr_end, double power) {
  check_steps("polynomial_with_warmup", warmup, total);
  const double lr_init = optimizer.param_groups().at(0).options().get_lr();
  if (!(lr_init > lr_end)) {
    throw UsageError(fmt::format(
        "polynomial_with_warmup: lr_end ({}) must be smaller than the initial rate ({})", lr_end, lr_init));
  }
  return std::make_unique<Schedule>(optimizer, [=](std::int64_t s) {
    if (s < warmup) return warmup_factor(s, warmup);
    if (s > total) return lr_end / lr_init;
    const double remaining = 1.0 - static_cast<double>(s - warmup) /
                                       static_cast<double>(std::max<std::int64_t>(1, total - warmup));
    return ((lr_init - lr_end) * std::pow(remaining, power) + lr_end) / lr_init;
  });
}

// --- OneCycleLR -------------------------------------------------------------------------------------------

OneCycleLR::OneCycleLR(torch::optim::Optimizer& optimizer, OneCycleOptions options)
    : GatedSchedule(optimizer), optimizer_(optimizer), o_(options) {
  if (o_.total_steps <= 0)
    throw UsageError(fmt::format("OneCycleLR: total_steps ({}) must be positive", o_.total_steps));
  if (!(o_.pct_start >= 0 && o_.pct_start <= 1)) {
    throw UsageError(fmt::format("OneCycleLR: pct_start ({}) must be in [0, 1]", o_.pct_start));
  }
  if (o_.cycle_momentum) {
    for (auto& group : optimizer_.param_groups()) {
      auto& opts = group.options();
      const bool sgd_momentum = dynamic_cast<torch::optim::SGDOptions*>(&opts) != nullptr;
      const bool adam = dynamic_cast<torch::optim::AdamOptions*>(&opts) != nullptr ||
                        dynamic_cast<torch::optim::AdamWOptions*>(&opts) != nullptr;
      if (!sgd_momentum && !adam) {
        throw UsageError(
            "OneCycleLR: cycle_momentum needs SGD (momentum) or Adam/AdamW (beta1); set cycle_momentum = "
            "false");
      }
    }
  }
  const auto [lr, momentum] = at(0);
  set_rates(optimizer_, std::vector<double>(optimizer_.param_groups().size(), lr));
  if (o_.cycle_momentum) set_momentum(momentum);
}

double OneCycleLR::anneal(double start, double end, double pct) const {
  if (o_.cos_anneal) return end + (start - end) / 2.0 * (std::cos(kPi * pct) + 1.0);
  return (end - start) * pct + start;
}

std::pair<double, double> OneCycleLR::at(std::int64_t step) const {
  const double initial = o_.max_lr / o_.div_factor;
  const double min_lr = initial / o_.final_div_factor;
  const double total = static_cast<double>(o_.total_steps);
  struct Phase {
    double end_step, start_lr, end_lr, start_m, end_m;
  };
  const Phase three[] = {
      {o_.pct_start * total - 1, initial, o_.max_lr, o_.max_momentum, o_.base_momentum},
      {2 * o_.pct_start * total - 2, o_.max_lr, initial, o_.base_momentum, o_.max_momentum},
      {total - 1, initial, min_lr, o_.max_momentum, o_.max_momentum}};
  const Phase two[] = {{o_.pct_start * total - 1, initial, o_.max_lr, o_.max_momentum, o_.base_momentum},
                       {total - 1, o_.max_lr, min_lr, o_.base_momentum, o_.max_momentum}};
  const Phase* phases = o_.three_phase ? three : two;
  const std::size_t count = o_.three_phase ? 3 : 2;
  double start_step = 0;
  for (std::size_t i = 0; i < count; ++i) {
    const Phase& p = phases[i];
    if (static_cast<double>(step) <= p.end_step || i + 1 == count) {
      const double pct = (static_cast<double>(step) - start_step) / (p.end_step - start_step);
      return {anneal(p.start_lr, p.end_lr, pct), anneal(p.start_m, p.end_m, pct)};
    }
    start_step = p.end_step;
  }
  return {min_lr, o_.max_momentum};
}

void OneCycleLR::set_momentum(double momentum) {
  for (auto& group : optimizer_.param_groups()) {
    auto& opts = group.options();
    if (auto* sgd = dynamic_cast<torch::optim::SGDOptions*>(&opts)) {
      sgd->momentum(momentum);
    } else if (auto* adam = dynamic_cast<torch::optim::AdamOptions*>(&opts)) {
      adam->betas({momentum, std::get<1>(adam->betas())});
    } else if (auto* adamw = dynamic_cast<torch::optim::AdamWOptions*>(&opts)) {
      adamw->betas({momentum, std::get<1>(adamw->betas())});
    }
  }
}

void OneCycleLR::before_step() {
  if (static_cast<std::int64_t>(step_count_) + 1 > o_.total_steps) {
    throw UsageError(
        fmt::format("OneCycleLR: stepped {} times, but total_steps is {}; set total_steps to the "
                    "number of optimizer steps of the run",
                    step_count_ + 1, o_.total_steps));
  }
}

void OneCycleLR::after_step() {
  if (o_.cycle_momentum) set_momentum(at(static_cast<std::int64_t>(step_count_)).second);
}

std::vector<double> OneCycleLR::get_lrs() {
  return std::vector<double>(optimizer_.param_groups().size(),
                             at(static_cast<std::int64_t>(step_count_) + 1).first);
}

// --- ReduceLROnPlateau ------------------------------------------------------------------------------------

ReduceLROnPlateau::ReduceLROnPlateau(torch::optim::Optimizer& optimizer, PlateauOptions options)
    : LRScheduler(optimizer),
      optimizer_(optimizer),
      o_(options),
      best_(options.minimize ? std::numeric_limits<double>::infinity()
                             : -std::numeric_limits<double>::infinity()) {
  if (!(o_.factor < 1.0) || !(o_.factor >= 0)) {
    throw UsageError(fmt::format("ReduceLROnPlateau: factor ({}) must be in [0, 1)", o_.factor));
  }
}

bool ReduceLROnPlateau::better(double metric) const {
  if (o_.minimize) {
    return o_.relative_threshold ? metric < best_ * (1.0 - o_.threshold) : metric < best_ - o_.threshold;
  }
  return o_.relative_threshold ? metric > best_ * (1.0 + o_.threshold) : metric > best_ + o_.threshold;
}

void ReduceLROnPlateau::step(double metric) {
  ++evaluations_;
  if (better(metric)) {
    best_ = metric;
    bad_ = 0;
  } else {
    ++bad_;
  }
  if (cooldown_left_ > 0) {
    --cooldown_left_;
    bad_ = 0;  // ignore bad evaluations in cooldown, as PyTorch does
  }
  if (bad_ > o_.patience) {
    std::vector<double> rates = rates_of(optimizer_);
    for (double& rate : rates) {
      const double reduced = std::max(rate * o_.factor, o_.min_lr);
      if (rate - reduced > o_.eps) rate = reduced;
    }
    set_rates(optimizer_, rates);
    cooldown_left_ = o_.cooldown;
    bad_ = 0;
  }
  ++step_count_;
}

std::vector<double> ReduceLROnPlateau::get_lrs() {
  return rates_of(optimizer_);
}

std::vector<double> ReduceLROnPlateau::schedule_state() const {
  return {best_, static_cast<double>(bad_), static_cast<double>(cooldown_left_),
          static_cast<double>(evaluations_)};
}

void ReduceLROnPlateau::load_schedule_state(const std::vector<double>& state) {
  if (state.size() != 4) {
    throw CheckpointError(
        fmt::format("ReduceLROnPlateau: the checkpoint holds {} state values, want 4", state.size()));
  }
  best_ = state[0];
  bad_ = static_cast<std::int64_t>(state[1]);
  cooldown_left_ = static_cast<std::int64_t>(state[2]);
  evaluations_ = static_cast<std::int64_t>(state[3]);
}

}  // namespace accel::sched
