#pragma once
// Internals of sequence_parallel.hpp used by causal_lm.cpp: the attention mask of a split sequence and the
// split attention.

#include <accel/llm/models/causal_lm.hpp>

#include <cstdint>
#include <utility>

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

/// Ring attention's block pair: the rows of this rank's queries and the columns of the key block it holds
/// that the causal load-balanced layout needs (rank r holds chunks r and 2n - 1 - r of 2n, each `length` / 2
/// positions). Its own block: every row, every column, causal; a block of a lower rank: every row, the
/// block's first chunk; of a higher rank: the second chunk's rows, every column. The causal flag only for
/// its own block.
struct RingPair {
  std::int64_t q_begin = 0, q_length = 0, k_begin = 0, k_length = 0;
  bool causal = false;
};
RingPair ring_pair(int rank, int source, std::int64_t length);

/// The running result of ring attention over this rank's queries: `out` [B, H, t, D] and `lse` [B, H, t]
/// (the log-sum-exp of the scores so far; -inf where no key was seen yet), both float32.
struct RingMerge {
  torch::Tensor out, lse;
};

/// Attends `q` [B, H, t, D] to the key block `k`, `v` [B, Hkv, t, D] of the block pair `pair` and merges the
/// partial result into `state` by its log-sum-exp (online softmax). `keep` is the block's boolean mask
/// [B, 1, t, t] (true = attend; undefined: only the pair's causal flag). The kernel: CPU's flash attention
/// on CPU, float32 matrix products elsewhere or with `math` (the unit test runs both on CPU).
void ring_attend_block(RingMerge& state, const torch::Tensor& q, const torch::Tensor& k,
                       const torch::Tensor& v, const torch::Tensor& keep, const RingPair& pair, double scale,
                       bool math = false);

/// The gradients of one block pair recomputed from the merged `out` (q's dtype) and `lse` of the forward:
/// adds the query gradient into `dq` [B, H, t, D] and returns the block's key and value gradients
/// ([B, Hkv, t, D] each, float32, zero outside the pair's columns).
std::pair<torch::Tensor, torch::Tensor> ring_block_backward(
    const torch::Tensor& grad_out, const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
    const torch::Tensor& out, const torch::Tensor& lse, const torch::Tensor& keep, const RingPair& pair,
    double scale, torch::Tensor& dq, bool math = false);

/// Ring attention over `group` (context parallelism, cp_comm_strategy "alltoall"): this rank's output
/// [B, H, t, D] from its `q` [B, H, t, D], `k`, `v` [B, Hkv, t, D] and `mask` ([B, 1, t, size x t] in the
/// group's key order as sequence_parallel_mask makes it, or undefined: causal only). Autograd function;
/// collective over the group in forward and backward.
torch::Tensor ring_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                             const torch::Tensor& mask, Communicator& group, double scale);

}  // namespace accel::llm::detail
