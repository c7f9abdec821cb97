#pragma once
// Internals of sequence_parallel.hpp used by causal_lm.cpp: the attention mask of a split sequence and the
// split attention.

#include <accel/llm/models/causal_lm.hpp>

namespace accel::llm::detail {

/// The boolean mask (true = attend) of the split attention, from this rank's `attention_mask` [B, t] (0/1,
/// or undefined) and `positions` [B or 1, t]: Ulysses [B, 1, T, T] in global order, context parallelism
/// [B, 1, t, T] over the keys in the order the group's all-gather holds them; undefined when the attention is
/// causal only (no padding, one document per row), which sequence_parallel_attention then runs with SDPA's
/// causal flag. UsageError with a cache.
torch::Tensor sequence_parallel_mask(const SequenceParallelism& s, const torch::Tensor& attention_mask,
                                     const torch::Tensor& positions, std::int64_t batch,
                                     const KVCache* cache);

/// The attention output [B, t, heads x head_dim] of this rank's positions from its rotated `q` [B, H, t, D],
/// `k` and `v` [B, Hkv, t, D]; `groups` = H / Hkv, `scale` the softmax scale.
torch::Tensor sequence_parallel_attention(const SequenceParallelism& s, const torch::Tensor& q,
                                          const torch::Tensor& k, const torch::Tensor& v,
                                          const torch::Tensor& mask, std::int64_t groups, double scale);

/// Autograd collectives over `group` (kept alive by the caller): all-to-all of dim-0 blocks (its own
/// inverse: backward is the same exchange), all-gather along dim 0 (backward: reduce-scatter of the sum),
/// all-reduce sum (backward: all-reduce sum of the gradients, as torch.distributed.nn.functional's).
torch::Tensor all_to_all(const torch::Tensor& x, Communicator& group);
torch::Tensor all_gather(const torch::Tensor& x, Communicator& group);
torch::Tensor all_reduce_sum(const torch::Tensor& x, Communicator& group);

}  // namespace accel::llm::detail
