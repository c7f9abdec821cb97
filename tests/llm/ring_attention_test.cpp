// Ring attention's block arithmetic (context parallelism with cp_comm_strategy "alltoall",
// accelerate_cpp/src/llm/models/ring_attention.cpp) on one process: every rank of a group of 2 or 3 is
// simulated in turn, attending its load-balanced queries to each rank's key/value block in ring order
// (ring_pair's block pairs, the causal ones skipped), merging by log-sum-exp (ring_attend_block), and
// recomputing each pair's gradients from the merged output (ring_block_backward). The merged outputs and
// the gradients of q, k and v, gathered back into global order, equal attention over the whole sequence:
// SDPA's causal path, and a float64 masked softmax for a padding + packed-documents mask (a row that sees no
// key at all included); with both kernels (CPU's flash attention, and the float32 matrix products other
// devices use). The point-to-point exchange itself runs in sp_equivalence.py (cp3 / cp2 ring rows).
#include <torch/torch.h>
#include <accel/llm/models/sequence_parallel.hpp>

#include <catch2/catch.hpp>

#include <cstdint>
#include <limits>
#include <vector>

#include "llm/models/sequence_parallel_detail.hpp"

namespace {

namespace llm = accel::llm;
namespace ring = accel::llm::detail;  // ring attention's internals

struct Grads {
  torch::Tensor out, dq, dk, dv;
};

// The ring's result on every simulated rank, put back in global order. `keep` [B, 1, T, T] in global order
// (undefined: causal only); each rank sees it as sequence_parallel_mask makes it: its query rows, the keys
// in the group's order (rank after rank, each its load-balanced positions).
Grads simulate_ring(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                    const torch::Tensor& grad, const torch::Tensor& keep, int size, double scale, bool math) {
  const std::int64_t total = q.size(2), length = total / size;
  std::vector<torch::Tensor> index;
  for (int r = 0; r < size; ++r)
    index.push_back(llm::sequence_shard_index(total, r, size, /*load_balanced=*/true));
  const auto key_order = torch::cat(index);
  Grads g{torch::zeros_like(q), torch::zeros_like(q), torch::zeros_like(k), torch::zeros_like(v)};
  std::vector<torch::Tensor> local_out(static_cast<std::size_t>(size)), local_lse(local_out);
  auto local = [&](const torch::Tensor& x, int r) { return x.index_select(2, index[r]); };
  auto rank_mask = [&](int r) {
    return keep.defined() ? keep.index_select(2, index[r]).index_select(3, key_order) : torch::Tensor();
  };
  auto source_mask = [&](const torch::Tensor& m, int source) {
    return m.defined() ? m.narrow(3, source * length, length) : torch::Tensor();
  };
  for (int r = 0; r < size; ++r) {
    const auto ql = local(q, r), mask = rank_mask(r);
    ring::RingMerge state{
        torch::zeros(ql.sizes(), ql.options()),
        torch::full({q.size(0), q.size(1), length}, -std::numeric_limits<float>::infinity(), q.options())};
    for (int step = 0; step < size; ++step) {
      const int source = (r + size - step) % size;
      ring::ring_attend_block(state, ql, local(k, source), local(v, source), source_mask(mask, source),
                              ring::ring_pair(r, source, length), scale, math);
    }
    local_out[r] = state.out;
    local_lse[r] = state.lse;
    g.out.index_copy_(2, index[r], state.out);
  }
  for (int r = 0; r < size; ++r) {
    const auto ql = local(q, r), mask = rank_mask(r);
    auto dq = torch::zeros_like(ql);
    for (int step = 0; step < size; ++step) {
      const int source = (r + size - step) % size;
      const auto [dk, dv] = ring::ring_block_backward(local(grad, r), ql, local(k, source), local(v, source),
                                                      local_out[r], local_lse[r], source_mask(mask, source),
                                                      ring::ring_pair(r, source, length), scale, dq, math);
      g.dk.index_add_(2, index[source], dk);
      g.dv.index_add_(2, index[source], dv);
    }
    g.dq.index_copy_(2, index[r], dq);
  }
  return g;
}

// Attention over the whole sequence in float64 with autograd: SDPA's causal path without a mask, else an
// explicit masked softmax (rows that see no key give 0, as the ring's merge does).
Grads reference(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                const torch::Tensor& grad, const torch::Tensor& keep, double scale) {
  auto qd = q.to(torch::kDouble).requires_grad_(), kd = k.to(torch::kDouble).requires_grad_(),
       vd = v.to(torch::kDouble).requires_grad_();
  const auto groups = q.size(1) / k.size(1);
  torch::Tensor out;
  if (!keep.defined()) {
    out = torch::scaled_dot_product_attention(qd, kd, vd, {}, 0.0, true, scale, /*enable_gqa=*/true);
  } else {
    const auto kr = kd.repeat_interleave(groups, 1), vr = vd.repeat_interleave(groups, 1);
    const auto scores = torch::matmul(qd, kr.transpose(-2, -1)) * scale;
    const auto shifted = scores - std::get<0>(scores.max(-1, true)).detach();
    const auto weights = torch::exp(shifted) * keep.to(torch::kDouble);
    const auto p = weights / weights.sum(-1, true).clamp_min(1e-300);
    out = torch::matmul(p, vr);
  }
  out.backward(grad.to(torch::kDouble));
  return {out.detach().to(torch::kFloat), qd.grad().to(torch::kFloat), kd.grad().to(torch::kFloat),
          vd.grad().to(torch::kFloat)};
}

double max_diff(const torch::Tensor& a, const torch::Tensor& b) {
  return (a - b).abs().max().item<double>();
}

void check_equal(const Grads& ring, const Grads& full) {
  CHECK(max_diff(ring.out, full.out) < 2e-5);
  CHECK(max_diff(ring.dq, full.dq) < 2e-5);
  CHECK(max_diff(ring.dk, full.dk) < 2e-5);
  CHECK(max_diff(ring.dv, full.dv) < 2e-5);
  CHECK(ring.dk.abs().sum().item<double>() > 0);
}

}  // namespace

TEST_CASE("ring attention: block pairs merged by log-sum-exp equal causal attention over the whole sequence",
          "[llm][context_parallel]") {
  torch::manual_seed(5);
  const int size = GENERATE(2, 3);
  const bool math = GENERATE(false, true);  // CPU's flash kernel, and the float32 products of other devices
  const std::int64_t batch = 2, heads = 4, kv_heads = 2, dim = 8, total = 2 * size * 5;
  const auto q = torch::randn({batch, heads, total, dim}), k = torch::randn({batch, kv_heads, total, dim}),
             v = torch::randn({batch, kv_heads, total, dim}), grad = torch::randn({batch, heads, total, dim});
  const double scale = 0.4;
  INFO("group of " << size << (math ? ", matrix products" : ", flash kernel"));
  check_equal(simulate_ring(q, k, v, grad, {}, size, scale, math), reference(q, k, v, grad, {}, scale));
  // The pairs ring_pair skips are exactly the causally hidden ones: a rank's own block causal, a lower
  // rank's first chunk and a higher rank's whole block to the second chunk only.
  CHECK(ring::ring_pair(1, 1, 10).causal);
  CHECK((ring::ring_pair(1, 0, 10).k_length == 5 && ring::ring_pair(1, 0, 10).q_length == 10));
  CHECK((ring::ring_pair(0, 1, 10).q_begin == 5 && ring::ring_pair(0, 1, 10).k_length == 10));
}

TEST_CASE(
    "ring attention: a padding and packed-documents mask, with a row that sees no key, equals the "
    "masked softmax over the whole sequence",
    "[llm][context_parallel]") {
  torch::manual_seed(6);
  const int size = GENERATE(2, 3);
  const bool math = GENERATE(false, true);  // CPU's flash kernel, and the float32 products of other devices
  const std::int64_t batch = 2, heads = 2, kv_heads = 1, dim = 4, total = 2 * size * 4;
  const auto q = torch::randn({batch, heads, total, dim}), k = torch::randn({batch, kv_heads, total, dim}),
             v = torch::randn({batch, kv_heads, total, dim}), grad = torch::randn({batch, heads, total, dim});
  const auto pos = torch::arange(total);
  auto keep = (pos.view({1, -1}) <= pos.view({-1, 1})).view({1, 1, total, total}).repeat({batch, 1, 1, 1});
  // Row 0: two packed documents; row 1: its first 3 positions padding (left padding: position 0..2's rows
  // see no key) and its last 5 too.
  const auto document = (pos >= total / 2 - 1).to(torch::kLong);
  keep[0].bitwise_and_(document.view({-1, 1}).eq(document.view({1, -1})));
  auto padding = torch::ones({total}, torch::kBool);
  padding.narrow(0, 0, 3).fill_(false);
  padding.narrow(0, total - 5, 5).fill_(false);
  keep[1].bitwise_and_(padding.view({1, 1, -1}));
  INFO("group of " << size << (math ? ", matrix products" : ", flash kernel"));
  const auto result = simulate_ring(q, k, v, grad, keep, size, 0.5, math);
  check_equal(result, reference(q, k, v, grad, keep, 0.5));
  CHECK(result.out[1].narrow(1, 0, 3).abs().max().item<double>() == 0.0);  // rows without a key: 0, no NaN
  CHECK(!result.dq.isnan().any().item<bool>());
}
