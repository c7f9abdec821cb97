// Ring attention for context parallelism (cp_comm_strategy "alltoall"; PyTorch's _templated_ring_attention
// with _RotateMethod.ALL_TO_ALL and causal load balancing): each rank's key/value block travels the ring
// point to point while the block at hand is attended, partial outputs are merged by their log-sum-exp, and
// backward recomputes each block pair from the merged output and log-sum-exp while the key/value gradients
// travel the ring back to the rank that owns them.

#include <torch/torch.h>
#include <accel/distributed/communicator.hpp>
#include <accel/errors.hpp>
#include <accel/llm/models/sequence_parallel.hpp>

#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>

#include "llm/models/sequence_parallel_detail.hpp"

namespace accel::llm::detail {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Tags of the ring's messages (one per direction of traffic: blocks forward, their gradients back); every
// rank runs the layers in the same order, so messages of one tag pair up in order.
constexpr int kBlockTag = 52001;
constexpr int kGradTag = 52002;

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

// The pair's part of a block's boolean mask as SDPA's additive float mask of `dtype` (0 keep, -inf not).
torch::Tensor additive_mask(const torch::Tensor& keep, torch::ScalarType dtype) {
  return torch::zeros(keep.sizes(), keep.options().dtype(dtype)).masked_fill_(keep.logical_not(), kNegInf);
}

// One block pair's attention output (q's dtype) and log-sum-exp (float32, -inf on rows that see no key).
std::pair<torch::Tensor, torch::Tensor> block_forward(const torch::Tensor& q, const torch::Tensor& k,
                                                      const torch::Tensor& v, const torch::Tensor& keep,
                                                      bool causal, double scale, bool math) {
  const auto groups = q.size(1) / k.size(1);
  if (q.device().is_cpu() && !math) {
    // The flash kernel (grouped heads and strided rows allowed) returns the log-sum-exp; a row whose mask
    // hides every key gets output 0 and log-sum-exp 0, which the merge must see as -inf.
    std::optional<torch::Tensor> bias;
    if (keep.defined()) bias = additive_mask(keep, q.scalar_type());
    auto [out, lse] = at::_scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, bias, scale);
    lse = lse.to(torch::kFloat);
    if (keep.defined()) lse = lse.masked_fill(keep.any(-1).logical_not(), kNegInf);
    return {out, lse};
  }
  // Other devices: the scores of the pair in float32 (memory of one block pair, not of the sequence).
  const auto kr = groups > 1 ? k.repeat_interleave(groups, 1) : k;
  const auto vr = groups > 1 ? v.repeat_interleave(groups, 1) : v;
  auto scores = torch::matmul(q.to(torch::kFloat), kr.to(torch::kFloat).transpose(-2, -1)) * scale;
  if (causal) scores = scores.masked_fill(torch::ones_like(scores, torch::kBool).triu(1), kNegInf);
  if (keep.defined()) scores = scores.masked_fill(keep.logical_not(), kNegInf);
  const auto lse = torch::logsumexp(scores, -1);
  const auto p = torch::exp(scores - lse.masked_fill(lse.isinf(), 0).unsqueeze(-1));
  return {torch::matmul(p, vr.to(torch::kFloat)).to(q.scalar_type()), lse};
}

// The gradients (float32) of one block pair from the merged output and log-sum-exp.
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> block_backward(
    const torch::Tensor& grad_out, const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
    const torch::Tensor& out, const torch::Tensor& lse, const torch::Tensor& keep, bool causal, double scale,
    bool math) {
  const auto groups = q.size(1) / k.size(1);
  // Rows that saw no key anywhere (-inf) have probability 0 for every key: any finite value does.
  const auto safe_lse = lse.masked_fill(lse.isinf(), 0);
  if (q.device().is_cpu() && !math) {
    std::optional<torch::Tensor> bias;
    if (keep.defined()) bias = additive_mask(keep, q.scalar_type());
    auto [dq, dk, dv] = at::_scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out.contiguous(), q, k, v, out.contiguous(), safe_lse.contiguous(), 0.0, causal, bias, scale);
    return {dq.to(torch::kFloat), dk.to(torch::kFloat), dv.to(torch::kFloat)};
  }
  const auto kr = (groups > 1 ? k.repeat_interleave(groups, 1) : k).to(torch::kFloat);
  const auto vr = (groups > 1 ? v.repeat_interleave(groups, 1) : v).to(torch::kFloat);
  const auto qf = q.to(torch::kFloat), go = grad_out.to(torch::kFloat);
  auto scores = torch::matmul(qf, kr.transpose(-2, -1)) * scale;
  if (causal) scores = scores.masked_fill(torch::ones_like(scores, torch::kBool).triu(1), kNegInf);
  if (keep.defined()) scores = scores.masked_fill(keep.logical_not(), kNegInf);
  const auto p = torch::exp(scores - safe_lse.unsqueeze(-1));
  const auto delta = (go * out.to(torch::kFloat)).sum(-1, true);
  const auto ds = p * (torch::matmul(go, vr.transpose(-2, -1)) - delta);
  auto dq = torch::matmul(ds, kr) * scale;
  auto dk = torch::matmul(ds.transpose(-2, -1), qf) * scale;
  auto dv = torch::matmul(p.transpose(-2, -1), go);
  if (groups > 1) {
    auto fold = [&](const torch::Tensor& g) {
      return g.view({g.size(0), k.size(1), groups, g.size(2), g.size(3)}).sum(2);
    };
    dk = fold(dk);
    dv = fold(dv);
  }
  return {dq, dk, dv};
}

std::int64_t pointer_of(Communicator& group) {
  return static_cast<std::int64_t>(reinterpret_cast<std::intptr_t>(&group));
}

// The block of keys and values in flight: [k | v] flattened, sent to the next rank while the current one is
// attended. `step` posts the exchange (none after the last block), `advance` waits for it.
class Rotation {
 public:
  Rotation(Communicator& group, torch::Tensor block) : group_(group), block_(std::move(block)) {}
  void post(int step) {
    const int size = group_.world_size(), rank = group_.rank();
    if (step + 1 >= size) return;
    next_ = torch::empty_like(block_);
    send_ = group_.send_async(block_, (rank + 1) % size, kBlockTag);
    recv_ = group_.recv_async(next_, (rank + size - 1) % size, kBlockTag);
  }
  void advance() {
    if (!recv_) return;
    recv_->wait();
    send_->wait();
    recv_.reset();
    send_.reset();
    block_ = std::move(next_);
  }
  const torch::Tensor& block() const { return block_; }

 private:
  Communicator& group_;
  torch::Tensor block_, next_;
  std::unique_ptr<CollectiveHandle> send_, recv_;
};

// The boolean mask of this rank's block pair with `source` from the ring's mask information, built for the
// step at hand and dropped after it; none (causal only) when the information is empty.
torch::Tensor step_mask(const torch::Tensor& info, int rank, int source, int size, const RingPair& pair) {
  return info.numel() > 0 ? ring_block_mask(info, rank, source, size, pair) : torch::Tensor();
}

struct RingAttention : torch::autograd::Function<RingAttention> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v, const torch::Tensor& mask, std::int64_t group_pointer,
                               double scale) {
    auto& group = *reinterpret_cast<Communicator*>(static_cast<std::intptr_t>(group_pointer));
    const int size = group.world_size(), rank = group.rank();
    const auto length = q.size(2);
    auto state = ring_merge_start(q);
    Rotation ring(group, torch::cat({k.contiguous().flatten(), v.contiguous().flatten()}));
    for (int step = 0; step < size; ++step) {
      ring.post(step);  // the next block travels while this one is attended
      const int source = (rank + size - step) % size;
      const auto& block = ring.block();
      const auto kb = block.narrow(0, 0, k.numel()).view(k.sizes());
      const auto vb = block.narrow(0, k.numel(), v.numel()).view(v.sizes());
      const auto pair = ring_pair(rank, source, length);
      ring_attend_block(state, q, kb, vb, step_mask(mask, rank, source, size, pair), pair, scale);
      ring.advance();
    }
    auto out = state.out.to(q.scalar_type());
    ctx->save_for_backward({q, k, v, out, state.lse, mask});
    ctx->saved_data["group"] = group_pointer;
    ctx->saved_data["scale"] = scale;
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    const auto saved = ctx->get_saved_variables();
    const auto &q = saved[0], &k = saved[1], &v = saved[2], &out = saved[3], &lse = saved[4],
               &mask = saved[5];
    auto& group =
        *reinterpret_cast<Communicator*>(static_cast<std::intptr_t>(ctx->saved_data["group"].toInt()));
    const double scale = ctx->saved_data["scale"].toDouble();
    const int size = group.world_size(), rank = group.rank();
    const int next = (rank + 1) % size, previous = (rank + size - 1) % size;
    const auto length = q.size(2);
    const auto grad_out = grad[0].to(q.scalar_type());
    auto dq = torch::zeros(q.sizes(), q.options().dtype(torch::kFloat));
    Rotation ring(group, torch::cat({k.contiguous().flatten(), v.contiguous().flatten()}));
    // The gradient of the block at hand accumulates on each rank that attends it, then moves on with it.
    std::unique_ptr<CollectiveHandle> sent;
    torch::Tensor in_flight;
    for (int step = 0; step < size; ++step) {
      ring.post(step);
      torch::Tensor incoming;
      std::unique_ptr<CollectiveHandle> receiving;
      if (step > 0) {
        incoming = torch::empty({k.numel() + v.numel()}, q.options().dtype(torch::kFloat));
        receiving = group.recv_async(incoming, previous, kGradTag);
      }
      const int source = (rank + size - step) % size;
      const auto& block = ring.block();
      const auto kb = block.narrow(0, 0, k.numel()).view(k.sizes());
      const auto vb = block.narrow(0, k.numel(), v.numel()).view(v.sizes());
      const auto pair = ring_pair(rank, source, length);
      auto [dk, dv] = ring_block_backward(grad_out, q, kb, vb, out, lse,
                                          step_mask(mask, rank, source, size, pair), pair, scale, dq);
      auto total = torch::cat({dk.flatten(), dv.flatten()});
      if (receiving) {
        receiving->wait();
        total += incoming;
      }
      if (sent) sent->wait();  // the next rank received the previous gradient before this one leaves
      in_flight = std::move(total);
      sent = group.send_async(in_flight, next, kGradTag);
      ring.advance();
    }
    // After a full turn the gradient of this rank's own block comes back from the previous rank.
    auto own = torch::empty({k.numel() + v.numel()}, q.options().dtype(torch::kFloat));
    group.recv_async(own, previous, kGradTag)->wait();
    sent->wait();
    const auto dk = own.narrow(0, 0, k.numel()).view(k.sizes()).to(k.scalar_type());
    const auto dv = own.narrow(0, k.numel(), v.numel()).view(v.sizes()).to(v.scalar_type());
    return {dq.to(q.scalar_type()), dk, dv, torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

RingPair ring_pair(int rank, int source, std::int64_t length) {
  const std::int64_t half = length / 2;
  if (source == rank) return {0, length, 0, length, /*causal=*/true};
  if (source < rank) return {0, length, 0, half, false};  // its first chunk precedes both of this rank's
  return {half, length - half, 0, length, false};  // both its chunks precede only this rank's second one
}

RingMerge ring_merge_start(const torch::Tensor& q) {
  const auto opts = q.options().dtype(torch::kFloat);
  return {torch::zeros(q.sizes(), opts), torch::full({q.size(0), q.size(1), q.size(2)}, kNegInf, opts)};
}

torch::Tensor ring_mask_info(const torch::Tensor& is_key, const torch::Tensor& documents) {
  const auto doc = documents.defined() ? documents.to(torch::kLong) : torch::zeros_like(is_key, torch::kLong);
  return torch::stack({is_key.to(torch::kLong), doc.expand_as(is_key)}, 1);
}

torch::Tensor ring_block_mask(const torch::Tensor& info, int rank, int source, int size,
                              const RingPair& pair) {
  const auto total = info.size(2);
  const auto device = info.device();
  const auto rows = sequence_shard_index(total, rank, size, /*load_balanced=*/true)
                        .narrow(0, pair.q_begin, pair.q_length)
                        .to(device);
  const auto columns = sequence_shard_index(total, source, size, /*load_balanced=*/true)
                           .narrow(0, pair.k_begin, pair.k_length)
                           .to(device);
  const auto is_key = info.select(1, 0).index_select(1, columns).to(torch::kBool);  // [B, k]
  const auto documents = info.select(1, 1);
  const auto same_document =
      documents.index_select(1, rows).unsqueeze(-1).eq(documents.index_select(1, columns).unsqueeze(1));
  const auto causal = columns.view({1, 1, -1}) <= rows.view({1, -1, 1});  // global positions
  return (causal & is_key.unsqueeze(1) & same_document).unsqueeze(1);     // [B, 1, q, k]
}

void ring_attend_block(RingMerge& state, const torch::Tensor& q, const torch::Tensor& k,
                       const torch::Tensor& v, const torch::Tensor& keep, const RingPair& pair, double scale,
                       bool math) {
  const auto rows = q.narrow(2, pair.q_begin, pair.q_length);
  const auto kp = k.narrow(2, pair.k_begin, pair.k_length), vp = v.narrow(2, pair.k_begin, pair.k_length);
  const bool causal = pair.causal && !keep.defined();  // a mask already holds the causal part
  const auto [block_out, block_lse] = block_forward(rows, kp, vp, keep, causal, scale, math);
  auto out = state.out.narrow(2, pair.q_begin, pair.q_length);
  auto lse = state.lse.narrow(2, pair.q_begin, pair.q_length);
  // Online softmax: out = (e^lse out + e^block_lse block_out) / (e^lse + e^block_lse), shifted by the larger
  // log-sum-exp; rows that have seen no key yet (both -inf) stay 0 and -inf.
  const auto top = torch::maximum(lse, block_lse);
  const auto shift = top.masked_fill(top.isinf(), 0);
  const auto a = torch::exp(lse - shift), b = torch::exp(block_lse - shift);
  const auto sum = a + b;
  const auto merged = (out * a.unsqueeze(-1) + block_out.to(torch::kFloat) * b.unsqueeze(-1)) /
                      sum.clamp_min(std::numeric_limits<float>::min()).unsqueeze(-1);
  out.copy_(merged);
  lse.copy_(shift + torch::log(sum));
}

std::pair<torch::Tensor, torch::Tensor> ring_block_backward(const torch::Tensor& grad_out,
                                                            const torch::Tensor& q, const torch::Tensor& k,
                                                            const torch::Tensor& v, const torch::Tensor& out,
                                                            const torch::Tensor& lse,
                                                            const torch::Tensor& keep, const RingPair& pair,
                                                            double scale, torch::Tensor& dq, bool math) {
  auto dk = torch::zeros(k.sizes(), k.options().dtype(torch::kFloat));
  auto dv = torch::zeros(v.sizes(), v.options().dtype(torch::kFloat));
  const auto rows = [&](const torch::Tensor& x) { return x.narrow(2, pair.q_begin, pair.q_length); };
  const auto columns = [&](const torch::Tensor& x) { return x.narrow(2, pair.k_begin, pair.k_length); };
  const bool causal = pair.causal && !keep.defined();
  const auto [gq, gk, gv] = block_backward(rows(grad_out), rows(q), columns(k), columns(v), rows(out),
                                           rows(lse), keep, causal, scale, math);
  rows(dq).add_(gq);
  columns(dk).add_(gk);
  columns(dv).add_(gv);
  return {dk, dv};
}

torch::Tensor ring_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                             const torch::Tensor& mask, Communicator& group, double scale) {
  if (q.size(2) % 2 != 0) {
    throw UsageError("accel::llm::ring_attention: this rank's " + std::to_string(q.size(2)) +
                     " positions do not hold two equal chunks (context parallelism's load-balanced layout); "
                     "cut the sequence with shard_sequence");
  }
  const auto total = q.size(2) * group.world_size();
  if (mask.defined() &&
      (mask.dim() != 3 || mask.size(0) != q.size(0) || mask.size(1) != 2 || mask.size(2) != total)) {
    throw UsageError("accel::llm::ring_attention: mask of sizes " + torch::str(mask.sizes()) +
                     " is not the ring's mask information [batch " + std::to_string(q.size(0)) + ", 2, " +
                     std::to_string(total) + "] (ring_mask_info; sequence_parallel_mask makes it)");
  }
  // A custom Function's tensor inputs must be defined: no mask travels as an empty one.
  const auto m = mask.defined() ? mask : torch::empty({0}, q.options().dtype(torch::kBool));
  return RingAttention::apply(q, k, v, m, pointer_of(group), scale);
}

}  // namespace accel::llm::detail
