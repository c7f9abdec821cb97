#include "accel/llm/models/pipeline_stages.hpp"

#include <torch/torch.h>

#include <memory>
#include <string>

#include "accel/errors.hpp"
#include "llm/models/fused_layer_ops.hpp"

namespace accel::llm {
namespace {

// Layer 0: the token embedding.
class EmbedStageImpl : public torch::nn::Module {
 public:
  explicit EmbedStageImpl(torch::nn::Embedding embed) : torch::nn::Module("PipelineEmbedding") {
    embed_tokens = register_module("embed_tokens", std::move(embed));
  }
  torch::Tensor forward(const torch::Tensor& input_ids) {
    if (input_ids.dim() != 2 || input_ids.is_floating_point())
      throw UsageError(
          "accel::llm::pipeline_layers: the first stage takes input_ids [batch, length] of an "
          "integer dtype, got " +
          std::to_string(input_ids.dim()) + " dimensions of " +
          std::string(c10::toString(input_ids.scalar_type())));
    return embed_tokens->forward(input_ids);
  }
  torch::nn::Embedding embed_tokens{nullptr};
};
TORCH_MODULE(EmbedStage);

// Layers 1..L: one block, causal over positions 0..T-1, with the rotary tables of the model's config (the
// cos and sin DecoderModelImpl::forward computes for those positions); a sliding block (window > 0) sees only
// the last `window` positions, as DecoderModelImpl::forward's sliding mask.
class BlockStageImpl : public torch::nn::Module {
 public:
  BlockStageImpl(DecoderLayer block, RotaryTables rotary, std::int64_t window)
      : torch::nn::Module("PipelineBlock"), rotary_(std::move(rotary)), window_(window) {
    block_ = register_module("block", std::move(block));
  }
  torch::Tensor forward(const torch::Tensor& h) {
    const auto device = h.device();
    const auto positions =
        torch::arange(h.size(1), torch::TensorOptions().dtype(torch::kInt64).device(device)).unsqueeze(0);
    const auto freqs = positions.unsqueeze(-1).to(torch::kFloat32) * rotary_.inv_freq.to(device);
    const auto emb = torch::cat({freqs, freqs}, -1);
    const auto cos = (emb.cos() * rotary_.attention_scaling).to(h.scalar_type());
    const auto sin = (emb.sin() * rotary_.attention_scaling).to(h.scalar_type());
    torch::Tensor mask;  // undefined: SDPA's causal flag
    if (window_ > 0 && h.size(1) > window_) {
      const auto i = positions.view({-1});
      mask = ((i.unsqueeze(0) <= i.unsqueeze(1)) & (i.unsqueeze(0) > i.unsqueeze(1) - window_))
                 .view({1, 1, h.size(1), h.size(1)});
    }
    return block_->forward(h, cos, sin, mask, /*cache=*/nullptr);
  }

 private:
  DecoderLayer block_{nullptr};
  RotaryTables rotary_;
  std::int64_t window_;
};
TORCH_MODULE(BlockStage);

// Layer L + 1: the final norm and the output projection (the embedding itself when tied).
class HeadStageImpl : public torch::nn::Module {
 public:
  HeadStageImpl(RMSNorm norm, torch::nn::Embedding tied, torch::nn::Linear head)
      : torch::nn::Module("PipelineHead") {
    norm_ = register_module("norm", std::move(norm));
    if (!tied.is_empty()) tied_ = register_module("embed_tokens", std::move(tied));
    if (!head.is_empty()) head_ = register_module("lm_head", std::move(head));
  }
  torch::Tensor forward(const torch::Tensor& h) {
    const auto x = norm_->forward(h);
    // As CausalLM's head: detail::linear (oneDNN) unless a LoRA adapter on lm_head watches aten::linear.
    if (!tied_.is_empty()) return detail::linear(x, tied_->weight);
    return head_->children().empty() ? detail::linear(x, head_->weight) : torch::linear(x, head_->weight);
  }

 private:
  RMSNorm norm_{nullptr};
  torch::nn::Embedding tied_{nullptr};
  torch::nn::Linear head_{nullptr};
};
TORCH_MODULE(HeadStage);

std::int64_t block_count(const CausalLM& model) {
  return static_cast<std::int64_t>(model->model->layers->size());
}

}  // namespace

torch::nn::Sequential pipeline_layers(const CausalLM& model) {
  const auto& config = model->config();
  torch::nn::Sequential layers;
  layers->push_back(EmbedStage(model->model->embed_tokens));
  const auto rotary = rotary_tables(config);
  for (std::int64_t i = 0; i < block_count(model); ++i) {
    auto block = std::dynamic_pointer_cast<DecoderLayerImpl>(model->model->layers->ptr(i));
    if (block == nullptr)
      throw UsageError("accel::llm::pipeline_layers: model.layers." + std::to_string(i) + " is a " +
                       model->model->layers->ptr(i)->name() + ", not a decoder block");
    layers->push_back(
        BlockStage(DecoderLayer(block), rotary, config.is_sliding_layer(i) ? *config.sliding_window : 0));
  }
  torch::nn::Linear head{nullptr};
  if (!config.tie_word_embeddings) {
    const auto children = model->named_children();
    const auto* child = children.find("lm_head");
    auto linear = child != nullptr ? std::dynamic_pointer_cast<torch::nn::LinearImpl>(*child) : nullptr;
    if (linear == nullptr)
      throw UsageError("accel::llm::pipeline_layers: lm_head is " +
                       (child != nullptr ? "a " + (*child)->name() : std::string("missing")) +
                       "; the pipeline's last stage takes a plain torch::nn::Linear head (not quantised "
                       "or adapted)");
    head = torch::nn::Linear(linear);
  }
  layers->push_back(HeadStage(
      model->model->norm,
      config.tie_word_embeddings ? model->model->embed_tokens : torch::nn::Embedding(nullptr), head));
  return layers;
}

std::string pipeline_partition(const CausalLM& model, int stages) {
  const auto blocks = block_count(model);
  if (stages < 1 || stages > blocks)
    throw UsageError("accel::llm::pipeline_partition: " + std::to_string(stages) + " stages for a model of " +
                     std::to_string(blocks) + " blocks; each stage needs at least one block (use 1.." +
                     std::to_string(blocks) + ")");
  // Layer 0 is the embedding, layers 1..blocks the blocks, layer blocks + 1 the head: stage s ends after
  // its share of the blocks, the last one after the head.
  std::string out = "0";
  std::int64_t end = 1;
  for (int s = 0; s < stages; ++s) {
    end += blocks / stages + (s < blocks % stages ? 1 : 0);
    out += "," + std::to_string(s + 1 == stages ? end + 1 : end);
  }
  return out;
}

std::function<torch::Tensor(const torch::Tensor&, const torch::Tensor&)> pipeline_loss() {
  return
      [](const torch::Tensor& logits, const torch::Tensor& labels) { return causal_lm_loss(logits, labels); };
}

}  // namespace accel::llm
