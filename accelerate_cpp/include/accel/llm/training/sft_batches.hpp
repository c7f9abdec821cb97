#pragma once
/// \file sft_batches.hpp
/// Supervised fine-tuning batches for accel::Trainer: the data room's examples (plain token ids and labels,
/// <accel/llm/data/sft_dataset.hpp>) collated into LibTorch tensors, and the loss of a causal LM on them. The
/// one place where the data room's plain types meet the models room's modules.
///
///   auto examples = accel::llm::prepare_sft_examples(dataset, &chat_template, encode, data_options);
///   accel::llm::SftBatches train(examples, accel::llm::sft_collator_options(data_options, pad_id));
///   accel::Trainer trainer(args, model, train,
///                          [&](accel::llm::SftTensors& b) { return accel::llm::sft_loss(*model, b); });
///   trainer.set_num_items(accel::llm::sft_label_count);  // HF's num_items_in_batch: one process's numbers
///
/// Local to a rank: no collective.

#include <accel/llm/data/collator.hpp>
#include <accel/llm/data/sft_dataset.hpp>
#include <accel/llm/models/causal_lm.hpp>

#include <torch/data/datasets/base.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

namespace accel::llm {

/// A batch: {input_ids, labels, attention_mask, position_ids}, each int64 [rows, cols] (SftBatch's fields as
/// tensors). A field the collator does not return (attention_mask in padding-free batches, position_ids in
/// padded ones) is an empty tensor, so that the loader can move the batch to the device as it is.
using SftTensors = std::vector<torch::Tensor>;
/// Positions of the fields in SftTensors.
enum SftField : std::size_t { kInputIds = 0, kLabels = 1, kAttentionMask = 2, kPositionIds = 3 };

/// A torch::data batch dataset over prepared examples: `get_batch(indices)` collates those examples with
/// `options` (accel::llm::collate: padded, or padding-free with position ids restarting per document). Copies
/// share the examples.
class SftBatches : public torch::data::datasets::BatchDataset<SftBatches, SftTensors> {
 public:
  /// Throws UsageError when `examples` is empty.
  SftBatches(std::vector<SftExample> examples, CollatorOptions options);
  SftTensors get_batch(c10::ArrayRef<std::size_t> indices) override;
  std::optional<std::size_t> size() const override;
  /// The examples, in dataset order.
  const std::vector<SftExample>& examples() const noexcept { return *examples_; }

 private:
  std::shared_ptr<const std::vector<SftExample>> examples_;
  CollatorOptions options_;
};

/// The tensors of a collated batch (SftBatch of <accel/llm/data/collator.hpp>), on the CPU.
SftTensors to_tensors(const SftBatch& batch);

/// Logits [rows, cols, vocab] of `model` on a batch: its attention mask, or (padding-free) its position ids,
/// from which the model keeps attention inside each packed document.
torch::Tensor sft_logits(CausalLMImpl& model, const SftTensors& batch);

/// The labels the loss counts in a batch: those other than -100 after the causal shift (Hugging Face
/// Trainer's num_items_in_batch count over `labels[..., 1:]`).
std::int64_t sft_label_count(const SftTensors& batch);

/// How sft_loss computes the loss. Example: `SftLossOptions().fused_linear_cross_entropy(false)`.
struct SftLossOptions {
  /// true (the default): the loss from the final hidden states and the head's weight, chunk by chunk
  /// (fused_linear_cross_entropy.hpp): the [B, T, vocab] float32 logits and their gradient never exist
  /// whole, and ignored tokens get no logits. Used when the head is a plain weight (the tied embedding, or an
  /// lm_head Linear without bias or adapters); a head LoRA adapts, quantised or split over ranks takes the
  /// model's logits, as false does. Equal to false within float arithmetic.
  SftLossOptions& fused_linear_cross_entropy(bool value) {
    fused_ = value;
    return *this;
  }
  /// Tokens per chunk of the fused loss (0: automatic, see FusedCrossEntropyOptions::chunk_tokens).
  SftLossOptions& chunk_tokens(std::int64_t value) {
    chunk_tokens_ = value;
    return *this;
  }
  bool fused_ = true;
  std::int64_t chunk_tokens_ = 0;
};

/// The causal-LM loss of `model` on a batch (transformers' ForCausalLMLoss): the mean over the batch's
/// counted labels, or with `num_items_in_batch` their sum divided by it (Trainer::set_num_items passes the
/// count of the whole accumulation window over every rank, as Hugging Face's Trainer does).
torch::Tensor sft_loss(CausalLMImpl& model, const SftTensors& batch,
                       std::optional<std::int64_t> num_items_in_batch = std::nullopt,
                       const SftLossOptions& options = {});

/// The output head's weight when the head is a plain weight that fused_linear_cross_entropy can use in its
/// place (see SftLossOptions::fused_linear_cross_entropy), else an undefined tensor.
torch::Tensor plain_head_weight(CausalLMImpl& model);

}  // namespace accel::llm
