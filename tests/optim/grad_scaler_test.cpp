#include <catch2/catch.hpp>

#include "test_support.hpp"

using accel::GradScaler;
using accel::GradScalerOptions;

TEST_CASE("scaler: defaults are init 65536, growth x2 after 2000 clean steps, backoff 0.5") {
  GradScaler s;
  REQUIRE(s.get_scale() == 65536.0);
  for (int i = 0; i < 1999; ++i)
    s.update(false);
  REQUIRE(s.get_scale() == 65536.0);
  s.update(false);
  REQUIRE(s.get_scale() == 131072.0);
  s.update(true);
  REQUIRE(s.get_scale() == 65536.0);
  REQUIRE(s.growth_tracker() == 0);
}

TEST_CASE("scaler: unscale_ divides gradients and detects inf and NaN") {
  GradScaler s(GradScalerOptions().init_scale(8));
  auto p = torch::zeros({3}, torch::requires_grad());
  p.mutable_grad() = torch::tensor({8.0f, 16.0f, -8.0f});
  REQUIRE_FALSE(s.unscale_({p}));
  REQUIRE(torch::equal(p.grad(), torch::tensor({1.0f, 2.0f, -1.0f})));
  for (float bad : {std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()}) {
    p.mutable_grad() = torch::tensor({1.0f, bad, 1.0f});
    REQUIRE(s.unscale_({p}));
  }
}

TEST_CASE("scaler: bad options are rejected with the option's name") {
  REQUIRE_THROWS_WITH(GradScaler(GradScalerOptions().backoff_factor(2)),
                      "GradScaler: backoff_factor must be in (0, 1), got 2");
  REQUIRE_THROWS_WITH(GradScaler(GradScalerOptions().growth_interval(0)),
                      "GradScaler: growth_interval must be >= 1, got 0");
}

TEST_CASE("scaler: state round-trips") {
  GradScaler a(GradScalerOptions().growth_interval(3));
  a.update(true);
  a.update(false);
  GradScaler b;
  b.load_state_dict(a.state_dict());
  REQUIRE(b.get_scale() == a.get_scale());
  REQUIRE(b.growth_tracker() == 1);
}

namespace {

// Runs `pattern` ('.' a clean step, 'x' an overflow) through a scaler with DeepSpeed's fp16 settings and
// returns the scale after each step; -1 where update throws (an overflow at the minimum).
std::vector<double> deepspeed_run(const std::string& pattern, std::int64_t window, std::int64_t hysteresis,
                                  bool consecutive, double minimum, double init) {
  GradScaler s(GradScalerOptions()
                   .init_scale(init)
                   .growth_interval(window)
                   .deepspeed_schedule(true)
                   .hysteresis(hysteresis)
                   .consecutive_hysteresis(consecutive)
                   .min_scale(minimum));
  std::vector<double> out;
  for (char step : pattern) {
    try {
      s.update(step == 'x');
    } catch (const accel::UsageError& e) {
      CHECK_THAT(e.what(), Catch::Contains("already at its minimum"));
      out.push_back(-1);
      break;
    }
    out.push_back(s.get_scale());
  }
  return out;
}

}  // namespace

TEST_CASE("scaler: DeepSpeed's rule gives DeepSpeed's scales (window, hysteresis, minimum)") {
  // Expected values: DeepSpeed's own DynamicLossScaler.update_scale on the same patterns, printed by
  // tests/optim/deepspeed_loss_scaler_golden.py from deepspeed/runtime/fp16/loss_scaler.py (commit
  // edaa72212). First growth after window + 1 clean steps; an overflow absorbed by the hysteresis keeps the
  // scale but restarts the count; the hysteresis refills at a growth (or at every clean step when
  // consecutive).
  CHECK(deepspeed_run("....x.x....x.xx.......", 3, 2, false, 1, 16) ==
        std::vector<double>{16, 16, 16, 32, 32, 32, 16, 16, 16, 16, 32,
                            32, 32, 16, 8,  8,  8,  8,  16, 16, 16, 32});
  CHECK(deepspeed_run("..x.x.x.x...xx.x......", 2, 3, true, 1, 8) ==
        std::vector<double>{8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 16, 16, 16, 16, 16, 16, 16, 32, 32, 64, 64});
  // Halving stops at the minimum; an overflow there stops the run, as DeepSpeed raises.
  CHECK(deepspeed_run("xxxxxxxx", 1, 1, false, 1, 8) == std::vector<double>{4, 2, 1, -1});
  CHECK(deepspeed_run("x.x.x..x.........", 4, 2, false, 2, 4) == std::vector<double>{4, 4, 2, 2, -1});
}

TEST_CASE("scaler: a static scale never changes; the hysteresis left is checkpointed") {
  GradScaler fixed(GradScalerOptions().dynamic(false).init_scale(128));
  for (bool overflow : {true, false, true, true, false})
    fixed.update(overflow);
  CHECK(fixed.get_scale() == 128);
  // An overflow absorbed by the hysteresis is in the state: the resumed scaler halves at the next one.
  auto options = GradScalerOptions().init_scale(64).deepspeed_schedule(true).hysteresis(2).min_scale(1);
  GradScaler a(options);
  a.update(true);
  CHECK(a.get_scale() == 64);
  CHECK(a.hysteresis_left() == 1);
  GradScaler b(options);
  b.load_state_dict(a.state_dict());
  b.update(true);
  CHECK(b.get_scale() == 32);
  // A state written before the hysteresis was saved loads with a full one.
  GradScaler c(options);
  c.load_state_dict(
      {{"scale", torch::tensor({64.0f})}, {"growth_tracker", torch::tensor({0}, torch::kInt32)}});
  CHECK(c.hysteresis_left() == 2);
  REQUIRE_THROWS_WITH(GradScaler(GradScalerOptions().hysteresis(0)),
                      "GradScaler: hysteresis must be >= 1, got 0");
}
