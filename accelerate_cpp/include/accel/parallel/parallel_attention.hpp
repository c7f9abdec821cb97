#pragma once
/// \file parallel_attention.hpp
/// Tensor-parallel multi-head attention (Megatron's ParallelAttention): the heads are split over the ranks of
/// a tensor-parallel group. Rank r of N holds heads [r * H / N, (r + 1) * H / N): their rows of the q, k and
/// v projections (three ColumnParallelLinear layers) and their columns of the output projection (a
/// RowParallelLinear), and computes their attention locally; one all-reduce in forward (the output
/// projection) and one in backward (the input gradient). Built from a `torch::nn::MultiheadAttention`, whose
/// packed `in_proj_weight` [3E, E] is cut into q, k and v by rows and each of those by heads, so one rank
/// and N ranks compute the same function:
///
///   torch::nn::MultiheadAttention full(torch::nn::MultiheadAttentionOptions(512, 8));
///   accel::tp::ParallelMultiheadAttention attn(full, tp_group);   // 8 heads over tp_group's ranks
///   auto y = attn(x, x, x, /*key_padding_mask=*/{}, causal_mask);  // [L, B, E], as full(x, x, x) gives
///
/// Parameters: q_proj, k_proj, v_proj (weight and bias, split: Accelerator::get_state_dict, save_model and
/// save_state gather them) and out_proj (weight split, bias replicated). Not supported (UsageError at
/// construction): separate key/value dimensions (kdim/vdim), add_bias_kv, add_zero_attn; dropout is applied
/// to the attention weights as LibTorch's does when training.

#include <accel/parallel/tensor_parallel.hpp>

#include <torch/nn/modules/activation.h>

#include <memory>

namespace accel::tp {

class ParallelMultiheadAttentionImpl : public torch::nn::Cloneable<ParallelMultiheadAttentionImpl> {
 public:
  /// This rank's heads of `full` (which stays unchanged). UsageError when the number of heads is not
  /// divisible by the group's size, or `full` uses kdim/vdim, add_bias_kv or add_zero_attn.
  ParallelMultiheadAttentionImpl(const torch::nn::MultiheadAttention& full,
                                 std::shared_ptr<Communicator> comm);

  void reset() override;
  /// query [L, B, E], key and value [S, B, E] (sequence first, as torch::nn::MultiheadAttention); the
  /// optional key_padding_mask [B, S] (true or nonzero: ignored) and attn_mask [L, S] or [B * H, L, S]
  /// (bool: true is masked; float: added to the scores), as LibTorch's. Returns the attention output
  /// [L, B, E], the same on every rank. Collective.
  torch::Tensor forward(const torch::Tensor& query, const torch::Tensor& key, const torch::Tensor& value,
                        const torch::Tensor& key_padding_mask = {}, const torch::Tensor& attn_mask = {});

  std::int64_t embed_dim() const noexcept { return embed_dim_; }
  std::int64_t num_heads() const noexcept { return heads_; }
  /// The heads this rank holds: [first_head(), first_head() + local_heads()).
  std::int64_t first_head() const noexcept { return first_head_; }
  std::int64_t local_heads() const noexcept { return local_heads_; }

  ColumnParallelLinear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr};
  RowParallelLinear out_proj{nullptr};

 private:
  torch::nn::MultiheadAttention full_;  ///< only while constructing (reset)
  torch::nn::MultiheadAttentionOptions options_;
  std::shared_ptr<Communicator> comm_;
  std::int64_t embed_dim_ = 0, heads_ = 0, first_head_ = 0, local_heads_ = 0;
  double dropout_ = 0.0;
};

TORCH_MODULE(ParallelMultiheadAttention);

}  // namespace accel::tp
