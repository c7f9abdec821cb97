#pragma once
// Internals of sequence_parallel.hpp used by causal_lm.cpp: the attention mask of a split sequence and the
// split attention.

#include <accel/llm/models/causal_lm.hpp>

#include <cstdint>
#include <utility>

namespace accel::llm::detail {

/// The mask of the split attention, from this rank's `attention_mask` [B, t] (0/1, or undefined) and
/// `positions` [B or 1, t]: Ulysses a boolean (true = attend) [B, 1, T, T] in global order, context
/// parallelism with all-gathered keys a boolean [B, 1, t, T] over the keys in the order the group's
/// all-gather holds them, the ring (`s.ring`) the per-position information ring_mask_info makes ([B, 2, T],
/// from which each block pair's mask is built when it is attended); undefined when the attention is causal
/// only (no padding, one document per row), which sequence_parallel_attention then runs with SDPA's causal
/// flag. UsageError with a cache.
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

/// Ring attention's mask information, O(T) per rank instead of a [t, T] mask: int64 [B, 2, T] in global
/// order, row 0 whether each position is a key (`is_key` [B, T], 0 for padding), row 1 its document in a
/// packed row (`documents` [B, T]; undefined: one document per row).
torch::Tensor ring_mask_info(const torch::Tensor& is_key, const torch::Tensor& documents);

/// The boolean mask (true = attend) of the block pair `pair` of rank `rank` (its queries) and rank `source`
/// (its keys) in a group of `size`, from `info` (ring_mask_info): [B, 1, pair.q_length, pair.k_length],
/// causal by global position, keys that are not padding, the same document.
torch::Tensor ring_block_mask(const torch::Tensor& info, int rank, int source, int size,
                              const RingPair& pair);

/// The running result of ring attention over this rank's queries: `out` [B, H, t, D] and `lse` [B, H, t]
/// (the log-sum-exp of the scores so far; -inf where no key was seen yet), both float32 whatever q's dtype.
struct RingMerge {
  torch::Tensor out, lse;
};

/// The merge before any block for the queries `q` [B, H, t, D]: output 0, log-sum-exp -inf (float32).
RingMerge ring_merge_start(const torch::Tensor& q);

/// Attends `q` [B, H, t, D] to the key block `k`, `v` [B, Hkv, t, D] of the block pair `pair` and merges the
/// partial result into `state` by its log-sum-exp (online softmax, in float32). `keep` is the pair's boolean
/// mask [B, 1, pair.q_length, pair.k_length] (ring_block_mask; true = attend; undefined: only the pair's
/// causal flag). The kernel: CPU's flash attention on CPU, float32 matrix products elsewhere or with `math`
/// (the unit test runs both on CPU).
void ring_attend_block(RingMerge& state, const torch::Tensor& q, const torch::Tensor& k,
                       const torch::Tensor& v, const torch::Tensor& keep, const RingPair& pair, double scale,
                       bool math = false);

/// The gradients of one block pair recomputed from the merged `out` (q's dtype) and `lse` of the forward
/// (`keep` as for ring_attend_block):
/// adds the query gradient into `dq` [B, H, t, D] and returns the block's key and value gradients
/// ([B, Hkv, t, D] each, float32, zero outside the pair's columns).
std::pair<torch::Tensor, torch::Tensor> ring_block_backward(
    const torch::Tensor& grad_out, const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
    const torch::Tensor& out, const torch::Tensor& lse, const torch::Tensor& keep, const RingPair& pair,
    double scale, torch::Tensor& dq, bool math = false);

/// Ring attention over `group` (context parallelism, cp_comm_strategy "alltoall"): this rank's output
/// [B, H, t, D] from its `q` [B, H, t, D], `k`, `v` [B, Hkv, t, D] and `mask` (ring_mask_info's [B, 2,
/// size x t] as sequence_parallel_mask makes it, or undefined: causal only; UsageError naming the sizes for
/// anything else). Each block pair's mask is built when the pair is attended (forward and backward) and
/// dropped after it. Autograd function; collective over the group in forward and backward.
torch::Tensor ring_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                             const torch::Tensor& mask, Communicator& group, double scale);

}  // namespace accel::llm::detail
