// SFT batches as tensors and the loss on them (sft_batches.hpp).
#include <accel/errors.hpp>
#include <accel/llm/training/fused_linear_cross_entropy.hpp>
#include <accel/llm/training/sft_batches.hpp>
#include <accel/llm/training/vocab_parallel_loss.hpp>

#include <torch/torch.h>

#include <string>

#include "llm/models/tensor_parallel_detail.hpp"

namespace accel::llm {

namespace {

torch::Tensor matrix(const std::vector<int64_t>& values, int64_t rows, int64_t cols) {
  if (values.empty()) return torch::empty({0}, torch::kInt64);
  return torch::tensor(values, torch::kInt64).view({rows, cols});
}

torch::Tensor field(const SftTensors& batch, SftField which) {
  if (batch.size() != 4) {
    throw UsageError(
        "accel::llm: an SFT batch holds 4 tensors {input_ids, labels, attention_mask, "
        "position_ids}, got " +
        std::to_string(batch.size()));
  }
  const auto& t = batch[which];
  return t.numel() == 0 ? torch::Tensor() : t;
}

}  // namespace

SftBatches::SftBatches(std::vector<SftExample> examples, CollatorOptions options)
    : examples_(std::make_shared<const std::vector<SftExample>>(std::move(examples))),
      options_(std::move(options)) {
  if (examples_->empty())
    throw UsageError(
        "accel::llm::SftBatches: no examples (the dataset prepared to nothing: check max_length "
        "and that every example has labels)");
}

SftTensors SftBatches::get_batch(c10::ArrayRef<std::size_t> indices) {
  std::vector<SftExample> rows;
  rows.reserve(indices.size());
  for (const auto i : indices) {
    if (i >= examples_->size())
      throw UsageError("accel::llm::SftBatches: index " + std::to_string(i) + " is past the " +
                       std::to_string(examples_->size()) + " examples");
    rows.push_back((*examples_)[i]);
  }
  return to_tensors(collate(rows, options_));
}

std::optional<std::size_t> SftBatches::size() const {
  return examples_->size();
}

SftTensors to_tensors(const SftBatch& b) {
  return {matrix(b.input_ids, b.rows, b.cols), matrix(b.labels, b.rows, b.cols),
          matrix(b.attention_mask, b.rows, b.cols), matrix(b.position_ids, b.rows, b.cols)};
}

torch::Tensor sft_logits(CausalLMImpl& model, const SftTensors& batch) {
  return model.forward(field(batch, kInputIds), field(batch, kAttentionMask), field(batch, kPositionIds));
}

std::int64_t sft_label_count(const SftTensors& batch) {
  const auto labels = field(batch, kLabels);
  if (!labels.defined() || labels.size(1) < 2) return 0;
  return labels.slice(1, 1).ne(-100).sum().item<std::int64_t>();
}

torch::Tensor plain_head_weight(CausalLMImpl& model) {
  auto plain = [](const std::shared_ptr<torch::nn::Module>& m) {
    return m != nullptr && m->children().empty();  // no lora_A / lora_B (nor anything else) inside
  };
  if (model.config().tie_word_embeddings) {
    const auto children = model.model->named_children();
    if (!children.contains("embed_tokens") || !plain(children["embed_tokens"])) return {};
    auto* embedding = children["embed_tokens"]->as<torch::nn::EmbeddingImpl>();
    return embedding != nullptr ? embedding->weight : torch::Tensor();
  }
  const auto children = model.named_children();
  if (!children.contains("lm_head") || !plain(children["lm_head"])) return {};
  auto* linear = children["lm_head"]->as<torch::nn::LinearImpl>();  // not Linear4bit, not tensor-parallel
  if (linear == nullptr || (linear->bias.defined() && linear->bias.numel() > 0)) return {};
  return linear->weight;
}

torch::Tensor sft_loss(CausalLMImpl& model, const SftTensors& batch,
                       std::optional<std::int64_t> num_items_in_batch, const SftLossOptions& options) {
  const auto labels = field(batch, kLabels);
  // A head split over the vocabulary (apply_tensor_parallel with vocab_parallel): the loss over the group,
  // no rank holding all of any token's logits.
  if (const auto group = detail::vocab_parallel_group(model)) {
    const auto hidden = model.model->forward(field(batch, kInputIds), field(batch, kAttentionMask),
                                             field(batch, kPositionIds));
    const auto weight = options.fused_ ? detail::vocab_parallel_plain_weight(model) : torch::Tensor();
    if (weight.defined())
      return vocab_parallel_fused_linear_cross_entropy(
          hidden, weight, labels.to(hidden.device()), group, num_items_in_batch,
          FusedCrossEntropyOptions().chunk_tokens(options.chunk_tokens_));
    return vocab_parallel_causal_lm_loss(detail::vocab_parallel_logits(model, hidden),
                                         labels.to(hidden.device()), group, num_items_in_batch);
  }
  if (options.fused_) {
    if (const auto weight = plain_head_weight(model); weight.defined()) {
      const auto hidden = model.model->forward(field(batch, kInputIds), field(batch, kAttentionMask),
                                               field(batch, kPositionIds));
      return fused_linear_cross_entropy(hidden, weight, labels.to(hidden.device()), num_items_in_batch,
                                        FusedCrossEntropyOptions().chunk_tokens(options.chunk_tokens_));
    }
  }
  return causal_lm_loss(sft_logits(model, batch), labels, num_items_in_batch);
}

}  // namespace accel::llm
