#include "accel/llm/models/sequence_parallel.hpp"

#include <torch/torch.h>
#include <accel/distributed/communicator.hpp>
#include <accel/errors.hpp>

#include <cstdint>
#include <string>

#include "llm/models/sequence_parallel_detail.hpp"

namespace accel::llm {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

std::int64_t pointer_of(Communicator& group) {
  return static_cast<std::int64_t>(reinterpret_cast<std::intptr_t>(&group));
}
Communicator& group_of(AutogradContext* ctx) {
  return *reinterpret_cast<Communicator*>(static_cast<std::intptr_t>(ctx->saved_data["group"].toInt()));
}

struct AllToAll : torch::autograd::Function<AllToAll> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, std::int64_t group) {
    ctx->saved_data["group"] = group;
    return reinterpret_cast<Communicator*>(static_cast<std::intptr_t>(group))->all_to_all(x.contiguous());
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    return {group_of(ctx).all_to_all(grad[0].contiguous()), torch::Tensor()};
  }
};

struct AllGather : torch::autograd::Function<AllGather> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, std::int64_t group) {
    ctx->saved_data["group"] = group;
    ctx->saved_data["sizes"] = x.sizes().vec();
    return reinterpret_cast<Communicator*>(static_cast<std::intptr_t>(group))->all_gather(x.contiguous());
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    const auto sizes = ctx->saved_data["sizes"].toIntVector();
    auto part = group_of(ctx).reduce_scatter(grad[0].contiguous(), ReduceOp::Sum);
    return {part.reshape(sizes), torch::Tensor()};
  }
};

struct AllReduceSum : torch::autograd::Function<AllReduceSum> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, std::int64_t group) {
    ctx->saved_data["group"] = group;
    auto out = x.clone();
    reinterpret_cast<Communicator*>(static_cast<std::intptr_t>(group))->all_reduce(out, ReduceOp::Sum);
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    auto g = grad[0].clone();
    group_of(ctx).all_reduce(g, ReduceOp::Sum);
    return {g, torch::Tensor()};
  }
};

// [B, t] pieces of every rank of the group side by side, in rank order: [B, size x t].
torch::Tensor gather_columns(const torch::Tensor& x, Communicator& group) {
  const auto all = group.all_gather(x.contiguous().unsqueeze(0));  // [size, B, t]
  return all.permute({1, 0, 2}).reshape({x.size(0), -1});
}

// Which document each position of a packed row belongs to (transformers' find_packed_sequence_indices, as
// causal_lm.cpp computes it for one process), or undefined when every row holds one.
torch::Tensor packed_documents(const torch::Tensor& pos) {
  const auto diff = torch::diff(pos, 1, -1, pos.narrow(-1, 0, 1) - 1);
  const auto indices = diff.ne(1).cumsum(-1);
  if (indices.select(-1, -1).eq(0).all().item<bool>()) return {};
  return indices;
}

void enable(CausalLMImpl& model, std::shared_ptr<Communicator> group, bool context, bool ring) {
  detail::SequenceParallelism s;
  const auto& c = model.config();
  for (std::int64_t i = 0; group && i < c.num_hidden_layers; ++i) {  // any group size: refused early
    if (c.is_sliding_layer(i))
      throw UsageError(std::string("accel::llm::") +
                       (context ? "enable_context_parallel" : "enable_sequence_parallel") + ": layer " +
                       std::to_string(i) +
                       " attends through a sliding window (config.json use_sliding_window "
                       "true, sliding_window " +
                       std::to_string(*c.sliding_window) +
                       "), which sequence / context parallel attention does not implement; train it "
                       "without parallelism_config_sp_size / parallelism_config_cp_size (or with "
                       "use_sliding_window false, which changes the model)");
  }
  if (group && group->world_size() > 1) {
    s.group = std::move(group);
    s.context = context;
    s.ring = ring;
  }
  model.model->set_sequence_parallelism(s);
  for (const auto& module : model.modules(/*include_self=*/false))
    if (auto* attention = dynamic_cast<AttentionImpl*>(module.get())) attention->set_sequence_parallelism(s);
}

}  // namespace

torch::Tensor sequence_shard_index(std::int64_t length, int rank, int size, bool load_balanced) {
  const auto opts = torch::TensorOptions().dtype(torch::kInt64);
  const std::int64_t pieces = load_balanced ? 2 * size : size;
  if (size < 1 || rank < 0 || rank >= size || length % pieces != 0) {
    throw UsageError("accel::llm::sequence_shard_index: a sequence of " + std::to_string(length) +
                     " positions does not cut into " + std::to_string(pieces) + " equal chunks (rank " +
                     std::to_string(rank) + " of " + std::to_string(size) +
                     "); pad it to a multiple (shard_sequence does)");
  }
  const std::int64_t chunk = length / pieces;
  if (!load_balanced) return torch::arange(rank * chunk, (rank + 1) * chunk, opts);
  return torch::cat({torch::arange(rank * chunk, (rank + 1) * chunk, opts),
                     torch::arange((pieces - 1 - rank) * chunk, (pieces - rank) * chunk, opts)});
}

void enable_sequence_parallel(CausalLMImpl& model, std::shared_ptr<Communicator> group) {
  const auto& c = model.config();
  if (group && group->world_size() > 1 &&
      (c.num_attention_heads % group->world_size() != 0 ||
       c.num_key_value_heads % group->world_size() != 0)) {
    throw UsageError("accel::llm::enable_sequence_parallel: num_attention_heads " +
                     std::to_string(c.num_attention_heads) + " and num_key_value_heads " +
                     std::to_string(c.num_key_value_heads) +
                     " must both be divisible by the sequence-parallel "
                     "size " +
                     std::to_string(group->world_size()) +
                     " (Ulysses gives each rank that share of the heads); choose parallelism_config_sp_size "
                     "dividing both, or use parallelism_config_cp_size");
  }
  enable(model, std::move(group), /*context=*/false, /*ring=*/false);
}

void enable_context_parallel(CausalLMImpl& model, std::shared_ptr<Communicator> group,
                             const std::string& comm_strategy) {
  if (comm_strategy != "allgather" && comm_strategy != "alltoall") {
    throw UsageError(
        "accel::llm::enable_context_parallel: comm_strategy '" + comm_strategy +
        "' is not one of allgather (K/V all-gathered) or alltoall (ring attention), the values of "
        "Accelerate's parallelism_config_cp_comm_strategy");
  }
  enable(model, std::move(group), /*context=*/true, /*ring=*/comm_strategy == "alltoall");
}

namespace detail {

torch::Tensor all_to_all(const torch::Tensor& x, Communicator& group) {
  return AllToAll::apply(x, pointer_of(group));
}
torch::Tensor all_gather(const torch::Tensor& x, Communicator& group) {
  return AllGather::apply(x, pointer_of(group));
}
torch::Tensor all_reduce_sum(const torch::Tensor& x, Communicator& group) {
  return AllReduceSum::apply(x, pointer_of(group));
}

torch::Tensor sequence_parallel_mask(const SequenceParallelism& s, const torch::Tensor& attention_mask,
                                     const torch::Tensor& positions, std::int64_t batch,
                                     const KVCache* cache) {
  if (cache != nullptr) {
    throw UsageError(
        "accel::llm: a KV cache (generation) with sequence or context parallelism enabled; generate with a "
        "model without it (enable_sequence_parallel(model, nullptr) disables it)");
  }
  Communicator& group = *s.group;
  const int size = group.world_size();
  const auto device = positions.device();
  const auto local = positions.size(0) == batch ? positions : positions.expand({batch, -1});
  const std::int64_t total = local.size(1) * size;
  // The keys' global positions in the order the group's all-gather holds them, and this rank's queries.
  std::vector<torch::Tensor> order;
  for (int r = 0; r < size; ++r)
    order.push_back(sequence_shard_index(total, r, size, s.context));
  const auto keys = torch::cat(order).to(device);
  const auto gathered_pos = gather_columns(local, group);                               // [B, T] in key order
  const auto pos = torch::empty_like(gathered_pos).index_copy_(1, keys, gathered_pos);  // global order
  const auto queries = s.context ? order[static_cast<std::size_t>(group.rank())].to(device) : keys;
  torch::Tensor padding =
      attention_mask.defined() ? gather_columns(attention_mask.to(device), group) : torch::Tensor();
  const bool padded = padding.defined() && !padding.to(torch::kBool).all().item<bool>();
  const auto documents = attention_mask.defined() ? torch::Tensor() : packed_documents(pos);
  if (!padded && !documents.defined()) return {};  // causal only: SDPA's causal flag (see the attention)
  if (s.ring) {  // O(T): each block pair's mask is built from it when the pair is attended
    const auto is_key = padded ? torch::empty_like(padding).index_copy_(1, keys, padding)  // global order
                               : torch::ones_like(pos);
    return ring_mask_info(is_key, documents);
  }
  // Ulysses: queries and keys in global order (keys == 0..T-1); context: this rank's queries, keys gathered.
  auto mask = (keys.view({1, -1}) <= queries.view({-1, 1})).view({1, 1, queries.size(0), total});
  if (padded) mask = mask & padding.to(torch::kBool).view({batch, 1, 1, total});
  if (documents.defined()) {
    const auto dq = documents.index_select(1, queries), dk = documents.index_select(1, keys);
    mask = mask & dq.unsqueeze(-1).eq(dk.unsqueeze(-2)).unsqueeze(1);
  }
  return mask.expand({batch, 1, queries.size(0), total});
}

namespace {

// Context parallelism without padding or packed documents: each of this rank's two chunks (global chunk c of
// length L) attends to the keys [0, (c + 1) L) causally, which is SDPA's causal flag (aligned top-left) once
// c L rows of zeros stand before the chunk's queries: no [t, T] mask to convert and keep per layer (the
// masked kernel keeps a float copy of it for backward), at the price of computing the zero rows.
torch::Tensor context_causal_attention(const SequenceParallelism& s, const torch::Tensor& q,
                                       const torch::Tensor& kf, const torch::Tensor& vf, std::int64_t groups,
                                       double scale) {
  Communicator& group = *s.group;
  const int size = group.world_size();
  const auto batch = q.size(0), heads = q.size(1), length = q.size(2), dim = q.size(3);
  const std::int64_t total = kf.size(2), chunk = length / 2;
  std::vector<torch::Tensor> order;
  for (int r = 0; r < size; ++r)
    order.push_back(sequence_shard_index(total, r, size, /*load_balanced=*/true));
  const auto to_global = torch::argsort(torch::cat(order)).to(q.device());
  const auto k = kf.index_select(2, to_global), v = vf.index_select(2, to_global);
  const std::int64_t chunks[2] = {group.rank(), 2 * size - 1 - group.rank()};
  std::vector<torch::Tensor> outs;
  for (int i = 0; i < 2; ++i) {
    const std::int64_t c = chunks[i], visible = (c + 1) * chunk;
    auto rows = q.narrow(2, i * chunk, chunk);
    if (c > 0) rows = torch::cat({torch::zeros({batch, heads, c * chunk, dim}, q.options()), rows}, 2);
    const auto out = torch::scaled_dot_product_attention(
        rows, k.narrow(2, 0, visible), v.narrow(2, 0, visible), {}, 0.0, true, scale, groups > 1);
    outs.push_back(out.narrow(2, c * chunk, chunk));
  }
  return torch::cat(outs, 2).transpose(1, 2).reshape({batch, length, heads * dim});
}

}  // namespace

torch::Tensor sequence_parallel_attention(const SequenceParallelism& s, const torch::Tensor& q,
                                          const torch::Tensor& k, const torch::Tensor& v,
                                          const torch::Tensor& mask, std::int64_t groups, double scale) {
  Communicator& group = *s.group;
  const std::int64_t size = group.world_size();
  const auto batch = q.size(0), heads = q.size(1), length = q.size(2), dim = q.size(3);
  if (s.context && s.ring) {
    const auto out = ring_attention(q, k, v, mask, group, scale);
    return out.transpose(1, 2).reshape({batch, length, heads * dim});
  }
  if (s.context) {
    // Keys and values of every rank ([B, Hkv, size x t, D] in the group's order; the mask says which).
    auto gather = [&](const torch::Tensor& x) {
      return all_gather(x.unsqueeze(0), group).permute({1, 2, 0, 3, 4}).reshape({batch, x.size(1), -1, dim});
    };
    auto kf = gather(k), vf = gather(v);
    if (!mask.defined()) return context_causal_attention(s, q, kf, vf, groups, scale);
    if (groups > 1) {
      kf = kf.repeat_interleave(groups, 1);
      vf = vf.repeat_interleave(groups, 1);
    }
    const auto out = torch::scaled_dot_product_attention(q, kf, vf, mask, 0.0, false, scale);
    return out.transpose(1, 2).reshape({batch, length, heads * dim});
  }
  // Ulysses: [B, h, t, D] -> head group j to rank j -> [B, h / size, size x t, D] (every position).
  auto to_heads = [&](const torch::Tensor& x) {
    const auto h = x.size(1);
    auto blocks = x.reshape({batch, size, h / size, length, dim}).permute({1, 0, 2, 3, 4});
    return all_to_all(blocks, group).permute({1, 2, 0, 3, 4}).reshape({batch, h / size, size * length, dim});
  };
  auto qf = to_heads(q), kf = to_heads(k), vf = to_heads(v);
  torch::Tensor out;
  if (mask.defined()) {
    if (groups > 1) {
      kf = kf.repeat_interleave(groups, 1);
      vf = vf.repeat_interleave(groups, 1);
    }
    out = torch::scaled_dot_product_attention(qf, kf, vf, mask, 0.0, false, scale);
  } else {
    out = torch::scaled_dot_product_attention(qf, kf, vf, {}, 0.0, size * length > 1, scale, groups > 1);
  }
  // Back: the positions of rank s to rank s, each rank's head groups side by side again.
  auto blocks = out.reshape({batch, heads / size, size, length, dim}).permute({2, 0, 1, 3, 4});
  out = all_to_all(blocks, group).permute({1, 0, 2, 3, 4}).reshape({batch, heads, length, dim});
  return out.transpose(1, 2).reshape({batch, length, heads * dim});
}

}  // namespace detail
}  // namespace accel::llm
