// Rotary inverse frequencies as transformers' modeling_rope_utils.py computes them, operation for operation
// in float32 (`1.0 / t` in Python is `t.reciprocal() * 1.0`), so that the tables are bitwise transformers'.
#include <torch/torch.h>

#include <algorithm>
#include <cmath>

#include "accel/errors.hpp"
#include "accel/llm/models/causal_lm.hpp"

namespace accel::llm {
namespace {

constexpr double kPi = 3.141592653589793;  // Python's math.pi

// base ** (arange(0, dim, 2) / dim) in float32.
torch::Tensor position_frequencies(double base, std::int64_t dim) {
  const auto exponents =
      torch::arange(0, dim, 2, torch::kInt64).to(torch::kFloat32) / static_cast<double>(dim);
  return torch::pow(torch::Scalar(base), exponents);
}

torch::Tensor llama3_frequencies(const RopeConfig& rope, torch::Tensor inv_freq) {
  const double factor = *rope.factor;
  const double old_context_len = static_cast<double>(*rope.original_max_position_embeddings);
  const double low_freq_wavelen = old_context_len / rope.low_freq_factor;
  const double high_freq_wavelen = old_context_len / rope.high_freq_factor;
  const auto wavelen = inv_freq.reciprocal() * (2 * kPi);
  auto inv_freq_llama = torch::where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq);
  const auto smooth_factor = (wavelen.reciprocal() * old_context_len - rope.low_freq_factor) /
                             (rope.high_freq_factor - rope.low_freq_factor);
  const auto smoothed = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama;
  const auto is_medium =
      (wavelen < high_freq_wavelen).logical_not() * (wavelen > low_freq_wavelen).logical_not();
  return torch::where(is_medium, smoothed, inv_freq_llama);
}

double yarn_mscale(double scale, double mscale) {
  return scale <= 1 ? 1.0 : 0.1 * mscale * std::log(scale) + 1.0;
}

RotaryTables yarn_tables(const ModelConfig& config) {
  const RopeConfig& rope = config.rope;
  const double base = rope.rope_theta;
  const std::int64_t dim = config.head_dim;
  const double original = static_cast<double>(*rope.original_max_position_embeddings);
  const double factor =
      rope.factor ? *rope.factor : static_cast<double>(config.max_position_embeddings) / original;
  double attention_factor = 0;
  if (rope.attention_factor) {
    attention_factor = *rope.attention_factor;
  } else if (rope.mscale && rope.mscale_all_dim && *rope.mscale != 0 && *rope.mscale_all_dim != 0) {
    attention_factor = yarn_mscale(factor, *rope.mscale) / yarn_mscale(factor, *rope.mscale_all_dim);
  } else {
    attention_factor = yarn_mscale(factor, 1);
  }
  const double beta_fast = rope.beta_fast && *rope.beta_fast != 0 ? *rope.beta_fast : 32;
  const double beta_slow = rope.beta_slow && *rope.beta_slow != 0 ? *rope.beta_slow : 1;
  auto correction_dim = [&](double rotations) {
    return (static_cast<double>(dim) * std::log(original / (rotations * 2 * kPi))) / (2 * std::log(base));
  };
  double low = correction_dim(beta_fast);
  double high = correction_dim(beta_slow);
  if (rope.truncate) {
    low = std::floor(low);
    high = std::ceil(high);
  }
  low = std::max(low, 0.0);
  high = std::min(high, static_cast<double>(dim - 1));
  if (low == high) high += 0.001;

  const auto pos_freqs = position_frequencies(base, dim);
  const auto extrapolation = pos_freqs.reciprocal();
  const auto interpolation = (pos_freqs * factor).reciprocal();
  const auto ramp = ((torch::arange(dim / 2, torch::kFloat32) - low) / (high - low)).clamp(0, 1);
  const auto extrapolation_factor = 1 - ramp;
  RotaryTables tables;
  tables.inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor;
  tables.attention_scaling = attention_factor;
  return tables;
}

}  // namespace

RotaryTables rotary_tables(const ModelConfig& config) {
  torch::NoGradGuard no_grad;
  const RopeConfig& rope = config.rope;
  if (rope.rope_type == "yarn") return yarn_tables(config);
  RotaryTables tables;
  tables.inv_freq = position_frequencies(rope.rope_theta, config.head_dim).reciprocal();
  if (rope.rope_type == "linear") {
    tables.inv_freq.div_(*rope.factor);
  } else if (rope.rope_type == "llama3") {
    tables.inv_freq = llama3_frequencies(rope, tables.inv_freq);
  } else if (rope.rope_type != "default") {
    throw UsageError("accel::llm::rotary_tables: rope_type \"" + rope.rope_type +
                     "\" is not implemented (default, linear, llama3, yarn)");
  }
  return tables;
}

}  // namespace accel::llm
