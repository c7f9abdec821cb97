#include "accel/precision/fp8_scaling.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>

namespace accel::fp8 {
namespace {

// torchao's float8_utils.EPS: the smallest amax a scale is computed from.
constexpr double kAmaxFloor = 1e-12;

struct Layout {
  int mantissa_bits;
  int min_exponent;  // of the smallest normal value
};
Layout layout(Dtype dtype) {
  return dtype == Dtype::E4M3 ? Layout{3, -6} : Layout{2, -14};
}

}  // namespace

std::string to_string(Dtype dtype) {
  return dtype == Dtype::E4M3 ? "E4M3" : "E5M2";
}
std::string to_string(Format format) {
  switch (format) {
    case Format::Hybrid:
      return "HYBRID";
    case Format::E4M3:
      return "E4M3";
    case Format::E5M2:
      return "E5M2";
  }
  return "?";
}
std::string to_string(AmaxAlgo algo) {
  return algo == AmaxAlgo::Max ? "max" : "most_recent";
}

double max_value(Dtype dtype) {
  return dtype == Dtype::E4M3 ? 448.0 : 57344.0;
}

Dtype forward_dtype(Format format) {
  return format == Format::E5M2 ? Dtype::E5M2 : Dtype::E4M3;
}
Dtype backward_dtype(Format format) {
  return format == Format::E4M3 ? Dtype::E4M3 : Dtype::E5M2;
}

float scale_from_amax(double amax, Dtype dtype, bool round_to_power_of_2) {
  // In double first, as torchao upcasts to float64 so that eager and compiled runs agree.
  auto scale = static_cast<float>(max_value(dtype) / std::max(amax, kAmaxFloor));
  if (round_to_power_of_2) scale = std::exp2(std::floor(std::log2(scale)));
  return scale;
}

float tensorwise_scale(const float* values, std::size_t n, Dtype dtype, bool round_to_power_of_2) {
  float amax = 0;
  for (std::size_t i = 0; i < n; ++i)
    amax = std::max(amax, std::fabs(values[i]));
  return scale_from_amax(amax, dtype, round_to_power_of_2);
}

std::vector<float> rowwise_scales(const float* values, std::size_t rows, std::size_t cols, Dtype dtype,
                                  bool round_to_power_of_2) {
  std::vector<float> scales(rows);
  for (std::size_t r = 0; r < rows; ++r)
    scales[r] = tensorwise_scale(values + r * cols, cols, dtype, round_to_power_of_2);
  return scales;
}

float round_to_fp8(float x, Dtype dtype) {
  if (std::isnan(x)) return x;
  const auto max = static_cast<float>(max_value(dtype));
  const float clamped = std::min(std::max(x, -max), max);
  if (clamped == 0) return clamped;
  const Layout l = layout(dtype);
  // The spacing of the format's values around |x|: 2^(e - mantissa bits), e no lower than the smallest
  // normal exponent (below it the values are subnormal, evenly spaced).
  const int exponent = std::max(std::ilogb(clamped), l.min_exponent);
  const double quantum = std::ldexp(1.0, exponent - l.mantissa_bits);
  // nearbyint rounds ties to even in the default rounding mode, as the hardware cast does.
  return static_cast<float>(std::nearbyint(static_cast<double>(clamped) / quantum) * quantum);
}

DelayedScaling::DelayedScaling(Dtype dtype, std::int64_t history_len, AmaxAlgo algo, int margin)
    : dtype_(dtype), algo_(algo), margin_(margin) {
  if (history_len < 1)
    throw std::invalid_argument("DelayedScaling: amax_history_len must be at least 1, got " +
                                std::to_string(history_len));
  if (margin < 0)
    throw std::invalid_argument("DelayedScaling: margin must be >= 0, got " + std::to_string(margin));
  history_.assign(static_cast<std::size_t>(history_len), 0.0f);
}

void DelayedScaling::record(double amax) {
  history_[0] = std::fmax(history_[0], static_cast<float>(amax));
}

float DelayedScaling::update() {
  const float last = history_[0];
  float amax = 0;
  for (const float a : history_)
    amax = std::fmax(amax, a);
  if (algo_ == AmaxAlgo::MostRecent) amax = last;
  // Roll by one: slot i takes slot i + 1, the last slot takes this step's amax, slot 0 is cleared.
  std::rotate(history_.begin(), history_.begin() + 1, history_.end());
  history_[0] = 0;
  const float scaled_max =
      static_cast<float>(max_value(dtype_)) * std::pow(2.0f, static_cast<float>(-margin_));
  if (std::isfinite(amax) && amax > 0) scale_ = scaled_max / amax;
  return scale_;
}

}  // namespace accel::fp8
