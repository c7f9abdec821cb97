#include "accel/llm/models/causal_lm.hpp"

#include <ATen/autocast_mode.h>
#include <torch/torch.h>

#include <algorithm>
#include <string>

#include "accel/errors.hpp"
#include "accel/nn/activation_checkpoint.hpp"
#include "accel/nn/quant4bit.hpp"
#include "accel/parallel/tensor_parallel.hpp"
#include "llm/models/fused_layer_ops.hpp"
#include "llm/models/sequence_parallel_detail.hpp"
#include "llm/models/tensor_parallel_detail.hpp"

namespace accel::llm {
namespace {

// transformers' class names per family ("Qwen2Attention", ...): module names for wrapping policies.
std::string class_name(const ModelConfig& config, const std::string& part) {
  if (config.model_type == "qwen2") return "Qwen2" + part;
  if (config.model_type == "qwen3") return "Qwen3" + part;
  return "Llama" + part;
}

// Calls the projection registered as `name` under `parent`: a Linear, or what quantize_linears put in its
// place. Looked up on every call (not held as a member) so that module surgery reaches the forward.
torch::Tensor project(const torch::nn::Module& parent, const char* name, const torch::Tensor& x) {
  const auto children = parent.named_children();
  const auto* child = children.find(name);
  if (child == nullptr)
    throw UsageError("accel::llm: module '" + parent.name() + "' has no child '" + name + "'");
  // at::linear as Python's nn.Linear calls it: LibTorch's LinearImpl::forward adds the bias after the matmul
  // for inputs of 3 dimensions (a second bf16 rounding), at::linear fuses it (addmm), as transformers
  // computes.
  // A Linear without children has no LoRA adapter (whose observer watches aten::linear): without gradient,
  // detail::linear's oneDNN GEMM (fused_layer_ops.hpp).
  if (auto* linear = dynamic_cast<torch::nn::LinearImpl*>(child->get()))
    return (*child)->children().empty() ? detail::linear(x, linear->weight, linear->bias)
                                        : torch::linear(x, linear->weight, linear->bias);
  if (auto* q = dynamic_cast<quant::Linear4bitImpl*>(child->get())) return q->forward(x);
  // Tensor parallelism (apply_tensor_parallel): this rank's slice of the heads / MLP features.
  if (auto* c = dynamic_cast<tp::ColumnParallelLinearImpl*>(child->get())) return c->forward(x);
  if (auto* r = dynamic_cast<tp::RowParallelLinearImpl*>(child->get())) return r->forward(x);
  throw UsageError("accel::llm: '" + std::string(name) + "' of '" + parent.name() + "' is a " +
                   (*child)->name() +
                   "; the model's projections must be torch::nn::Linear, quant::Linear4bit or "
                   "tp::ColumnParallelLinear / RowParallelLinear");
}

// Set by a decoder layer for the length of its own checkpoint recomputation (accel::checkpoint_recomputing):
// the layer's output value is then discarded, and the MLP's down_proj, whose output reaches nothing but the
// residual add making that output, builds only its backward graph (PyTorch's non-reentrant checkpoint stops
// recomputing before that matmul: every tensor backward saves is back by then).
thread_local bool tl_layer_output_discarded = false;

struct LayerOutputDiscarded {
  explicit LayerOutputDiscarded(bool on) : saved(std::exchange(tl_layer_output_discarded, on)) {}
  ~LayerOutputDiscarded() { tl_layer_output_discarded = saved; }
  LayerOutputDiscarded(const LayerOutputDiscarded&) = delete;
  LayerOutputDiscarded& operator=(const LayerOutputDiscarded&) = delete;
  bool saved;
};

// project() for a projection whose output value nobody reads: the linear's graph without its matmul
// (accel::linear_graph_only) for a plain Linear or a 4-bit base. A layer whose output something observes or
// changes is computed in full by project(): LoRA's adapters (children of the Linear, the observer adding
// their term; a Linear4bit's output_hook), tensor-parallel layers (their collectives).
torch::Tensor project_graph_only(const torch::nn::Module& parent, const char* name, const torch::Tensor& x) {
  const auto children = parent.named_children();
  const auto* child = children.find(name);
  if (child != nullptr && (*child)->children().empty()) {
    if (auto* linear = dynamic_cast<torch::nn::LinearImpl*>(child->get()))
      return linear_graph_only(x, linear->weight, linear->bias);
    // A 4-bit base: its own node without the product, which keeps the codes (not a dequantised weight)
    // for backward; with an output_hook (LoRA) it computes the value.
    if (auto* q = dynamic_cast<quant::Linear4bitImpl*>(child->get())) return q->forward_graph_only(x);
  }
  return project(parent, name, x);
}

torch::Tensor repeat_kv(const torch::Tensor& x, std::int64_t groups) {
  if (groups == 1) return x;
  const auto b = x.size(0), h = x.size(1), s = x.size(2), d = x.size(3);
  return x.unsqueeze(2).expand({b, h, groups, s, d}).reshape({b, h * groups, s, d});
}

void check_config(const ModelConfig& c) {
  if (c.hidden_size <= 0 || c.num_attention_heads <= 0 || c.num_key_value_heads <= 0 || c.head_dim <= 0 ||
      c.num_hidden_layers <= 0 || c.vocab_size <= 0 || c.intermediate_size <= 0)
    throw UsageError("accel::llm::CausalLM: every size of the ModelConfig must be positive (hidden_size " +
                     std::to_string(c.hidden_size) + ", num_hidden_layers " +
                     std::to_string(c.num_hidden_layers) + ", vocab_size " + std::to_string(c.vocab_size) +
                     ", ...)");
  if (c.num_attention_heads % c.num_key_value_heads != 0)
    throw UsageError("accel::llm::CausalLM: num_key_value_heads " + std::to_string(c.num_key_value_heads) +
                     " does not divide num_attention_heads " + std::to_string(c.num_attention_heads));
  if (c.sliding_window && (c.model_type == "llama" || *c.sliding_window <= 0))
    throw UsageError("accel::llm::CausalLM: sliding_window " + std::to_string(*c.sliding_window) + " on a " +
                     c.model_type +
                     " config; a window must be positive and is implemented for qwen2 and qwen3");
  if (!c.layer_types.empty() && static_cast<std::int64_t>(c.layer_types.size()) != c.num_hidden_layers)
    throw UsageError("accel::llm::CausalLM: layer_types lists " + std::to_string(c.layer_types.size()) +
                     " layers for num_hidden_layers " + std::to_string(c.num_hidden_layers));
}

// The boolean attention mask [B, 1, T, past + T] (true = attend) of causal attention over padded rows, or an
// undefined tensor where SDPA's own causal flag (past == 0) or no mask (T == 1) gives the same. `window` > 0:
// a query at position q also sees only keys k > q - window (transformers' sliding_window_overlay), which
// binds only once past + T exceeds the window.
torch::Tensor build_mask(const torch::Tensor& attention_mask, std::int64_t batch, std::int64_t length,
                         std::int64_t past, const torch::Device& device, std::int64_t window = 0) {
  const std::int64_t total = past + length;
  const bool padded = attention_mask.defined() && !attention_mask.to(torch::kBool).all().item<bool>();
  if (!padded && (past == 0 || length == 1) && (window <= 0 || total <= window)) return {};
  if (attention_mask.defined() && attention_mask.size(-1) != total)
    throw UsageError("accel::llm: attention_mask has " + std::to_string(attention_mask.size(-1)) +
                     " columns but the cache and the input hold " + std::to_string(total) + " positions");
  const auto q = torch::arange(past, total, torch::TensorOptions().dtype(torch::kInt64).device(device));
  const auto k = torch::arange(total, torch::TensorOptions().dtype(torch::kInt64).device(device));
  auto mask = (k.unsqueeze(0) <= q.unsqueeze(1)).view({1, 1, length, total});
  if (window > 0) mask = mask & (k.unsqueeze(0) > q.unsqueeze(1) - window).view({1, 1, length, total});
  if (padded) mask = mask & attention_mask.to(device).to(torch::kBool).view({batch, 1, 1, total});
  return mask.expand({batch, 1, length, total});
}

// Packed rows (several documents in one row, position ids restarting at each, as TRL's padding-free
// collator makes them): which document each position belongs to, or undefined when every row holds one
// (transformers' find_packed_sequence_indices, which create_causal_mask uses when there is no attention_mask
// and no cache).
torch::Tensor packed_sequence_indices(const torch::Tensor& position_ids, std::int64_t batch) {
  auto pos = position_ids.size(0) == batch ? position_ids : position_ids.expand({batch, -1});
  const auto diff = torch::diff(pos, 1, -1, pos.narrow(-1, 0, 1) - 1);
  const auto indices = diff.ne(1).cumsum(-1);
  if (indices.select(-1, -1).eq(0).all().item<bool>()) return {};
  return indices;
}

}  // namespace

std::int64_t KVCache::seq_length() const {
  if (keys.empty() || !keys[0].defined()) return 0;
  return keys[0].size(2) + (dropped.empty() ? 0 : dropped[0]);
}

void KVCache::select_rows(const torch::Tensor& index) {
  for (auto* list : {&keys, &values})
    for (auto& t : *list)
      if (t.defined()) t = t.index_select(0, index.to(t.device()));
}

RMSNormImpl::RMSNormImpl(std::int64_t size, double eps, const std::string& class_name)
    : torch::nn::Module(class_name), eps_(eps) {
  weight = register_parameter("weight", torch::ones({size}));
}

torch::Tensor RMSNormImpl::forward(const torch::Tensor& x) {
  return detail::rms_norm(x, weight, eps_);  // transformers' ops in one autograd node
}

AttentionImpl::AttentionImpl(const ModelConfig& c, std::int64_t layer_index)
    : torch::nn::Module(class_name(c, "Attention")),
      layer_index_(layer_index),
      num_heads_(c.num_attention_heads),
      num_kv_heads_(c.num_key_value_heads),
      head_dim_(c.head_dim),
      qk_norm_(c.qk_norm) {
  using torch::nn::LinearOptions;
  const auto q = c.num_attention_heads * c.head_dim, kv = c.num_key_value_heads * c.head_dim;
  register_module("q_proj", torch::nn::Linear(LinearOptions(c.hidden_size, q).bias(c.qkv_bias)));
  register_module("k_proj", torch::nn::Linear(LinearOptions(c.hidden_size, kv).bias(c.qkv_bias)));
  register_module("v_proj", torch::nn::Linear(LinearOptions(c.hidden_size, kv).bias(c.qkv_bias)));
  register_module("o_proj", torch::nn::Linear(LinearOptions(q, c.hidden_size).bias(c.o_bias)));
  if (qk_norm_) {
    register_module("q_norm", RMSNorm(c.head_dim, c.rms_norm_eps, class_name(c, "RMSNorm")));
    register_module("k_norm", RMSNorm(c.head_dim, c.rms_norm_eps, class_name(c, "RMSNorm")));
  }
}

torch::Tensor AttentionImpl::forward(const torch::Tensor& x, const torch::Tensor& cos,
                                     const torch::Tensor& sin, const torch::Tensor& mask, KVCache* cache) {
  const auto batch = x.size(0), length = x.size(1);
  auto q = project(*this, "q_proj", x).view({batch, length, -1, head_dim_});
  auto k = project(*this, "k_proj", x).view({batch, length, -1, head_dim_});
  auto v = project(*this, "v_proj", x).view({batch, length, -1, head_dim_}).transpose(1, 2);
  if (qk_norm_) {
    const auto children = named_children();
    q = std::static_pointer_cast<RMSNormImpl>(children["q_norm"])->forward(q);
    k = std::static_pointer_cast<RMSNormImpl>(children["k_norm"])->forward(k);
  }
  q = q.transpose(1, 2);
  k = k.transpose(1, 2);
  const auto c = cos.unsqueeze(1), s = sin.unsqueeze(1);
  q = detail::apply_rotary(q, c, s);
  k = detail::apply_rotary(k, c, s);
  if (sequence_.group) {  // sequence / context parallelism: the heads or the keys travel (no cache)
    const auto out = detail::sequence_parallel_attention(sequence_, q, k, v, mask, num_heads_ / num_kv_heads_,
                                                         1.0 / std::sqrt(static_cast<double>(head_dim_)));
    return project(*this, "o_proj", out);
  }
  if (cache != nullptr) {
    if (cache->keys.size() <= static_cast<std::size_t>(layer_index_)) {
      cache->keys.resize(layer_index_ + 1);
      cache->values.resize(layer_index_ + 1);
    }
    auto& ck = cache->keys[layer_index_];
    auto& cv = cache->values[layer_index_];
    ck = ck.defined() ? torch::cat({ck, k}, 2) : k;
    cv = cv.defined() ? torch::cat({cv, v}, 2) : v;
    k = ck;
    v = cv;
  }
  const auto groups = num_heads_ / num_kv_heads_;
  const double scale = 1.0 / std::sqrt(static_cast<double>(head_dim_));
  torch::Tensor out;
  if (mask.defined()) {
    // With a mask, SDPA's CPU kernels take repeated heads (as transformers does).
    out = torch::scaled_dot_product_attention(q, repeat_kv(k, groups), repeat_kv(v, groups), mask, 0.0, false,
                                              scale);
  } else {
    out = torch::scaled_dot_product_attention(q, k, v, {}, 0.0, length > 1, scale, groups > 1);
  }
  out = out.transpose(1, 2).reshape({batch, length, -1});
  return project(*this, "o_proj", out);
}

MlpImpl::MlpImpl(const ModelConfig& c) : torch::nn::Module(class_name(c, "MLP")) {
  using torch::nn::LinearOptions;
  register_module("gate_proj",
                  torch::nn::Linear(LinearOptions(c.hidden_size, c.intermediate_size).bias(c.mlp_bias)));
  register_module("up_proj",
                  torch::nn::Linear(LinearOptions(c.hidden_size, c.intermediate_size).bias(c.mlp_bias)));
  register_module("down_proj",
                  torch::nn::Linear(LinearOptions(c.intermediate_size, c.hidden_size).bias(c.mlp_bias)));
}

torch::Tensor MlpImpl::forward(const torch::Tensor& x) {
  const auto down = tl_layer_output_discarded ? project_graph_only : project;  // see project_graph_only
  return down(*this, "down_proj", torch::silu(project(*this, "gate_proj", x)) * project(*this, "up_proj", x));
}

DecoderLayerImpl::DecoderLayerImpl(const ModelConfig& c, std::int64_t layer_index)
    : torch::nn::Module(c.decoder_layer_class()) {
  register_module("self_attn", Attention(c, layer_index));
  register_module("mlp", Mlp(c));
  register_module("input_layernorm", RMSNorm(c.hidden_size, c.rms_norm_eps, class_name(c, "RMSNorm")));
  register_module("post_attention_layernorm",
                  RMSNorm(c.hidden_size, c.rms_norm_eps, class_name(c, "RMSNorm")));
}

torch::Tensor DecoderLayerImpl::forward(const torch::Tensor& x, const torch::Tensor& cos,
                                        const torch::Tensor& sin, const torch::Tensor& mask, KVCache* cache) {
  if (cache == nullptr && gradient_checkpointing()) {
    // cos, sin and the mask need no gradient: captured, not inputs.
    return checkpointed_call(
        [=](const torch::Tensor& h) {
          const LayerOutputDiscarded discarded(checkpoint_recomputing());  // see project_graph_only
          return forward_block(h, cos, sin, mask, nullptr);
        },
        x, is_training());
  }
  return forward_block(x, cos, sin, mask, cache);
}

torch::Tensor DecoderLayerImpl::forward_block(const torch::Tensor& x, const torch::Tensor& cos,
                                              const torch::Tensor& sin, const torch::Tensor& mask,
                                              KVCache* cache) {
  const auto children = named_children();
  auto norm = [&](const char* name, const torch::Tensor& h) {
    return std::static_pointer_cast<RMSNormImpl>(children[name])->forward(h);
  };
  auto h = x + std::static_pointer_cast<AttentionImpl>(children["self_attn"])
                   ->forward(norm("input_layernorm", x), cos, sin, mask, cache);
  return h + std::static_pointer_cast<MlpImpl>(children["mlp"])->forward(norm("post_attention_layernorm", h));
}

DecoderModelImpl::DecoderModelImpl(const ModelConfig& c,
                                   const std::function<void(torch::nn::Module& block)>& on_block)
    : torch::nn::Module(class_name(c, "Model")), rotary_(rotary_tables(c)) {
  for (std::int64_t i = 0; i < c.num_hidden_layers; ++i)
    sliding_layers_.push_back(c.is_sliding_layer(i));
  sliding_window_ = c.sliding_window.value_or(0);
  auto options = torch::nn::EmbeddingOptions(c.vocab_size, c.hidden_size);
  if (c.pad_token_id && *c.pad_token_id >= 0 && *c.pad_token_id < c.vocab_size)
    options.padding_idx(*c.pad_token_id);  // as transformers: the pad row gets no gradient
  embed_tokens = register_module("embed_tokens", torch::nn::Embedding(options));
  layers = register_module("layers", torch::nn::ModuleList());
  for (std::int64_t i = 0; i < c.num_hidden_layers; ++i) {
    DecoderLayer block(c, i);
    if (on_block) on_block(*block);
    layers->push_back(block);
  }
  norm = register_module("norm", RMSNorm(c.hidden_size, c.rms_norm_eps, class_name(c, "RMSNorm")));
}

torch::Tensor DecoderModelImpl::forward(const torch::Tensor& input_ids, const torch::Tensor& attention_mask,
                                        const torch::Tensor& position_ids, KVCache* cache) {
  if (input_ids.dim() != 2)
    throw UsageError("accel::llm: input_ids must be [batch, length], got " + std::to_string(input_ids.dim()) +
                     " dimensions");
  const auto batch = input_ids.size(0), length = input_ids.size(1);
  const std::int64_t past = cache != nullptr ? cache->seq_length() : 0;
  // A vocabulary-parallel embedding (apply_tensor_parallel with vocab_parallel) replaced the registered child
  // and left the member empty.
  auto h = embed_tokens.is_empty()
               ? detail::vocab_parallel_embed(*named_children()["embed_tokens"], input_ids)
           : sparse_lookup_gradient && cache == nullptr
               ? torch::embedding(embed_tokens->weight, input_ids,
                                  embed_tokens->options.padding_idx().value_or(-1), false, /*sparse=*/true)
               : embed_tokens->forward(input_ids);
  if (!h.defined())
    throw UsageError("accel::llm: model.embed_tokens is a " + named_children()["embed_tokens"]->name() +
                     ", not an embedding this model can call");
  const auto device = h.device();
  auto positions =
      position_ids.defined()
          ? position_ids.to(device)
          : torch::arange(past, past + length, torch::TensorOptions().dtype(torch::kInt64).device(device))
                .unsqueeze(0);
  // cos/sin as transformers' RotaryEmbedding: float32 products, scaled, then cast to the hidden dtype.
  const auto freqs = positions.unsqueeze(-1).to(torch::kFloat32) * rotary_.inv_freq.to(device);
  const auto emb = torch::cat({freqs, freqs}, -1);
  const auto cos = (emb.cos() * rotary_.attention_scaling).to(h.scalar_type());
  const auto sin = (emb.sin() * rotary_.attention_scaling).to(h.scalar_type());
  const bool sliding =
      std::find(sliding_layers_.begin(), sliding_layers_.end(), true) != sliding_layers_.end();
  if (sequence_.group && sliding)  // enable_sequence_parallel refuses it; a hand-set split must not slip by
    throw UsageError("accel::llm: sequence / context parallelism does not implement sliding-window layers");
  torch::Tensor doc;  // packed rows: no attention across documents (transformers' packed-sequence mask)
  if (!sequence_.group && !attention_mask.defined() && position_ids.defined() && cache == nullptr)
    doc = packed_sequence_indices(positions, batch);
  auto mask_of = [&](std::int64_t window) {
    if (!doc.defined()) return build_mask(attention_mask, batch, length, past, device, window);
    // Within a document positions are consecutive, so the window over positions is the one over indices.
    const auto i = torch::arange(length, torch::TensorOptions().dtype(torch::kInt64).device(device));
    auto band = i.unsqueeze(0) <= i.unsqueeze(1);
    if (window > 0) band = band & (i.unsqueeze(0) > i.unsqueeze(1) - window);
    return band.view({1, 1, length, length}) & doc.unsqueeze(-1).eq(doc.unsqueeze(-2)).unsqueeze(1);
  };
  const auto mask = sequence_.group
                        ? detail::sequence_parallel_mask(sequence_, attention_mask, positions, batch, cache)
                        : mask_of(0);
  auto sliding_mask = sliding ? mask_of(sliding_window_) : torch::Tensor();
  // A sliding layer's cache dropped its oldest positions (crop_sliding_cache): its keys are the last columns.
  const std::int64_t dropped = sliding && cache != nullptr ? sliding_cache_dropped(*cache) : 0;
  if (dropped > 0 && sliding_mask.defined()) sliding_mask = sliding_mask.slice(-1, dropped);
  for (std::size_t i = 0; i < layers->size(); ++i) {
    auto* layer = layers->ptr(i)->as<DecoderLayerImpl>();
    if (layer == nullptr)
      throw UsageError("accel::llm: model.layers holds a " + layers->ptr(i)->name() + ", not a block");
    const bool slides = i < sliding_layers_.size() && sliding_layers_[i];
    h = layer->forward(h, cos, sin, slides ? sliding_mask : mask, cache);
  }
  if (sliding && cache != nullptr) crop_sliding_cache(*cache);
  return norm->forward(h);
}

std::int64_t DecoderModelImpl::sliding_cache_dropped(const KVCache& cache) const {
  for (std::size_t i = 0; i < sliding_layers_.size(); ++i)
    if (sliding_layers_[i]) return i < cache.dropped.size() ? cache.dropped[i] : 0;
  return 0;
}

// transformers' DynamicSlidingWindowLayer: a sliding layer keeps its last sliding_window - 1 positions, all
// that the next query's window reaches. Dropped positions are counted (KVCache::seq_length, the mask above).
void DecoderModelImpl::crop_sliding_cache(KVCache& cache) const {
  cache.dropped.resize(cache.keys.size(), 0);
  const std::int64_t keep = sliding_window_ - 1;
  for (std::size_t i = 0; i < sliding_layers_.size() && i < cache.keys.size(); ++i) {
    if (!sliding_layers_[i] || !cache.keys[i].defined()) continue;
    const std::int64_t excess = cache.keys[i].size(2) - keep;
    if (excess <= 0) continue;
    cache.keys[i] = cache.keys[i].slice(2, excess);
    cache.values[i] = cache.values[i].slice(2, excess);
    cache.dropped[i] += excess;
  }
}

void DecoderModelImpl::gradient_checkpointing_enable(bool enable) {
  for (const auto& module : *layers) {
    if (auto* layer = module->as<DecoderLayerImpl>()) {
      if (enable) {
        layer->gradient_checkpointing_enable();
      } else {
        layer->gradient_checkpointing_disable();
      }
    }
  }
}

CausalLMImpl::CausalLMImpl(const ModelConfig& c,
                           const std::function<void(torch::nn::Module& block)>& on_block)
    : torch::nn::Module(c.architecture()), config_(c) {
  check_config(c);
  model = register_module("model", DecoderModel(c, on_block));
  if (!c.tie_word_embeddings)
    register_module("lm_head",
                    torch::nn::Linear(torch::nn::LinearOptions(c.hidden_size, c.vocab_size).bias(false)));
}

torch::Tensor CausalLMImpl::output_weight() const {
  if (detail::vocab_parallel_group(*this))
    throw UsageError(
        "accel::llm::CausalLM::output_weight: the head is split over the vocabulary (apply_tensor_parallel "
        "with vocab_parallel): each rank holds only its rows; use vocab_parallel_fused_linear_cross_entropy "
        "(accel/llm/training/vocab_parallel_loss.hpp) or the model's gathered logits");
  if (config_.tie_word_embeddings) return model->embed_tokens->weight;
  const auto children = named_children();
  auto* linear = dynamic_cast<torch::nn::LinearImpl*>(children["lm_head"].get());
  if (linear == nullptr)
    throw UsageError("accel::llm::CausalLM::output_weight: lm_head is no longer a Linear");
  return linear->weight;
}

std::pair<std::string, std::string> CausalLMImpl::tied_embeddings() const {
  if (!config_.tie_word_embeddings) return {};
  return {"lm_head", "model.embed_tokens"};
}

void CausalLMImpl::untie_word_embeddings() {
  if (!config_.tie_word_embeddings) return;
  if (detail::vocab_parallel_group(*this))
    throw UsageError(
        "accel::llm::CausalLM::untie_word_embeddings: the tied head is split over the vocabulary "
        "(apply_tensor_parallel with vocab_parallel); untie before applying tensor parallelism");
  if (model->embed_tokens.is_empty())
    throw UsageError("accel::llm::CausalLM::untie_word_embeddings: the model holds no embed_tokens to copy");
  const auto& shared = model->embed_tokens->weight;
  // Made with no rows, so that LinearImpl's reset draws nothing (a random [vocab, hidden] matrix, thrown
  // away: 151,936 x 896 on Qwen2-0.5B) and the random stream stays as it was; it then holds the copy.
  torch::nn::Linear head(torch::nn::LinearOptions(config_.hidden_size, 0).bias(false));
  head->options.out_features(config_.vocab_size);
  {
    torch::NoGradGuard no_grad;
    head->weight.set_data(shared.detach().clone());
  }
  head->weight.set_requires_grad(shared.requires_grad());
  register_module("lm_head", head);
  config_.tie_word_embeddings = false;
}

torch::Tensor CausalLMImpl::forward(const torch::Tensor& input_ids, const torch::Tensor& attention_mask,
                                    const torch::Tensor& position_ids, KVCache* cache) {
  const auto h = cache == nullptr ? hidden_states_for_head(input_ids, attention_mask, position_ids)
                                  : model->forward(input_ids, attention_mask, position_ids, cache);
  // Split over the vocabulary: every rank's logits gathered (transformers' colwise_gather_output).
  if (const auto group = detail::vocab_parallel_group(*this))
    return tp::gather_from_tensor_parallel(detail::vocab_parallel_logits(*this, h), group);
  if (config_.tie_word_embeddings) return detail::linear(h, model->embed_tokens->weight);
  return project(*this, "lm_head", h);
}

torch::Tensor CausalLMImpl::hidden_states_for_head(const torch::Tensor& input_ids,
                                                   const torch::Tensor& attention_mask,
                                                   const torch::Tensor& position_ids) {
  auto& body = *model;
  // Only a tied, trained weight in grad mode: an untied embedding's own gradient must stay dense (nothing
  // dense joins it), and without grad there is nothing to save.
  const bool sparse = config_.tie_word_embeddings && !body.embed_tokens.is_empty() &&
                      body.embed_tokens->weight.requires_grad() && torch::GradMode::is_enabled();
  struct Reset {
    bool& flag;
    ~Reset() { flag = false; }
  } reset{body.sparse_lookup_gradient};
  body.sparse_lookup_gradient = sparse;
  return body.forward(input_ids, attention_mask, position_ids);
}

torch::Tensor causal_lm_loss(const torch::Tensor& logits, const torch::Tensor& labels,
                             std::optional<std::int64_t> num_items_in_batch, std::int64_t ignore_index) {
  if (logits.dim() != 3 || labels.dim() != 2 || logits.size(0) != labels.size(0) ||
      logits.size(1) != labels.size(1))
    throw UsageError(
        "accel::llm::causal_lm_loss: logits must be [B, T, V] and labels [B, T] of the same B and T");
  const auto vocab = logits.size(-1);
  const auto shifted = torch::constant_pad_nd(labels, {0, 1}, ignore_index)
                           .slice(1, 1)
                           .contiguous()
                           .view(-1)
                           .to(logits.device());
  namespace F = torch::nn::functional;
  const auto flat = logits.to(torch::kFloat32).view({-1, vocab});
  if (!num_items_in_batch)
    return F::cross_entropy(flat, shifted, F::CrossEntropyFuncOptions().ignore_index(ignore_index));
  return F::cross_entropy(flat, shifted,
                          F::CrossEntropyFuncOptions().ignore_index(ignore_index).reduction(torch::kSum)) /
         static_cast<double>(*num_items_in_batch);
}

}  // namespace accel::llm
