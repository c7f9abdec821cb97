#include <accel/distributed/communicator.hpp>
#include <accel/errors.hpp>
#include <accel/llm/models/sequence_parallel.hpp>
#include <accel/llm/training/fused_linear_cross_entropy.hpp>
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

// This rank's token losses summed over its part (`local`, labels already shifted by shard_sequence): through
// fused_linear_cross_entropy when `options` ask for it and the head is a plain weight (sft_loss's rule), else
// from the model's logits.
torch::Tensor local_loss_sum(CausalLMImpl& model, const SftTensors& local, const SftLossOptions& options) {
  const auto mask = local[kAttentionMask].numel() > 0 ? local[kAttentionMask] : torch::Tensor();
  if (options.fused_) {
    if (const auto weight = plain_head_weight(model); weight.defined()) {
      const auto hidden = model.model->forward(local[kInputIds], mask, local[kPositionIds]);
      // The fused loss shifts its labels itself (position t predicts labels[t + 1], the last position none);
      // the part's labels are shifted already. One position of zeros after each row and the labels moved one
      // to the right give position t its own label local[t] and the zeros none (a copy of the hidden states,
      // a fraction of the logits the fused loss saves).
      const auto padded = torch::constant_pad_nd(hidden, {0, 0, 0, 1});
      const auto labels = torch::constant_pad_nd(local[kLabels], {1, 0}, -100).to(hidden.device());
      return fused_linear_cross_entropy(padded, weight, labels, /*num_items_in_batch=*/1,
                                        FusedCrossEntropyOptions().chunk_tokens(options.chunk_tokens_));
    }
  }
  const auto logits = model.forward(local[kInputIds], mask, local[kPositionIds]);
  namespace F = torch::nn::functional;
  const auto labels = local[kLabels].reshape({-1}).to(logits.device());
  return F::cross_entropy(logits.to(torch::kFloat32).reshape({-1, logits.size(-1)}), labels,
                          F::CrossEntropyFuncOptions().ignore_index(-100).reduction(torch::kSum));
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
                                         std::optional<std::int64_t> num_items_in_batch,
                                         const SftLossOptions& options) {
  const auto& s = model.model->sequence_parallelism();
  const auto items = num_items_in_batch ? *num_items_in_batch : sft_label_count(batch);
  auto sum = local_loss_sum(model, shard_sequence(batch, model), options);
  if (s.group) sum = detail::all_reduce_sum(sum, *s.group);
  return sum / static_cast<double>(std::max<std::int64_t>(items, 1));
}

}  // namespace accel::llm
