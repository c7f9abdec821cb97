#include <accel/errors.hpp>
#include <accel/parallel/parallel_attention.hpp>

#include <fmt/format.h>
#include <torch/torch.h>

#include <cmath>

namespace accel::tp {
namespace {

// Rows [first, first + rows) of `w` and `b` as a plain Linear, the full projection ColumnParallelLinear cuts.
torch::nn::Linear projection(const torch::Tensor& w, const torch::Tensor& b, std::int64_t first,
                             std::int64_t rows) {
  torch::NoGradGuard no_grad;
  torch::nn::Linear out(torch::nn::LinearOptions(w.size(1), rows).bias(b.defined()));
  out->to(w.device(), w.scalar_type());
  out->weight.copy_(w.narrow(0, first, rows));
  if (b.defined()) out->bias.copy_(b.narrow(0, first, rows));
  return out;
}

}  // namespace

ParallelMultiheadAttentionImpl::ParallelMultiheadAttentionImpl(const torch::nn::MultiheadAttention& full,
                                                               std::shared_ptr<Communicator> comm)
    : full_(full), options_(full->options), comm_(std::move(comm)) {
  reset();
  full_ = torch::nn::MultiheadAttention(nullptr);  // the full weights are not kept: only this rank's heads
}

void ParallelMultiheadAttentionImpl::reset() {
  // clone() calls reset() and then copies the values: a full layer of the same options is drawn for the
  // shapes.
  if (full_.is_empty()) full_ = torch::nn::MultiheadAttention(options_);
  const auto& o = full_->options;
  if (!comm_) throw UsageError("ParallelMultiheadAttention: the tensor-parallel communicator is null");
  if (!full_->_qkv_same_embed_dim || o.add_bias_kv() || o.add_zero_attn()) {
    throw UsageError(
        "ParallelMultiheadAttention: the MultiheadAttention uses kdim/vdim other than embed_dim, add_bias_kv "
        "or "
        "add_zero_attn, which are not supported; build it with the defaults for those");
  }
  embed_dim_ = o.embed_dim();
  heads_ = o.num_heads();
  dropout_ = o.dropout();
  const std::int64_t n = comm_->world_size();
  if (heads_ % n != 0) {
    throw UsageError(
        fmt::format("ParallelMultiheadAttention: {} heads cannot be split evenly over the {} ranks of the "
                    "tensor-parallel "
                    "group; use a number of heads divisible by {} (or another tensor_parallel_size)",
                    heads_, n, n));
  }
  local_heads_ = heads_ / n;
  first_head_ = comm_->rank() * local_heads_;
  // q, k and v are rows [0, E), [E, 2E), [2E, 3E) of the packed projection; ColumnParallelLinear then keeps
  // this rank's rows of each, which are its heads' (head h is rows [h * E / H, (h + 1) * E / H)).
  const auto& w = full_->in_proj_weight;
  const auto& b = full_->in_proj_bias;
  q_proj = register_module("q_proj", ColumnParallelLinear(projection(w, b, 0, embed_dim_), comm_));
  k_proj = register_module("k_proj", ColumnParallelLinear(projection(w, b, embed_dim_, embed_dim_), comm_));
  v_proj =
      register_module("v_proj", ColumnParallelLinear(projection(w, b, 2 * embed_dim_, embed_dim_), comm_));
  torch::nn::Linear out(
      torch::nn::LinearOptions(embed_dim_, embed_dim_).bias(full_->out_proj->bias.defined()));
  {
    torch::NoGradGuard no_grad;
    out->to(full_->out_proj->weight.device(), full_->out_proj->weight.scalar_type());
    out->weight.copy_(full_->out_proj->weight);
    if (out->bias.defined()) out->bias.copy_(full_->out_proj->bias);
  }
  out_proj = register_module("out_proj", RowParallelLinear(out, comm_, /*input_is_parallel=*/true));
}

torch::Tensor ParallelMultiheadAttentionImpl::forward(const torch::Tensor& query, const torch::Tensor& key,
                                                      const torch::Tensor& value,
                                                      const torch::Tensor& key_padding_mask,
                                                      const torch::Tensor& attn_mask) {
  if (query.dim() != 3 || key.dim() != 3 || value.dim() != 3 || query.size(2) != embed_dim_) {
    throw UsageError(fmt::format(
        "ParallelMultiheadAttention: query, key and value must be [sequence, batch, {}] (sequence first, as "
        "torch::nn::MultiheadAttention), got query of {} dimensions",
        embed_dim_, query.dim()));
  }
  const auto L = query.size(0), B = query.size(1), S = key.size(0);
  const auto d = embed_dim_ / heads_, h = local_heads_;
  // [L, B, h * d] -> [B * h, L, d], the layout of LibTorch's multi_head_attention_forward.
  auto heads = [&](const torch::Tensor& t, std::int64_t len) {
    return t.contiguous().view({len, B * h, d}).transpose(0, 1);
  };
  auto q = heads(q_proj(query), L) * (1.0 / std::sqrt(static_cast<double>(d)));
  auto k = heads(k_proj(key), S), v = heads(v_proj(value), S);
  auto scores = torch::bmm(q, k.transpose(1, 2));  // [B * h, L, S]
  if (attn_mask.defined()) {
    auto mask = attn_mask;
    if (mask.dim() == 3) {
      // [B * H, L, S]: this rank's heads of each batch element.
      mask = mask.view({B, heads_, L, S}).narrow(1, first_head_, h).reshape({B * h, L, S});
    } else {
      mask = mask.unsqueeze(0);
    }
    scores = mask.scalar_type() == torch::kBool ? scores.masked_fill(mask, -INFINITY) : scores + mask;
  }
  if (key_padding_mask.defined()) {
    const auto pad = key_padding_mask.to(torch::kBool).view({B, 1, 1, S});
    scores = scores.view({B, h, L, S}).masked_fill(pad, -INFINITY).view({B * h, L, S});
  }
  auto weights = torch::softmax(scores, -1);
  if (dropout_ > 0.0) weights = torch::dropout(weights, dropout_, is_training());
  auto out = torch::bmm(weights, v).transpose(0, 1).contiguous().view({L, B, h * d});  // this rank's heads
  return out_proj(out);
}

}  // namespace accel::tp
