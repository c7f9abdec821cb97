#pragma once
/// \file sequence_shard.hpp
/// Batches of a sequence- or context-parallel model (models/sequence_parallel.hpp): every rank of the group
/// reads the same batch (the Accelerator's loaders shard over data_parallel_group(), one rank per group) and
/// keeps its part of the positions, as DeepSpeed's UlyssesSPDataLoaderAdapter does for ALST; the loss is
/// then the whole sequence's.
///
///   enable_sequence_parallel(*model, accelerator.sequence_parallel_group());
///   Trainer trainer(args, model, batches, [&](SftTensors& b) { return sequence_parallel_sft_loss(*model, b,
///   1, loss_options); }); trainer.set_num_items(sft_label_count);  // counted on the whole batch, as for one
///   process

#include <accel/llm/models/causal_lm.hpp>
#include <accel/llm/training/sft_batches.hpp>

#include <cstdint>
#include <optional>

namespace accel::llm {

/// This rank's part of `batch` for a model split by enable_sequence_parallel / enable_context_parallel
/// (unsplit: the batch with labels shifted). The columns are first padded on the right to a multiple of the
/// group's size (2 x size for context parallelism): `pad_id` tokens, labels -100, attention mask 1 (when
/// the batch has one: causal attention never shows a later column to a real token), position ids continuing
/// each row. The labels are shifted BEFORE the cut (ALST's
/// shift_labels: position t holds labels[t + 1], the last -100), so that the token after a part's last
/// position is still predicted. Position ids are the batch's, or 0..T-1 when it has none. Returns
/// {input_ids, shift_labels, attention_mask (or empty), position_ids}, each int64 [rows, part].
SftTensors shard_sequence(const SftTensors& batch, const CausalLMImpl& model, std::int64_t pad_id = 0);

/// The causal-LM loss of a split `model` on the whole `batch`: each rank computes the cross-entropy of its
/// part (shard_sequence) summed over its counted labels, and the sum over the group (an all-reduce whose
/// backward sums the gradients, as torch.distributed.nn.functional.all_reduce) is divided by
/// `num_items_in_batch`, or by the batch's counted labels (sft_label_count) without it. The value is the same
/// on every rank of the group and equals sft_loss of one process; the Accelerator's engines, which average
/// gradients over every rank under sequence parallelism, then give one process's gradients. Collective over
/// the group. An unsplit model gives sft_loss. `options` as sft_loss's: by default each rank's sum comes from
/// fused_linear_cross_entropy (its part's logits never exist whole) when the head is a plain weight (tied or
/// untied; a LoRA, quantised or tensor-parallel head, or `fused_linear_cross_entropy(false)`, takes the
/// model's logits), equal within float arithmetic.
torch::Tensor sequence_parallel_sft_loss(CausalLMImpl& model, const SftTensors& batch,
                                         std::optional<std::int64_t> num_items_in_batch = std::nullopt,
                                         const SftLossOptions& options = {});

}  // namespace accel::llm
