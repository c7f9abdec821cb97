#include <accel/distributed/communicator.hpp>
#include <accel/errors.hpp>
#include <accel/llm/models/sequence_parallel.hpp>
#include <accel/llm/training/sequence_shard.hpp>

#include <torch/torch.h>

#include <string>

#include "llm/models/sequence_parallel_detail.hpp"

namespace accel::llm {
namespace {

torch::Tensor part(const SftTensors& batch, SftField which) {
  if (batch.size() != 4) {
    throw UsageError(
        "accel::llm::shard_sequence: an SFT batch holds 4 tensors {input_ids, labels, "
        "attention_mask, position_ids}, got " +
        std::to_string(batch.size()));
  }
  const auto& t = batch[which];
  return t.defined() && t.numel() > 0 ? t : torch::Tensor();
}

// `x` [rows, cols] padded on the right to `cols` + `extra` columns of `value`.
torch::Tensor pad_columns(const torch::Tensor& x, std::int64_t extra, std::int64_t value) {
  return extra == 0 ? x : torch::constant_pad_nd(x, {0, extra}, static_cast<double>(value));
}

}  // namespace

SftTensors shard_sequence(const SftTensors& batch, const CausalLMImpl& model, std::int64_t pad_id) {
  const auto ids = part(batch, kInputIds), labels = part(batch, kLabels);
  if (!ids.defined() || !labels.defined() || ids.dim() != 2 || labels.sizes() != ids.sizes())
    throw UsageError("accel::llm::shard_sequence: input_ids and labels must be [rows, cols] of one shape");
  const auto& s = model.model->sequence_parallelism();
  const int size = s.group ? s.group->world_size() : 1, rank = s.group ? s.group->rank() : 0;
  const std::int64_t rows = ids.size(0), cols = ids.size(1), pieces = s.context ? 2 * size : size;
  const std::int64_t extra = (pieces - cols % pieces) % pieces;
  // ALST's shift_labels: the label of position t is labels[t + 1], computed on the whole row before the cut.
  auto shifted = pad_columns(labels.slice(1, 1), 1 + extra, -100);
  auto positions = part(batch, kPositionIds);
  if (!positions.defined()) positions = torch::arange(cols, ids.options()).unsqueeze(0).expand({rows, cols});
  if (extra > 0) {
    const auto last = positions.narrow(1, cols - 1, 1);
    positions = torch::cat({positions, last + torch::arange(1, extra + 1, ids.options()).unsqueeze(0)}, 1);
  }
  // The added columns come after every token of the row: causal attention never shows them to a real token,
  // so they are marked "attend" (a row without padding then keeps SDPA's causal flag instead of a mask).
  auto mask = part(batch, kAttentionMask);
  if (mask.defined()) mask = pad_columns(mask, extra, 1);
  const auto index = sequence_shard_index(cols + extra, rank, size, s.context).to(ids.device());
  auto cut = [&](const torch::Tensor& t) { return t.defined() ? t.index_select(1, index) : torch::Tensor(); };
  return {cut(pad_columns(ids, extra, pad_id)), cut(shifted), mask.defined() ? cut(mask) : torch::empty({0}),
          cut(positions.expand({rows, -1}).contiguous())};
}

torch::Tensor sequence_parallel_sft_loss(CausalLMImpl& model, const SftTensors& batch,
                                         std::optional<std::int64_t> num_items_in_batch) {
  const auto& s = model.model->sequence_parallelism();
  const auto items = num_items_in_batch ? *num_items_in_batch : sft_label_count(batch);
  const auto local = shard_sequence(batch, model);
  const auto mask = local[kAttentionMask].numel() > 0 ? local[kAttentionMask] : torch::Tensor();
  const auto logits = model.forward(local[kInputIds], mask, local[kPositionIds]);
  namespace F = torch::nn::functional;
  const auto labels = local[kLabels].reshape({-1}).to(logits.device());
  auto sum = F::cross_entropy(logits.to(torch::kFloat32).reshape({-1, logits.size(-1)}), labels,
                              F::CrossEntropyFuncOptions().ignore_index(-100).reduction(torch::kSum));
  if (s.group) sum = detail::all_reduce_sum(sum, *s.group);
  return sum / static_cast<double>(std::max<std::int64_t>(items, 1));
}

}  // namespace accel::llm
