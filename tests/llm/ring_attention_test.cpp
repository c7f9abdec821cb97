// Ring attention's block arithmetic (context parallelism with cp_comm_strategy "alltoall",
// accelerate_cpp/src/llm/models/ring_attention.cpp) on one process: every rank of a group of 2 or 3 is
// simulated in turn, attending its load-balanced queries to each rank's key/value block in ring order
// (ring_pair's block pairs, the causal ones skipped), merging by log-sum-exp (ring_attend_block), and
// recomputing each pair's gradients from the merged output (ring_block_backward). The merged outputs and
// the gradients of q, k and v, gathered back into global order, equal attention over the whole sequence:
// SDPA's causal path, and a float64 masked softmax for a padding + packed-documents mask (a row that sees no
// key at all included), whose per-pair masks the ring builds from O(T) information (ring_mask_info,
// ring_block_mask); with both kernels (CPU's flash attention, and the float32 matrix products other
// devices use), in float32 and bfloat16 (the merge in float32). The point-to-point exchange itself runs in
// sp_equivalence.py (cp3 / cp2 ring rows).
#include <torch/torch.h>
#include <accel/distributed/communicator.hpp>
#include <accel/distributed/process_state.hpp>
#include <accel/llm/models/sequence_parallel.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <vector>

#include "llm/models/sequence_parallel_detail.hpp"

namespace {

namespace llm = accel::llm;
namespace ring = accel::llm::detail;  // ring attention's internals

struct Grads {
  torch::Tensor out, dq, dk, dv;
};

// Random q [2, heads, total, dim], k and v [2, kv_heads, total, dim] and an output gradient, in `dtype`.
struct Inputs {
  torch::Tensor q, k, v, grad;
};
Inputs random_inputs(std::int64_t heads, std::int64_t kv_heads, std::int64_t dim, std::int64_t total,
                     torch::ScalarType dtype = torch::kFloat) {
  const std::int64_t batch = 2;
  return {torch::randn({batch, heads, total, dim}).to(dtype),
          torch::randn({batch, kv_heads, total, dim}).to(dtype),
          torch::randn({batch, kv_heads, total, dim}).to(dtype),
          torch::randn({batch, heads, total, dim}).to(dtype)};
}

// The ring's result on every simulated rank, put back in global order (float32, as the ring keeps its merge
// and gradients; the merged output rounded to q's dtype, as the ring returns and saves it). `info` is the
// ring's mask information [B, 2, T] (ring_mask_info; undefined: causal only); each rank builds every pair's
// mask from it as ring_attention does.
Grads simulate_ring(const Inputs& in, const torch::Tensor& info, int size, double scale, bool math) {
  const std::int64_t total = in.q.size(2), length = total / size;
  std::vector<torch::Tensor> index;
  for (int r = 0; r < size; ++r)
    index.push_back(llm::sequence_shard_index(total, r, size, /*load_balanced=*/true));
  const auto f32 = [](const torch::Tensor& x) { return torch::zeros(x.sizes(), torch::kFloat); };
  Grads g{f32(in.q), f32(in.q), f32(in.k), f32(in.v)};
  std::vector<torch::Tensor> local_out(static_cast<std::size_t>(size)), local_lse(local_out);
  auto local = [&](const torch::Tensor& x, int r) { return x.index_select(2, index[r]); };
  auto pair_mask = [&](int r, int source, const ring::RingPair& pair) {
    return info.defined() ? ring::ring_block_mask(info, r, source, size, pair) : torch::Tensor();
  };
  for (int r = 0; r < size; ++r) {
    const auto ql = local(in.q, r);
    auto state = ring::ring_merge_start(ql);
    for (int step = 0; step < size; ++step) {
      const int source = (r + size - step) % size;
      const auto pair = ring::ring_pair(r, source, length);
      ring::ring_attend_block(state, ql, local(in.k, source), local(in.v, source), pair_mask(r, source, pair),
                              pair, scale, math);
    }
    CHECK(state.out.scalar_type() == torch::kFloat);  // the merge runs in float32 whatever q's dtype
    CHECK(state.lse.scalar_type() == torch::kFloat);
    local_out[r] = state.out.to(ql.scalar_type());
    local_lse[r] = state.lse;
    g.out.index_copy_(2, index[r], local_out[r].to(torch::kFloat));
  }
  for (int r = 0; r < size; ++r) {
    const auto ql = local(in.q, r);
    auto dq = torch::zeros(ql.sizes(), torch::kFloat);
    for (int step = 0; step < size; ++step) {
      const int source = (r + size - step) % size;
      const auto pair = ring::ring_pair(r, source, length);
      const auto [dk, dv] = ring::ring_block_backward(local(in.grad, r), ql, local(in.k, source),
                                                      local(in.v, source), local_out[r], local_lse[r],
                                                      pair_mask(r, source, pair), pair, scale, dq, math);
      g.dk.index_add_(2, index[source], dk);
      g.dv.index_add_(2, index[source], dv);
    }
    g.dq.index_copy_(2, index[r], dq);
  }
  return g;
}

// Attention over the whole sequence in float64 with autograd: SDPA's causal path without a mask, else an
// explicit masked softmax (rows that see no key give 0, as the ring's merge does).
Grads reference(const Inputs& in, const torch::Tensor& keep, double scale) {
  auto qd = in.q.to(torch::kDouble).requires_grad_(), kd = in.k.to(torch::kDouble).requires_grad_(),
       vd = in.v.to(torch::kDouble).requires_grad_();
  const auto groups = in.q.size(1) / in.k.size(1);
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
  out.backward(in.grad.to(torch::kDouble));
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

// A padding + packed-documents mask over 2 rows of `total` positions: row 0 two packed documents, row 1 its
// first 3 positions padding (left padding: the rows of positions 0..2 see no key) and its last 5 too. `keep`
// [2, 1, T, T] (true = attend) for the reference, written out whole; `info` the ring's O(T) form of it.
struct PaddedPacked {
  torch::Tensor keep, info;
};
PaddedPacked padded_packed_mask(std::int64_t total) {
  const std::int64_t batch = 2;
  const auto pos = torch::arange(total);
  auto keep = (pos.view({1, -1}) <= pos.view({-1, 1})).view({1, 1, total, total}).repeat({batch, 1, 1, 1});
  const auto document = (pos >= total / 2 - 1).to(torch::kLong);
  keep[0].bitwise_and_(document.view({-1, 1}).eq(document.view({1, -1})));
  auto padding = torch::ones({total}, torch::kBool);
  padding.narrow(0, 0, 3).fill_(false);
  padding.narrow(0, total - 5, 5).fill_(false);
  keep[1].bitwise_and_(padding.view({1, 1, -1}));
  const auto is_key = torch::stack({torch::ones({total}, torch::kBool), padding});
  const auto documents = torch::stack({document, torch::zeros({total}, torch::kLong)});
  return {keep, ring::ring_mask_info(is_key, documents)};
}

}  // namespace

TEST_CASE("ring attention: block pairs merged by log-sum-exp equal causal attention over the whole sequence",
          "[llm][context_parallel]") {
  torch::manual_seed(5);
  const int size = GENERATE(2, 3);
  const bool math = GENERATE(false, true);  // CPU's flash kernel, and the float32 products of other devices
  const auto in = random_inputs(4, 2, 8, 2 * size * 5);
  const double scale = 0.4;
  INFO("group of " << size << (math ? ", matrix products" : ", flash kernel"));
  check_equal(simulate_ring(in, {}, size, scale, math), reference(in, {}, scale));
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
  const std::int64_t total = 2 * size * 4;
  const auto in = random_inputs(2, 1, 4, total);
  const auto mask = padded_packed_mask(total);
  INFO("group of " << size << (math ? ", matrix products" : ", flash kernel"));
  const auto result = simulate_ring(in, mask.info, size, 0.5, math);
  check_equal(result, reference(in, mask.keep, 0.5));
  CHECK(result.out[1].narrow(1, 0, 3).abs().max().item<double>() == 0.0);  // rows without a key: 0, no NaN
  CHECK(!result.dq.isnan().any().item<bool>());
  // Each pair's mask is the whole mask's block at the pair's rows and columns, built per pair (O(t^2)).
  const std::int64_t length = total / size;
  for (int r = 0; r < size; ++r) {
    for (int source = 0; source < size; ++source) {
      const auto pair = ring::ring_pair(r, source, length);
      const auto rows =
          llm::sequence_shard_index(total, r, size, true).narrow(0, pair.q_begin, pair.q_length);
      const auto columns =
          llm::sequence_shard_index(total, source, size, true).narrow(0, pair.k_begin, pair.k_length);
      const auto block = ring::ring_block_mask(mask.info, r, source, size, pair);
      CHECK(block.sizes() == torch::IntArrayRef({2, 1, pair.q_length, pair.k_length}));
      CHECK(block.equal(mask.keep.index_select(2, rows).index_select(3, columns)));
    }
  }
}

TEST_CASE("ring attention in bfloat16 (merge in float32) equals float32 attention within bfloat16's rounding",
          "[llm][context_parallel]") {
  torch::manual_seed(7);
  const int size = 3;  // every kind of block pair (own, lower, higher rank's); the float32 cases run 2 too
  const bool math = GENERATE(false, true);
  const bool masked = GENERATE(false, true);
  const std::int64_t total = 2 * size * 8;
  const auto in = random_inputs(4, 2, 16, total, torch::kBFloat16);
  const auto mask = masked ? padded_packed_mask(total) : PaddedPacked{};
  INFO("group of " << size << (math ? ", matrix products" : ", flash kernel") << (masked ? ", masked" : ""));
  // The reference: the same bfloat16 values attended over the whole sequence in float64, so that only the
  // ring's own bfloat16 rounding differs; the yardstick: the whole sequence's attention run in bfloat16 by
  // SDPA (its error is bfloat16's rounding of the output and of the kernel's steps). The ring may differ from
  // the reference by twice that, or one bfloat16 step (2^-8) of the largest value.
  const auto full = reference(in, mask.keep, 0.25);
  const auto ring_result = simulate_ring(in, mask.info, size, 0.25, math);
  auto qb = in.q.clone().requires_grad_(), kb = in.k.clone().requires_grad_(),
       vb = in.v.clone().requires_grad_();
  const auto keep = masked ? std::optional<torch::Tensor>(mask.keep) : std::nullopt;
  const auto one = torch::scaled_dot_product_attention(qb, kb, vb, keep, 0.0, !masked, 0.25, true);
  one.backward(in.grad);
  const auto bound = [](const torch::Tensor& sdpa, const torch::Tensor& ref) {
    const auto error = max_diff(sdpa.to(torch::kFloat).nan_to_num(), ref);  // rows without a key: NaN there
    return std::max(2 * error, std::ldexp(ref.abs().max().item<double>(), -8));
  };
  CHECK(max_diff(ring_result.out, full.out) <= bound(one, full.out));
  CHECK(max_diff(ring_result.dq, full.dq) <= bound(qb.grad(), full.dq));
  CHECK(max_diff(ring_result.dk, full.dk) <= bound(kb.grad(), full.dk));
  CHECK(max_diff(ring_result.dv, full.dv) <= bound(vb.grad(), full.dv));
  CHECK(!ring_result.dq.isnan().any().item<bool>());
}

TEST_CASE("ring attention: sequence_parallel_mask's O(T) information gives the all-gathered path's mask",
          "[llm][context_parallel]") {
  // A group of one (no peer here): the ring's information ([B, 2, T]) and, built from it, the whole block
  // pair's mask equal the [B, 1, t, T] mask context parallelism with all-gathered keys uses; padding from
  // the attention mask, packed documents from positions restarting.
  auto solo = accel::Communicator::create(accel::ProcessState(), torch::kCPU);
  const ring::SequenceParallelism gathered{solo, /*context=*/true, /*ring=*/false};
  const ring::SequenceParallelism ringed{solo, /*context=*/true, /*ring=*/true};
  const std::int64_t total = 12;
  auto padding = torch::ones({2, total}, torch::kLong);
  padding[1].narrow(0, 0, 3).zero_();
  const auto packed = torch::cat({torch::arange(5), torch::arange(7)}).view({1, -1}).repeat({2, 1});
  const auto causal_only =
      ring::sequence_parallel_mask(ringed, {}, torch::arange(total).view({1, -1}), 2, nullptr);
  CHECK(!causal_only.defined());
  for (const auto& [attention_mask, positions] :
       {std::pair{padding, torch::arange(total).view({1, -1})}, std::pair{torch::Tensor(), packed}}) {
    const auto full = ring::sequence_parallel_mask(gathered, attention_mask, positions, 2, nullptr);
    const auto info = ring::sequence_parallel_mask(ringed, attention_mask, positions, 2, nullptr);
    CHECK(info.sizes() == torch::IntArrayRef({2, 2, total}));
    CHECK(ring::ring_block_mask(info, 0, 0, 1, ring::ring_pair(0, 0, total)).equal(full));
  }
}
