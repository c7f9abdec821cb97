// What the two chunked linear + cross-entropy losses share (fused_linear_cross_entropy.cpp over the whole
// vocabulary, vocab_parallel_loss.cpp over a tensor-parallel group's slices): the chunk sizes, the shifted
// labels, the sums each chunk adds to, and handing the gradients computed in forward over to autograd.
#pragma once

#include <accel/errors.hpp>

#include "llm/models/fused_layer_ops.hpp"

#include <ATen/autocast_mode.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>

namespace accel::llm::detail {

// float32 logits per chunk when chunk_tokens is 0. Small chunks are slow on a CPU (measured on Qwen2.5-0.5B's
// 151,936 x 896 head, 1,024 tokens: 55-token chunks took 1.8x the unfused loss's CPU time with a frozen head,
// 256-token ones 1.3x, one chunk 1.0x), and the weight gradient's addmm reads and writes the whole [V, H]
// accumulator once per chunk: 256 MiB keeps a few chunks per sequence while the logits stay a fraction.
constexpr std::int64_t kAutoChunkBytes = 256LL << 20;
constexpr std::int64_t kMinAutoChunk = 16;

/// The requested rows per chunk, or the automatic target for a head of `vocab` rows (this rank's).
inline std::int64_t chunk_rows(std::int64_t requested, std::int64_t vocab) {
  if (requested > 0) return requested;
  return std::max(kMinAutoChunk, kAutoChunkBytes / (vocab * static_cast<std::int64_t>(sizeof(float))));
}

/// The rows of each chunk for `counted` tokens. A requested size is kept (the last chunk takes the rest). The
/// automatic size is a target: the tokens go in equal chunks of at most 1.25 x it, so that no small tail
/// chunk is left (each chunk packs the whole [V, H] weight for its two matmuls: at 512 tokens and Qwen's
/// vocabulary, 441 + 70 rows cost two packings of the 545 MB head and a 70-row matmul; one chunk of 511 rows
/// holds 311 MB of logits).
inline std::int64_t balanced_rows(std::int64_t requested, std::int64_t target, std::int64_t counted) {
  if (requested > 0 || counted <= 0) return target;
  const std::int64_t most = target + target / 4;
  const std::int64_t chunks = (counted + most - 1) / most;
  return (counted + chunks - 1) / chunks;
}

/// labels[t + 1] for position t, ignore_index after each row's last position, flattened (ForCausalLMLoss).
inline torch::Tensor shifted_labels(const torch::Tensor& labels, std::int64_t ignore_index,
                                    torch::Device device) {
  return torch::constant_pad_nd(labels, {0, 1}, ignore_index).slice(1, 1).contiguous().view(-1).to(device);
}

/// Refuses a counted label outside [0, vocab): `fn` names the function, `note` says what `vocab` is.
inline void check_label_range(const std::string& fn, const torch::Tensor& targets, std::int64_t vocab,
                              std::int64_t ignore_index, const std::string& note = "") {
  if (targets.numel() == 0) return;
  const auto lo = targets.min().item<std::int64_t>(), hi = targets.max().item<std::int64_t>();
  if (lo < 0 || hi >= vocab)
    throw UsageError("accel::llm::" + fn + ": label " + std::to_string(lo < 0 ? lo : hi) +
                     " is outside the vocabulary [0, " + std::to_string(vocab) + ")" + note +
                     " and is not the ignore index " + std::to_string(ignore_index));
}

/// The dtype the head's matmuls run in: autocast's while it is on for `hidden`'s device (mixed_precision
/// bf16 / fp16 over float32 master weights: what torch::linear and mm do there, so the unfused path's lm_head
/// under autocast), else the inputs' own.
inline c10::ScalarType compute_dtype(const torch::Tensor& hidden) {
  const auto type = hidden.device().type();
  if (at::autocast::is_autocast_enabled(type) && at::autocast::is_autocast_eligible(hidden, type))
    return at::autocast::get_autocast_dtype(type);
  return hidden.scalar_type();
}

/// What the chunks add to: the summed token losses and the gradients (undefined where not needed).
struct ChunkSums {
  torch::Tensor loss;         // float32 scalar
  torch::Tensor grad_hidden;  // [N, H] in hidden's dtype (not the compute dtype under autocast)
  torch::Tensor grad_weight;  // [V, H] (this rank's rows) float32 accumulator

  ChunkSums(const torch::Tensor& flat, const torch::Tensor& weight, bool need_hidden, bool need_weight)
      : loss(torch::zeros({}, flat.options().dtype(torch::kFloat32))) {
    if (need_hidden) grad_hidden = torch::zeros_like(flat, torch::MemoryFormat::Contiguous);
    if (need_weight) grad_weight = torch::zeros(weight.sizes(), weight.options().dtype(torch::kFloat32));
  }
  bool needs_gradients() const { return grad_hidden.defined() || grad_weight.defined(); }

  /// Adds one chunk's d loss / d logits (float32 [c, V]) to the gradients: `rows` of the flat hidden states,
  /// `hc` their values and `weight` the head, both in the compute dtype. As the unfused backward under
  /// autocast: the products in the compute dtype, then cast to the input's dtype (the autocast cast's
  /// backward). The hidden states' g W by detail::linear_input_grad (oneDNN in float32 on the CPU, else mm),
  /// the weight's g^T hc by MKL's addmm (oneDNN is not faster there).
  void add_gradients(const torch::Tensor& grad_logits, const torch::Tensor& rows, const torch::Tensor& hc,
                     const torch::Tensor& weight) {
    const auto g = grad_logits.to(hc.scalar_type());  // the upcast's backward
    if (grad_hidden.defined())
      grad_hidden.index_copy_(0, rows, linear_input_grad(g, weight).to(grad_hidden.scalar_type()));
    if (grad_weight.defined()) {
      if (grad_weight.scalar_type() == g.scalar_type()) {
        grad_weight.addmm_(g.t(), hc);
      } else {
        grad_weight.add_(g.t().mm(hc));
      }
    }
  }

  /// Keeps the gradients in `ctx` for backward (hand_over_gradients) in the inputs' shapes and dtypes.
  void keep(torch::autograd::AutogradContext* ctx, const torch::Tensor& hidden, const torch::Tensor& weight) {
    if (grad_hidden.defined()) ctx->saved_data["grad_hidden"] = grad_hidden.view(hidden.sizes());
    if (grad_weight.defined()) ctx->saved_data["grad_weight"] = grad_weight.to(weight.scalar_type());
    ctx->saved_data["taken"] = false;
  }
};

/// The forward both fused losses share. Only the counted positions (shifted label other than ignore_index)
/// reach the head: prompt tokens under completion-only / assistant-only loss and padding get no logits, no
/// softmax and no share of either gradient matmul, so the head's FLOPs follow the counted labels. `check`
/// sees their labels; `add(sums, rows, hidden_rows, head, targets, denominator)` adds one chunk,
/// `hidden_rows` and `head` (the weight) in compute_dtype: under autocast the head is cast once here, as
/// autocast casts the unfused lm_head's weight, and the gradients go back in each input's dtype. The chunks
/// are the same on every rank of a group (the same labels, the same slice width): collectives inside `add`
/// pair up. Returns the summed losses / the denominator (NaN for a mean over no label, as cross_entropy).
template <typename Check, typename AddChunk>
torch::Tensor chunked_forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& hidden,
                              const torch::Tensor& weight, const torch::Tensor& labels, double denominator,
                              std::int64_t chunk, std::int64_t ignore_index, bool need_hidden,
                              bool need_weight, const Check& check, const AddChunk& add) {
  const auto flat = hidden.reshape({-1, hidden.size(-1)});
  const auto shifted = shifted_labels(labels, ignore_index, hidden.device());
  const auto rows = shifted.ne(ignore_index).nonzero().view(-1);
  const auto targets = shifted.index_select(0, rows);
  check(targets);
  const auto counted = rows.numel();
  const double denom = denominator < 0 ? static_cast<double>(counted) : denominator;
  ChunkSums s(flat, weight, need_hidden, need_weight);
  const auto dtype = compute_dtype(hidden);
  const auto head = weight.to(dtype);  // no copy outside autocast
  chunk = balanced_rows(chunk, chunk_rows(chunk, weight.size(0)), counted);
  for (std::int64_t start = 0; start < counted; start += chunk) {
    const auto r = rows.slice(0, start, std::min(counted, start + chunk));
    add(s, r, flat.index_select(0, r).to(dtype), head, targets.slice(0, start, start + r.numel()), denom);
  }
  s.keep(ctx, hidden, weight);
  if (counted == 0 && denominator < 0)
    return torch::full({}, std::numeric_limits<float>::quiet_NaN(), s.loss.options());
  return s.loss.div_(denom);
}

/// The backward of a loss whose gradients were computed in forward: {d hidden, d weight} scaled by the
/// incoming gradient, then `others` undefined gradients. A second backward is refused (`what` names the
/// function and the unfused alternative).
inline torch::autograd::variable_list hand_over_gradients(torch::autograd::AutogradContext* ctx,
                                                          const torch::Tensor& go, std::size_t others,
                                                          const std::string& what) {
  if (ctx->saved_data["taken"].toBool()) throw UsageError(what);
  ctx->saved_data["taken"] = true;
  const bool unit = go.device().is_cpu() && go.item<double>() == 1.0;
  auto take = [&](const char* key) {
    if (!ctx->saved_data.count(key)) return torch::Tensor();
    auto t = ctx->saved_data[key].toTensor();
    ctx->saved_data[key] = torch::Tensor();  // the gradient can become the parameter's .grad without a copy
    return unit ? t : t.mul_(go.to(t.scalar_type()));
  };
  torch::autograd::variable_list out{take("grad_hidden"), take("grad_weight")};
  out.resize(2 + others);
  return out;
}

}  // namespace accel::llm::detail
