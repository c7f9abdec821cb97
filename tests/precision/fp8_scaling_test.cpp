// The fp8 scaling arithmetic against the recipes' definitions, each expected value computed here from the
// formula (torchao float8_utils.amax_to_scale, the "rowwise" recipe's power-of-two scales, Transformer
// Engine's delayed_scaling.cu) or from the fp8 formats' bit layouts; tests/python/fp8_scaling_check.py
// compares the same functions with torchao's own.
#include "accel/precision/fp8_scaling.hpp"

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <deque>
#include <limits>
#include <random>
#include <stdexcept>
#include <vector>

namespace {

using accel::fp8::Dtype;

// Every finite value of an fp8 format, decoded from its bits: sign, `e` exponent bits (bias 2^(e-1) - 1), `m`
// mantissa bits; exponent 0 is subnormal. E4M3 (float8_e4m3fn) has no infinity and only S.1111.111 is NaN;
// E5M2 follows IEEE (exponent all ones is inf / NaN).
std::vector<double> finite_values(Dtype dtype) {
  const int e_bits = dtype == Dtype::E4M3 ? 4 : 5;
  const int m_bits = dtype == Dtype::E4M3 ? 3 : 2;
  const int bias = (1 << (e_bits - 1)) - 1;
  std::vector<double> out;
  for (int bits = 0; bits < 256; ++bits) {
    const int sign = bits >> 7;
    const int exponent = (bits >> m_bits) & ((1 << e_bits) - 1);
    const int mantissa = bits & ((1 << m_bits) - 1);
    const bool top = exponent == (1 << e_bits) - 1;
    if (dtype == Dtype::E5M2 && top) continue;
    if (dtype == Dtype::E4M3 && top && mantissa == (1 << m_bits) - 1) continue;
    const double fraction = static_cast<double>(mantissa) / (1 << m_bits);
    const double magnitude =
        exponent == 0 ? std::ldexp(fraction, 1 - bias) : std::ldexp(1.0 + fraction, exponent - bias);
    out.push_back(sign ? -magnitude : magnitude);
  }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());  // -0 and +0
  return out;
}

// The distance from x (clamped to +-max) to the nearest value of the format.
double nearest_distance(const std::vector<double>& values, double x) {
  const double clamped = std::min(std::max(x, values.front()), values.back());
  double best = std::numeric_limits<double>::infinity();
  for (const double v : values)
    best = std::min(best, std::fabs(v - clamped));
  return best;
}

}  // namespace

TEST_CASE("fp8 formats: the largest values and the recipe's formats per tensor", "[fp8]") {
  CHECK(accel::fp8::max_value(Dtype::E4M3) == finite_values(Dtype::E4M3).back());
  CHECK(accel::fp8::max_value(Dtype::E5M2) == finite_values(Dtype::E5M2).back());
  CHECK(accel::fp8::max_value(Dtype::E4M3) == 448.0);
  CHECK(accel::fp8::max_value(Dtype::E5M2) == 57344.0);
  using accel::fp8::Format;
  CHECK(accel::fp8::forward_dtype(Format::Hybrid) == Dtype::E4M3);
  CHECK(accel::fp8::backward_dtype(Format::Hybrid) == Dtype::E5M2);
  CHECK(accel::fp8::forward_dtype(Format::E4M3) == Dtype::E4M3);
  CHECK(accel::fp8::backward_dtype(Format::E4M3) == Dtype::E4M3);
  CHECK(accel::fp8::forward_dtype(Format::E5M2) == Dtype::E5M2);
  CHECK(accel::fp8::backward_dtype(Format::E5M2) == Dtype::E5M2);
}

TEST_CASE("fp8 tensor-wise and row-wise scales are max / amax as torchao computes them", "[fp8]") {
  for (const Dtype dtype : {Dtype::E4M3, Dtype::E5M2}) {
    const double max = dtype == Dtype::E4M3 ? 448.0 : 57344.0;
    for (const double amax : {3.5, 1e-3, 0.1, 12345.678, 1e30}) {
      CHECK(accel::fp8::scale_from_amax(amax, dtype) == static_cast<float>(max / amax));
      // Power-of-two rounding: the largest 2^k not above the scale.
      const float rounded = accel::fp8::scale_from_amax(amax, dtype, true);
      const float exact = static_cast<float>(max / amax);
      CHECK(rounded <= exact);
      CHECK(rounded * 2 > exact);
      int exponent = 0;
      CHECK(std::frexp(rounded, &exponent) == 0.5f);
    }
    // amax 0 (an all-zero tensor) is floored at 1e-12.
    CHECK(accel::fp8::scale_from_amax(0.0, dtype) == static_cast<float>(max / 1e-12));
  }
  const std::vector<float> x = {0.25f, -5.0f, 2.0f, 0.0f, -0.5f, 1.5f};
  CHECK(accel::fp8::tensorwise_scale(x.data(), x.size(), Dtype::E4M3) == static_cast<float>(448.0 / 5.0));
  const std::vector<float> rows = accel::fp8::rowwise_scales(x.data(), 2, 3, Dtype::E4M3);
  REQUIRE(rows.size() == 2);
  // Row 0's amax is 5 (448 / 5 = 89.6 -> 64), row 1's is 1.5 (298.67 -> 256).
  CHECK(rows[0] == 64.0f);
  CHECK(rows[1] == 256.0f);
  const std::vector<float> exact_rows = accel::fp8::rowwise_scales(x.data(), 2, 3, Dtype::E5M2, false);
  CHECK(exact_rows[0] == static_cast<float>(57344.0 / 5.0));
  CHECK(exact_rows[1] == static_cast<float>(57344.0 / 1.5));
}

TEST_CASE("fp8 casts round to the nearest value of the format, saturating at its largest", "[fp8]") {
  std::mt19937 gen(7);
  for (const Dtype dtype : {Dtype::E4M3, Dtype::E5M2}) {
    const std::vector<double> values = finite_values(dtype);
    // Every representable value is kept as it is.
    for (const double v : values)
      CHECK(accel::fp8::round_to_fp8(static_cast<float>(v), dtype) == v);
    // Random values over the whole range (subnormals to beyond the largest): the nearest representable one;
    // exact ties are checked below.
    std::uniform_real_distribution<double> exponent(-20, 18), unit(-1, 1);
    for (int i = 0; i < 2000; ++i) {
      const auto x = static_cast<float>(std::copysign(std::exp2(exponent(gen)), unit(gen)));
      const double got = accel::fp8::round_to_fp8(x, dtype);
      const double d_got = std::fabs(got - std::min(std::max<double>(x, values.front()), values.back()));
      INFO(x);
      CHECK(std::find(values.begin(), values.end(), got) != values.end());
      CHECK(d_got == nearest_distance(values, x));
    }
    // A tie between two neighbours goes to the one with the even mantissa.
    const auto zero = static_cast<std::size_t>(std::find(values.begin(), values.end(), 0.0) - values.begin());
    for (std::size_t i = zero; i + 1 < values.size(); ++i) {
      const double mid = (values[i] + values[i + 1]) / 2;
      const double got = accel::fp8::round_to_fp8(static_cast<float>(mid), dtype);
      // Mantissa parity is the parity of the position among the non-negative values (0 has mantissa 0, and
      // each exponent holds an even number of mantissas).
      const double even = (i - zero) % 2 == 0 ? values[i] : values[i + 1];
      INFO(mid);
      CHECK(got == even);
    }
    CHECK(accel::fp8::round_to_fp8(1e9f, dtype) == values.back());
    CHECK(accel::fp8::round_to_fp8(-1e9f, dtype) == values.front());
    CHECK(std::isnan(accel::fp8::round_to_fp8(std::numeric_limits<float>::quiet_NaN(), dtype)));
  }
}

TEST_CASE("fp8 delayed scaling: the scale follows the amax history as Transformer Engine updates it",
          "[fp8]") {
  using accel::fp8::AmaxAlgo;
  const std::vector<double> amaxes = {2.0, 0.5, 8.0, 1.0, 0.25, 0.0, 3.0, 0.125};
  for (const AmaxAlgo algo : {AmaxAlgo::Max, AmaxAlgo::MostRecent}) {
    for (const std::int64_t len : {1, 3, 1024}) {
      for (const int margin : {0, 2}) {
        accel::fp8::DelayedScaling scaling(Dtype::E4M3, len, algo, margin);
        CHECK(scaling.scale() == 1.0f);
        std::deque<double> window;  // the last `len` steps' amaxes
        float expected = 1.0f;
        for (const double a : amaxes) {
          scaling.record(a);
          window.push_back(a);
          if (static_cast<std::int64_t>(window.size()) > len) window.pop_front();
          const double amax = algo == AmaxAlgo::Max ? *std::max_element(window.begin(), window.end()) : a;
          // scale = max * 2^-margin / amax, the previous scale kept when amax is 0.
          if (amax > 0)
            expected = static_cast<float>(448.0f * std::pow(2.0f, -margin)) / static_cast<float>(amax);
          INFO("algo " << accel::fp8::to_string(algo) << " len " << len << " margin " << margin << " amax "
                       << a);
          CHECK(scaling.update() == expected);
          CHECK(scaling.history()[0] == 0.0f);
        }
      }
    }
  }
  accel::fp8::DelayedScaling e5m2(Dtype::E5M2, 4, AmaxAlgo::Max, 0);
  e5m2.record(std::numeric_limits<double>::infinity());
  CHECK(e5m2.update() == 1.0f);  // an inf amax keeps the scale
  CHECK_THROWS_WITH(accel::fp8::DelayedScaling(Dtype::E4M3, 0, AmaxAlgo::Max, 0),
                    "DelayedScaling: amax_history_len must be at least 1, got 0");
  CHECK_THROWS_WITH(accel::fp8::DelayedScaling(Dtype::E4M3, 4, AmaxAlgo::Max, -1),
                    "DelayedScaling: margin must be >= 0, got -1");
}
