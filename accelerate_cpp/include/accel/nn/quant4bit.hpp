#pragma once
/// \file quant4bit.hpp
/// 4-bit storage of frozen weights as QLoRA and bitsandbytes store them (`accel::quant`): NormalFloat4 (NF4)
/// or FP4 codes, one absmax per block of `blocksize` values (64), and with double quantisation the absmax
/// values themselves stored as 8-bit codes of bitsandbytes' dynamic map in blocks of 256 (after subtracting
/// their mean). Bit for bit what bitsandbytes 0.50's `quantize_4bit` / `dequantize_4bit` compute on the CPU
/// (tests/python/bnb_4bit.py checks it against bitsandbytes itself).
///
/// Bytes held per parameter: 0.5 for the codes, plus 1/64 (one uint8 absmax per block) and 4/(64 x 256)
/// (one float per 256 absmax values) with double quantisation: 0.516; 0.5625 without it.
///
/// `Linear4bit` holds such a weight (frozen, no gradient) and its bias, and dequantises the weight per call
/// to the input's floating type (the compute dtype: fp32, bf16 under autocast, ...), a row slice of a few MB
/// at a time (never the whole weight in full precision). `quantize_linears` swaps the `torch::nn::Linear`
/// children of a model for `Linear4bit` in place.

#include <torch/nn/cloneable.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>
#include <torch/types.h>
#include <accel/nn/constant_buffers.hpp>

#include <cstdint>
#include <functional>
#include <memory>
#include <regex>
#include <string>
#include <vector>

namespace accel::quant {

/// The 4-bit data type: NF4 (quantiles of N(0, 1), QLoRA) or FP4 (1 sign, 2 exponent, 1 mantissa bit).
enum class QuantType { NF4, FP4 };

/// How a weight is quantised.
struct Quant4bitOptions {
  QuantType type = QuantType::NF4;
  /// Values per absmax block: 32, 64 (QLoRA's), 128, ..., 4096 (bitsandbytes' choices).
  std::int64_t blocksize = 64;
  /// Double quantisation (bitsandbytes' `compress_statistics`, QLoRA's `bnb_4bit_use_double_quant`).
  bool double_quant = true;
};

/// A quantised tensor and what it takes to restore it.
struct Quantized4bit {
  /// uint8 [ceil(numel / 2)]: two codes per byte, the first value in the high nibble.
  torch::Tensor packed;
  /// float32 [blocks], or with double quantisation uint8 codes of the dynamic map [blocks].
  torch::Tensor absmax;
  /// Double quantisation: float32 [ceil(blocks / 256)], the absmax of each block of absmax values.
  torch::Tensor absmax_scale;
  /// Double quantisation: the mean subtracted from the absmax values before quantising them.
  float absmax_offset = 0;
  std::vector<std::int64_t> shape;
  torch::ScalarType dtype = torch::kFloat32;  ///< the original tensor's type
  Quant4bitOptions options;
  /// Bytes held: codes, absmax and its scales.
  std::int64_t bytes() const;
};

/// The 16 values of `type`'s code (bitsandbytes' `get_4bit_type`), normalised to [-1, 1].
torch::Tensor code_4bit(QuantType type);
/// bitsandbytes' signed 8-bit dynamic map (`create_dynamic_map(signed=True)`): 256 sorted values.
torch::Tensor dynamic_map_8bit();

/// Quantises a float32, bfloat16 or float16 tensor on the CPU, a slice of 2^18 values at a time (its
/// temporaries are slice-sized: the tensor itself is the only whole one). Throws UsageError on another type
/// or a blocksize bitsandbytes does not offer.
Quantized4bit quantize_4bit(const torch::Tensor& tensor, const Quant4bitOptions& options = {});
/// The tensor back, in `q.dtype` and `q.shape`, on the CPU.
torch::Tensor dequantize_4bit(const Quantized4bit& q);
/// The same in another floating type (the compute dtype).
torch::Tensor dequantize_4bit(const Quantized4bit& q, torch::ScalarType dtype);

/// A Linear layer whose weight is stored in 4 bits (frozen) and dequantised in each forward to the input's
/// floating type; the bias stays a parameter in full precision. Forward and backward dequantise and multiply
/// the weight in row slices (output features: y[:, a:b] = x W[a:b]^T, and dx = sum of g[:, a:b] W[a:b]) of
/// about `slice_bytes` each, in one autograd node that keeps the 4-bit codes, not the input nor any
/// dequantised weight: the layer's transient memory is one slice, not the weight in float32 (issue 51).
/// Its buffers (codes, absmax, double-quantisation state) are ConstantBuffers: DDP does not rebroadcast them.
class Linear4bitImpl : public torch::nn::Cloneable<Linear4bitImpl>, public ConstantBuffers {
 public:
  /// Quantises `linear`'s weight; `linear` itself is left as it was.
  Linear4bitImpl(const torch::nn::Linear& linear, const Quant4bitOptions& options = {});
  void reset() override;
  torch::Tensor forward(const torch::Tensor& input);
  /// forward's autograd graph without its value, for an output nobody reads (the last projection of a
  /// segment recomputed by accel::checkpoint, see accel::linear_graph_only): the product is not computed and
  /// the result holds UNSPECIFIED VALUES; backward gives the input and bias the gradients forward's would.
  /// With an `output_hook` (LoRA), or grad mode off, it is forward (values computed).
  torch::Tensor forward_graph_only(const torch::Tensor& input);
  /// The weight as the forward sees it (dequantised, in `dtype`), whole: for merges and checks, not compute.
  torch::Tensor dequantized_weight(torch::ScalarType dtype = torch::kFloat32) const;
  const Quantized4bit& quantized() const noexcept { return weight_; }
  /// Stores `weight` (the layer's shape, any floating type and device) quantised as the current weight is
  /// (its type, blocksize and double quantisation), in its place: PEFT's merge of LoRA adapters into a 4-bit
  /// base (dequantise, add, quantise again). UsageError for another shape.
  void requantize(const torch::Tensor& weight);
  /// Replaces the weight by `weight` quantised afresh (its own absmax offset), exactly as constructing the
  /// layer from a Linear holding it would: loading a checkpoint's tensor into a layer built already quantised
  /// (accel::llm's load_in_4bit). UsageError for another shape.
  void load_weight(const torch::Tensor& weight);
  std::int64_t in_features() const noexcept { return weight_.shape.at(1); }
  std::int64_t out_features() const noexcept { return weight_.shape.at(0); }
  torch::Tensor bias;  ///< undefined without a bias
  /// Called with the input and the layer's output when set; its result is the forward's result. LoRA
  /// (`peft::get_peft_model` on a quantised model, QLoRA) adds its adapters' term here.
  std::function<torch::Tensor(const torch::Tensor& input, const torch::Tensor& output)> output_hook;
  /// Bytes of float32 weight dequantised at once by forward and backward (rounded to whole rows and whole
  /// absmax blocks; at least one row). 4 MiB keeps the slices' GEMMs as fast as one whole-weight GEMM on
  /// Qwen2.5-0.5B's projections (measured, issue 51); 0 or less: the fewest rows of whole blocks.
  std::int64_t slice_bytes = std::int64_t{4} << 20;

 private:
  Quantized4bit current() const;  // the weight with the registered buffers (which follow to(device))
  torch::Tensor compute(const torch::Tensor& input, bool graph_only);
  void check_shape(const torch::Tensor& weight, const char* call) const;
  void store(Quantized4bit q);  // into the registered buffers, which keep their identity
  Quantized4bit weight_;
  torch::Tensor packed_, absmax_, absmax_scale_;  // registered buffers (moved by to(), seen by state dicts)
};
TORCH_MODULE(Linear4bit);

/// Replaces, in place, every `torch::nn::Linear` inside `model` whose path (as in named_modules, e.g.
/// "blocks.0.q_proj") matches `keep_out` for none of its patterns by a Linear4bit of it. Returns the paths
/// replaced. The replaced weights are freed with the old modules (an optimizer made before holds them: make
/// it after). QLoRA keeps the output layer in full precision: pass it in `keep_out` ("^head$"). A Linear the
/// model also holds as a member handle (`torch::nn::Linear fc1;` called by its forward) cannot be swapped
/// from outside: UsageError naming it (build such a model with Linear4bit members instead).
std::vector<std::string> quantize_linears(torch::nn::Module& model, const Quant4bitOptions& options = {},
                                          const std::vector<std::string>& keep_out = {});

}  // namespace accel::quant
