#pragma once
// The scaling arithmetic of fp8 training, torch-free: the scale that maps a tensor's absolute maximum (amax)
// onto the largest value of an fp8 format, as torchao's float8 training computes it (tensor-wise and
// row-wise dynamic scaling) and as Transformer Engine's delayed scaling computes it from an amax history.
// A tensor is cast to fp8 as `round_to_fp8(x * scale)` (saturated); the matmul's result is divided by the
// scales of its two operands. Which format each tensor uses comes from the recipe's fp8_format.
//
// This is the arithmetic only: training in fp8 needs an fp8 matmul (LibTorch's _scaled_mm, CUDA compute
// capability 8.9+), which accelerate-cpp does not drive yet (mixed_precision: fp8 is refused at load).
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace accel::fp8 {

/// The two fp8 formats of training: E4M3 (torch.float8_e4m3fn: 4 exponent bits, 3 mantissa bits, no
/// infinity) and E5M2 (torch.float8_e5m2: 5 exponent bits, 2 mantissa bits).
enum class Dtype { E4M3, E5M2 };

/// Accelerate's `fp8_format`: HYBRID casts the forward's tensors (inputs, weights) to E4M3 and the gradients
/// to E5M2 (Transformer Engine's Format.HYBRID, torchao's default tensor-wise recipe); E4M3 and E5M2 use
/// that format for every tensor.
enum class Format { Hybrid, E4M3, E5M2 };

/// How delayed scaling reduces the amax history to the amax it scales by (Accelerate's
/// `amax_compute_algo`): the largest in the history, or the most recent step's.
enum class AmaxAlgo { Max, MostRecent };

/// "E4M3", "E5M2"; "HYBRID", ...; "max", "most_recent" (as Accelerate spells them).
std::string to_string(Dtype dtype);
std::string to_string(Format format);
std::string to_string(AmaxAlgo algo);

/// Largest finite value of the format: 448 (E4M3), 57344 (E5M2).
double max_value(Dtype dtype);
/// The format of the forward's tensors (inputs and weights) under `format`.
Dtype forward_dtype(Format format);
/// The format of the gradients (grad_output) under `format`.
Dtype backward_dtype(Format format);

/// torchao's amax_to_scale: max_value(dtype) / max(amax, 1e-12), computed in double and returned as float;
/// with `round_to_power_of_2`, rounded down to a power of two (2^floor(log2 scale)), as the "rowwise" recipe
/// does. An amax of 0 therefore gives a huge scale (the tensor is all zeros, any scale casts it exactly).
float scale_from_amax(double amax, Dtype dtype, bool round_to_power_of_2 = false);

/// Tensor-wise dynamic scaling (torchao's "tensorwise" recipe): the scale of `n` values from their amax.
float tensorwise_scale(const float* values, std::size_t n, Dtype dtype, bool round_to_power_of_2 = false);

/// Row-wise dynamic scaling (torchao's "rowwise" recipe: axiswise over the last dimension, E4M3 for every
/// operand, scales rounded down to powers of two): one scale per row of the row-major `rows` x `cols`
/// matrix.
std::vector<float> rowwise_scales(const float* values, std::size_t rows, std::size_t cols, Dtype dtype,
                                  bool round_to_power_of_2 = true);

/// The value an fp8 cast of `x` holds, as a float: `x` clamped to +-max_value (torchao's to_fp8_saturated),
/// then rounded to the nearest value of the format (ties to even), subnormals included. NaN stays NaN.
float round_to_fp8(float x, Dtype dtype);

/// Transformer Engine's delayed scaling of one tensor (common/recipe/delayed_scaling.cu): each step records
/// the tensor's amax in slot 0 of a history of `history_len` amaxes; `update()` then reduces the history
/// (largest, or slot 0) to the amax, rolls the history by one (slot 0 is cleared for the next step) and sets
/// scale = max_value(dtype) * 2^-margin / amax, keeping the previous scale when that amax is 0 or not
/// finite. The first scale is 1.
class DelayedScaling {
 public:
  /// Throws std::invalid_argument for a history_len below 1 or a negative margin (Accelerate passes them
  /// to Transformer Engine, which requires the same).
  DelayedScaling(Dtype dtype, std::int64_t history_len, AmaxAlgo algo, int margin);
  /// Records a step's amax of the tensor (the largest, when called several times in one step).
  void record(double amax);
  /// Settles this step: the new scale, from the history as described above.
  float update();
  float scale() const { return scale_; }
  /// Slot 0 first (the step being recorded).
  const std::vector<float>& history() const { return history_; }

 private:
  Dtype dtype_;
  AmaxAlgo algo_;
  int margin_;
  std::vector<float> history_;
  float scale_ = 1.0f;
};

}  // namespace accel::fp8
