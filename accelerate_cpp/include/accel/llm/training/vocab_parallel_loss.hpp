#pragma once
/// \file vocab_parallel_loss.hpp
/// The causal-LM loss when the head is split over the vocabulary across a tensor-parallel group (Megatron's
/// vocab_parallel_cross_entropy; apply_tensor_parallel with TensorParallelOptions().vocab_parallel(true)):
/// rank r holds logits for the vocabulary rows [r V / N, (r + 1) V / N) only, and the loss of every token is
/// computed without gathering them: the maximum of each token's logits and the sum of their exponentials are
/// all-reduced over the group (the maximum first, so that the exponentials stay in range), and the target's
/// logit comes from the rank that holds it (zeros from the others, summed). Every rank of the group returns
/// the same loss; each keeps the gradient of its own logits (softmax - one-hot on its rows).
///
///   const auto h = model->model->forward(input_ids);   // [B, T, hidden], the same on every rank of the
///   group auto loss = accel::llm::vocab_parallel_fused_linear_cross_entropy(h, my_rows_of_the_head, labels,
///   group);
///
/// Equal to causal_lm_loss / fused_linear_cross_entropy of the whole head (transformers' ForCausalLMLoss)
/// within float arithmetic. Collective: every rank of `group` calls it on the same hidden states and labels.

#include <torch/types.h>

#include <cstdint>
#include <memory>
#include <optional>

#include "accel/llm/training/fused_linear_cross_entropy.hpp"

namespace accel {
class Communicator;
}

namespace accel::llm {

/// transformers' ForCausalLMLoss over `logits` [B, T, V / N] (this rank's vocabulary rows, rank r's starting
/// at r V / N; any floating dtype, computed in float32) against `labels` [B, T] (int64, the full vocabulary's
/// ids; position t predicts labels[t + 1]; `ignore_index` ignored): the mean over the counted labels, or with
/// `num_items_in_batch` their sum divided by it. Differentiable with respect to `logits` (this rank's part of
/// the gradient). Collective over `group` (two all-reduces in forward, none in backward). UsageError on
/// mismatched shapes, a label outside [0, V) other than the ignore index, or a null group.
torch::Tensor vocab_parallel_causal_lm_loss(const torch::Tensor& logits, const torch::Tensor& labels,
                                            const std::shared_ptr<Communicator>& group,
                                            std::optional<std::int64_t> num_items_in_batch = std::nullopt,
                                            std::int64_t ignore_index = -100);

/// The same loss straight from `hidden` [B, T, H] (the same on every rank of the group) and `weight`
/// [V / N, H] (this rank's rows of the head), a chunk of tokens at a time as fused_linear_cross_entropy does:
/// neither this rank's [tokens, V / N] logits nor anyone's full ones exist whole. Gradients: `weight`'s is
/// this rank's rows'; `hidden`'s is the sum over the group of every rank's part (one all-reduce in backward,
/// Megatron's f), i.e. the whole head's. Two all-reduces per chunk in forward. Same errors as
/// fused_linear_cross_entropy, plus a null group.
torch::Tensor vocab_parallel_fused_linear_cross_entropy(
    const torch::Tensor& hidden, const torch::Tensor& weight, const torch::Tensor& labels,
    const std::shared_ptr<Communicator>& group, std::optional<std::int64_t> num_items_in_batch = std::nullopt,
    const FusedCrossEntropyOptions& options = {});

}  // namespace accel::llm
