#pragma once
/// \file fused_linear_cross_entropy.hpp
/// The causal-LM loss straight from the final hidden states and the output head's weight, a chunk of tokens
/// at a time (Liger Kernel's fused linear cross-entropy, on LibTorch): the [tokens, vocab] logits never
/// exist whole, and tokens whose label is ignored (-100: prompts under completion-only loss, padding, the
/// last position of each row) get no logits at all. Equal to
/// `causal_lm_loss(torch::linear(hidden, weight), labels, num_items_in_batch)` (transformers'
/// ForCausalLMLoss: logits in the hidden states' dtype, upcast to float32) within float arithmetic.
///
///   const auto h = model->model->forward(input_ids);                  // [B, T, hidden]
///   auto loss = accel::llm::fused_linear_cross_entropy(h, model->output_weight(), labels);
///   loss.backward();                                                  // gradients of h and of the weight
///
/// As Liger Kernel does, the gradients are computed in the forward (while each chunk's logits are at hand)
/// when grad mode is on and an input requires grad, and only scaled in backward: no matmul is recomputed, and
/// the memory beyond the inputs is one chunk's logits plus the gradients' own size. Tied embeddings: pass the
/// embedding's weight; its gradient flows into the shared parameter beside the embedding's. Local to a rank:
/// no collective.

#include <torch/types.h>

#include <cstdint>
#include <optional>

namespace accel::llm {

/// Options of fused_linear_cross_entropy. Example: `FusedCrossEntropyOptions().chunk_tokens(512)`.
struct FusedCrossEntropyOptions {
  /// Tokens per chunk (each chunk's logits are chunk_tokens x vocab float32). 0: automatic, at least 16
  /// tokens and about 256 MiB of float32 logits per chunk (Qwen's 151,936 vocabulary: 441 tokens), the
  /// tokens split into equal chunks of at most 1.25 x that so that no small tail chunk is left (511 tokens:
  /// one chunk, 2,047: four of 512); smaller chunks cost time on a CPU, see BENCHMARKS.md.
  FusedCrossEntropyOptions& chunk_tokens(std::int64_t value) {
    chunk_tokens_ = value;
    return *this;
  }
  /// Labels ignored (transformers' ignore_index).
  FusedCrossEntropyOptions& ignore_index(std::int64_t value) {
    ignore_index_ = value;
    return *this;
  }
  std::int64_t chunk_tokens_ = 0;
  std::int64_t ignore_index_ = -100;
};

/// transformers' ForCausalLMLoss of `hidden` [B, T, H] (float32, bfloat16 or float16) through `weight`
/// [V, H] (the head, same dtype) against `labels` [B, T] (int64; position t predicts labels[t + 1]): the
/// mean over the counted labels, or with `num_items_in_batch` their sum divided by it. A scalar float32
/// tensor, differentiable with respect to `hidden` and `weight`. Throws UsageError on mismatched shapes or
/// dtypes, a label outside [0, V) other than the ignore index, or a chunk size below 0.
torch::Tensor fused_linear_cross_entropy(const torch::Tensor& hidden, const torch::Tensor& weight,
                                         const torch::Tensor& labels,
                                         std::optional<std::int64_t> num_items_in_batch = std::nullopt,
                                         const FusedCrossEntropyOptions& options = {});

}  // namespace accel::llm
