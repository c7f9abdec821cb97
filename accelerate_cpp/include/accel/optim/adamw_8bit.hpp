#pragma once
/// \file adamw_8bit.hpp
/// bitsandbytes' AdamW with 8-bit blockwise-quantised state (`bnb.optim.AdamW(optim_bits=8)`, the optimizer
/// of Hugging Face's `optim: adamw_bnb_8bit` / `adamw_8bit` / `paged_adamw_8bit`), and its 32-bit form
/// (`paged_adamw_32bit`), as bitsandbytes 0.50's CPU kernels compute them:
///  - each moment of a parameter is stored as one uint8 code per element plus one float absmax per block of
///    256 elements: value = code_map[code] * absmax (the first moment with the signed dynamic map, the second
///    with the unsigned one: bitsandbytes' create_dynamic_map); 2 bytes + 8/256 per element instead of 8;
///  - a step dequantises both moments, makes Adam's update in fp32 (decoupled weight decay lr * wd), and
///    quantises them again (absmax of each block, each element to its nearest code);
///  - parameters with fewer than `min_8bit_size` (4096) elements keep fp32 moments, as bitsandbytes does.
/// Paging (bitsandbytes' unified-memory pages that the GPU driver evicts to host memory under pressure) has
/// no meaning on a CPU and is not done on GPUs either: the paged names train as the unpaged ones. Under ZeRO
/// (optimizer state sharded) the optimizer steps each rank's flat slice: its blocks run over the slice, not
/// over each parameter.
///
///   accel::optim::AdamW8bit opt(model->parameters(), accel::optim::AdamW8bitOptions(2e-4));
#include <torch/optim/optimizer.h>
#include <torch/optim/serialize.h>

#include <tuple>
#include <utility>
#include <vector>

namespace accel::optim {

/// Options of AdamW8bit (bitsandbytes' AdamW defaults: weight_decay 1e-2, min_8bit_size 4096).
struct AdamW8bitOptions : public torch::optim::OptimizerCloneableOptions<AdamW8bitOptions> {
  AdamW8bitOptions(double lr = 1e-3);
  TORCH_ARG(double, lr) = 1e-3;
  typedef std::tuple<double, double> betas_t;
  TORCH_ARG(betas_t, betas) = std::make_tuple(0.9, 0.999);
  TORCH_ARG(double, eps) = 1e-8;
  TORCH_ARG(double, weight_decay) = 1e-2;
  /// 8 (quantised moments) or 32 (fp32 moments, bitsandbytes' 32-bit update).
  TORCH_ARG(int, optim_bits) = 8;
  /// Parameters with fewer elements keep fp32 moments.
  TORCH_ARG(std::int64_t, min_8bit_size) = 4096;

 public:
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
  double get_lr() const override;
  void set_lr(const double lr) override;
};

/// Per-parameter state: the step and the two moments, as uint8 codes with per-block absmax (8-bit) or fp32.
struct AdamW8bitParamState : public torch::optim::OptimizerCloneableParamState<AdamW8bitParamState> {
  TORCH_ARG(std::int64_t, step) = 0;
  TORCH_ARG(torch::Tensor, state1);   ///< first moment: uint8 codes (signed map) or fp32
  TORCH_ARG(torch::Tensor, state2);   ///< second moment: uint8 codes (unsigned map) or fp32
  TORCH_ARG(torch::Tensor, absmax1);  ///< fp32, one per block of 256 (undefined with fp32 moments)
  TORCH_ARG(torch::Tensor, absmax2);

 public:
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
};

/// bitsandbytes' AdamW8bit / AdamW32bit (see the file comment). Saved and loaded with torch::save /
/// torch::load and accelerate-cpp checkpoints.
class AdamW8bit : public torch::optim::Optimizer {
 public:
  explicit AdamW8bit(const std::vector<torch::optim::OptimizerParamGroup>& param_groups,
                     AdamW8bitOptions defaults = {});
  explicit AdamW8bit(std::vector<torch::Tensor> params, AdamW8bitOptions defaults = {})
      : AdamW8bit({torch::optim::OptimizerParamGroup(std::move(params))}, std::move(defaults)) {}
  torch::Tensor step(LossClosure closure = nullptr) override;
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;
};

/// bitsandbytes' create_dynamic_map(signed, 7, 8): the 256 sorted values of the dynamic 8-bit type.
torch::Tensor dynamic_map(bool is_signed);
/// Blockwise quantisation (bitsandbytes' quantize_blockwise): per block of `blocksize` elements, absmax =
/// max |x|, and each x / absmax to the index of its nearest value of `code` (sorted). Returns (codes,
/// absmax).
std::pair<torch::Tensor, torch::Tensor> quantize_blockwise(const torch::Tensor& x, const torch::Tensor& code,
                                                           std::int64_t blocksize = 256);
/// The inverse: code[codes] * absmax of the element's block, fp32, in the shape of `codes`.
torch::Tensor dequantize_blockwise(const torch::Tensor& codes, const torch::Tensor& absmax,
                                   const torch::Tensor& code, std::int64_t blocksize = 256);

}  // namespace accel::optim
