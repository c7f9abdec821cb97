#pragma once
/// \file causal_lm.hpp
/// A decoder-only causal language model (Llama 2 / 3 / 3.x, Qwen2 / Qwen2.5, Qwen3) as ordinary LibTorch
/// modules whose parameter names are transformers' (`model.embed_tokens.weight`,
/// `model.layers.0.self_attn.q_proj.weight`, ..., `lm_head.weight`), so that LoRA `target_modules`, PEFT
/// adapter files, `save_model` exports and state-dict keys match what Python users have. The blocks are one
/// shared set of modules; the config's switches (biases, q/k norms, tied embeddings, rotary scaling) are the
/// only difference between the families (torchtune's builder design: blocks do not know the model they are
/// in).
///
///   auto model = accel::llm::from_pretrained("Qwen2.5-0.5B",
///   accel::llm::LoadOptions().dtype(torch::kBFloat16)); auto logits = model->forward(input_ids); // [B, T,
///   vocab] auto loss = accel::llm::causal_lm_loss(logits, labels);       // transformers' ForCausalLMLoss
///
/// Local to a rank: no collective. The model is a `torch::nn::Module` like any other: prepare it with the
/// Accelerator, adapt it with accel::peft, quantise its Linear layers with accel::quant::quantize_linears.

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>
#include <torch/types.h>
#include <accel/nn/tied_embeddings.hpp>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "accel/llm/models/model_config.hpp"
#include "accel/nn/activation_checkpoint.hpp"
#include "accel/nn/quant4bit.hpp"

namespace accel {
class Communicator;
}  // namespace accel

namespace accel::llm {

namespace detail {
/// How attention is split over ranks (accel/llm/models/sequence_parallel.hpp); no group: not split.
struct SequenceParallelism {
  std::shared_ptr<Communicator> group;  ///< the ranks holding the parts of each sequence
  bool context = false;                 ///< context parallelism (load-balanced chunks) rather than Ulysses
  bool ring = false;  ///< context parallelism with K/V passed around a ring (cp_comm_strategy "alltoall")
};
}  // namespace detail

/// Keys and values of every layer seen so far, for generation (transformers' DynamicCache built from the
/// config). Each forward with a cache appends the new positions; `attention_mask`, when given, must cover
/// past and new positions. A sliding-window layer (ModelConfig::is_sliding_layer) then keeps only its last
/// `sliding_window - 1` positions, as transformers' DynamicSlidingWindowLayer: no later query sees older
/// ones.
struct KVCache {
  std::vector<torch::Tensor> keys;    ///< per layer: [batch, kv_heads, positions kept, head_dim]
  std::vector<torch::Tensor> values;  ///< per layer, as keys
  std::vector<std::int64_t> dropped;  ///< per layer: positions dropped from the front (sliding layers)
  /// Positions seen (0 when empty), kept or dropped.
  std::int64_t seq_length() const;
  /// Keeps only the rows `index` (a 1-d int64 tensor) of every layer, e.g. to drop finished prompts.
  void select_rows(const torch::Tensor& index);
};

/// Root-mean-square layer norm computed in float32, as transformers' `*RMSNorm`: the normalised input is cast
/// back to its dtype before the weight multiplies it.
class RMSNormImpl : public torch::nn::Module {
 public:
  RMSNormImpl(std::int64_t size, double eps, const std::string& class_name = "RMSNorm");
  torch::Tensor forward(const torch::Tensor& x);
  torch::Tensor weight;

 private:
  double eps_;
};
TORCH_MODULE(RMSNorm);

/// Rotary tables of a config: transformers' inverse frequencies (default, linear, llama3, yarn) and the
/// attention scaling applied to cos and sin (yarn; 1 otherwise).
struct RotaryTables {
  torch::Tensor inv_freq;  ///< float32 [head_dim / 2]
  double attention_scaling = 1.0;
};
/// Computes the tables exactly as transformers' ROPE_INIT_FUNCTIONS do (float32 arithmetic).
RotaryTables rotary_tables(const ModelConfig& config);

/// Grouped-query self-attention with q/k/v/o projections (children `q_proj` ... `o_proj`, plus `q_norm` and
/// `k_norm` for Qwen3), rotary embeddings and `scaled_dot_product_attention`. The projections are called
/// through the module registry, so `accel::quant::quantize_linears` and `accel::peft` can replace or adapt
/// them in place.
class AttentionImpl : public torch::nn::Module {
 public:
  AttentionImpl(const ModelConfig& config, std::int64_t layer_index);
  /// `x` [B, T, hidden]; `cos`/`sin` [B, T, head_dim]; `mask` bool [B, 1, T, S] (true = attend) or undefined
  /// (causal over T when T > 1); `cache` gets this layer's keys and values appended.
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                        const torch::Tensor& mask, KVCache* cache);
  /// Set by enable_sequence_parallel / enable_context_parallel (sequence_parallel.hpp).
  void set_sequence_parallelism(detail::SequenceParallelism s) { sequence_ = std::move(s); }

 private:
  std::int64_t layer_index_, num_heads_, num_kv_heads_, head_dim_;
  bool qk_norm_;
  detail::SequenceParallelism sequence_;
};
TORCH_MODULE(Attention);

/// SwiGLU feed-forward: down_proj(silu(gate_proj(x)) * up_proj(x)).
class MlpImpl : public torch::nn::Module {
 public:
  explicit MlpImpl(const ModelConfig& config);
  torch::Tensor forward(const torch::Tensor& x);
};
TORCH_MODULE(Mlp);

/// One block: x + attn(norm(x)), then x + mlp(norm(x)). Its name() is transformers' class name
/// ("Qwen2DecoderLayer", ...), the unit `fsdp_transformer_layer_cls_to_wrap` names. A
/// GradientCheckpointingLayer, as transformers' decoder layers are: `gradient_checkpointing_enable()` (or the
/// Trainer's `gradient_checkpointing: true`, through checkpoint_model_blocks) recomputes it in backward.
class DecoderLayerImpl : public torch::nn::Module, public accel::GradientCheckpointingLayer {
 public:
  DecoderLayerImpl(const ModelConfig& config, std::int64_t layer_index);
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                        const torch::Tensor& mask, KVCache* cache);

 private:
  torch::Tensor forward_block(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                              const torch::Tensor& mask, KVCache* cache);
};
TORCH_MODULE(DecoderLayer);

/// The stack of blocks between the embedding and the final norm (transformers' `Qwen2Model`, the `model.`
/// prefix of every parameter name).
class DecoderModelImpl : public torch::nn::Module {
 public:
  /// `on_block`, when set, runs on each block right after it is built, before the next one is
  /// (from_pretrained quantises a block's projections there, so that the full-precision model never exists
  /// whole).
  explicit DecoderModelImpl(const ModelConfig& config,
                            const std::function<void(torch::nn::Module& block)>& on_block = {});
  /// The final hidden states [B, T, hidden] (after `norm`). `attention_mask` 0/1 [B, past + T] (undefined:
  /// no padding); `position_ids` [B or 1, T] (undefined: past .. past + T - 1). Without attention_mask and
  /// cache, position ids that restart inside a row mark packed documents (TRL's padding-free batches):
  /// attention then stays inside each document, as transformers' create_causal_mask does. Sliding layers
  /// (ModelConfig::is_sliding_layer) also see only the last `sliding_window` positions, as transformers'
  /// create_sliding_window_causal_mask (their cache keeps the last sliding_window - 1 positions: KVCache).
  torch::Tensor forward(const torch::Tensor& input_ids, const torch::Tensor& attention_mask = {},
                        const torch::Tensor& position_ids = {}, KVCache* cache = nullptr);
  /// Recompute each block in backward instead of keeping its activations (every layer's
  /// GradientCheckpointingLayer switch; only while training with grad mode on and no cache).
  void gradient_checkpointing_enable(bool enable = true);
  /// Set by enable_sequence_parallel / enable_context_parallel (sequence_parallel.hpp): input_ids,
  /// attention_mask and position_ids are then this rank's part of each sequence (shard_sequence).
  void set_sequence_parallelism(detail::SequenceParallelism s) { sequence_ = std::move(s); }
  /// The split set by enable_sequence_parallel / enable_context_parallel (no group: none).
  const detail::SequenceParallelism& sequence_parallelism() const noexcept { return sequence_; }
  /// While true (CausalLMImpl::hidden_states_for_head sets it around its call), a trained embedding lookup
  /// gives a sparse gradient, to be added into the tied head's dense one.
  bool sparse_lookup_gradient = false;

  torch::nn::Embedding embed_tokens{nullptr};
  torch::nn::ModuleList layers{nullptr};  ///< the blocks (DecoderLayer): units of wrapping and checkpointing
  RMSNorm norm{nullptr};

 private:
  RotaryTables rotary_;
  detail::SequenceParallelism sequence_;
  std::int64_t sliding_window_ = 0;   ///< the config's sliding_window (0: none)
  std::vector<bool> sliding_layers_;  ///< per block: attends through the sliding window
  std::int64_t sliding_cache_dropped(const KVCache& cache) const;
  void crop_sliding_cache(KVCache& cache) const;
};
TORCH_MODULE(DecoderModel);

/// The causal LM: `model` and, unless the embeddings are tied, `lm_head` (tied: the head uses
/// `model.embed_tokens.weight`, and `lm_head.weight` is no parameter of its own, as transformers'
/// `named_parameters()` lists it once).
class CausalLMImpl : public torch::nn::Module, public peft::TiedEmbeddings {
 public:
  /// Built with LibTorch's default initialisation (from_pretrained then loads the weights). Throws
  /// UsageError on an inconsistent config (sizes not positive, heads not divisible).
  explicit CausalLMImpl(const ModelConfig& config,
                        const std::function<void(torch::nn::Module& block)>& on_block = {});
  /// Logits [B, T, vocab] in the model's dtype. See DecoderModelImpl::forward for the arguments.
  torch::Tensor forward(const torch::Tensor& input_ids, const torch::Tensor& attention_mask = {},
                        const torch::Tensor& position_ids = {}, KVCache* cache = nullptr);
  /// `model`'s final hidden states, for a caller that applies output_weight() to them in the same graph
  /// (forward does). With tied embeddings that train, the lookup then gives the shared
  /// weight a sparse gradient (its rows only) that autograd sums with the head's dense one: the lookup's own
  /// dense [vocab, hidden] gradient (transformers' path, and `model->forward`'s) is never formed, so the
  /// backward of forward + causal_lm_loss peaks one such matrix lower. (Behind the fused loss, which forms
  /// the head's gradient in forward, the peak would not change: autograd adds a sparse gradient into a dense
  /// one out of place; sft_loss keeps `model->forward` there.) The weight's `grad` is dense as ever. A caller
  /// whose loss may not reach the head calls `model->forward` instead.
  torch::Tensor hidden_states_for_head(const torch::Tensor& input_ids,
                                       const torch::Tensor& attention_mask = {},
                                       const torch::Tensor& position_ids = {});
  /// The output projection's weight (the child `lm_head`'s, or the embedding's when tied). UsageError when
  /// lm_head was replaced by a layer without a full-precision weight.
  torch::Tensor output_weight() const;
  const ModelConfig& config() const noexcept { return config_; }
  /// Tied: {"lm_head", "model.embed_tokens"}; untied: empty strings (peft::TiedEmbeddings).
  std::pair<std::string, std::string> tied_embeddings() const override;
  /// Tied: `lm_head` becomes a Linear of its own holding a copy of the embedding's weight (its requires_grad
  /// too) and config().tie_word_embeddings false (save_pretrained then writes lm_head.weight), as PEFT's
  /// modules_to_save copy of a tied embedding leaves the head. UsageError when the head is split over the
  /// vocabulary. Untied: nothing.
  void untie_word_embeddings() override;

  DecoderModel model{nullptr};
  // lm_head (untied) lives only in the module registry, so that quantize_linears and PEFT can replace it.

 private:
  ModelConfig config_;
};
TORCH_MODULE(CausalLM);

/// transformers' ForCausalLMLoss: logits (cast to float32) at position t predict labels[t + 1]; labels of
/// -100 (`ignore_index`) are ignored; the mean over the counted tokens, or with `num_items_in_batch` their
/// sum divided by it (the Trainer's gradient-accumulation-aware form).
torch::Tensor causal_lm_loss(const torch::Tensor& logits, const torch::Tensor& labels,
                             std::optional<std::int64_t> num_items_in_batch = std::nullopt,
                             std::int64_t ignore_index = -100);

/// Options of from_pretrained. Example: `LoadOptions().dtype(torch::kBFloat16)`.
struct LoadOptions {
  /// The parameters' dtype: float32, bfloat16 or float16 (unset: the config's `dtype`, float32 if none).
  LoadOptions& dtype(torch::ScalarType value) {
    dtype_ = value;
    return *this;
  }
  /// Where the model is built and loaded.
  LoadOptions& device(torch::Device value) {
    device_ = value;
    return *this;
  }
  /// Store the blocks' projections in 4 bits (accel::quant::Linear4bit, QLoRA's NF4 by default); the
  /// embedding, the norms and lm_head stay in `dtype`, as transformers' `load_in_4bit` keeps them. Quantised
  /// while loading: each block's projections are 4-bit from the moment it is built and each weight is read,
  /// quantised and freed, so the full-precision projections never exist together.
  LoadOptions& load_in_4bit(const quant::Quant4bitOptions& options = {}) {
    load_in_4bit_ = options;
    return *this;
  }
  std::optional<torch::ScalarType> dtype_;
  torch::Device device_ = torch::kCPU;
  std::optional<quant::Quant4bitOptions> load_in_4bit_;
};

/// Builds the model of `dir/config.json` and loads `dir/model.safetensors` or the shards of
/// `dir/model.safetensors.index.json`, one tensor at a time from memory-mapped files (no file is read
/// whole). Every tensor is checked before any is copied: a missing or truncated shard, a tensor missing, of
/// the wrong shape or of a non-floating dtype, or a tensor the model does not have throws CheckpointError
/// naming the file and the tensor; nothing half-loaded is returned. Config errors throw ConfigError.
CausalLM from_pretrained(const std::string& dir, const LoadOptions& options = {});

/// Writes `dir/config.json` and `dir/model.safetensors` (metadata {"format": "pt"}, the parameters in their
/// dtype, tied weights once) as transformers' `save_pretrained` does; transformers' `from_pretrained(dir)`
/// loads it. Creates `dir` if needed. Throws CheckpointError on an I/O error.
void save_pretrained(const CausalLM& model, const std::string& dir);

}  // namespace accel::llm
