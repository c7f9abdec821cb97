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
