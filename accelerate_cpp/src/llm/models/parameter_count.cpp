// Parameter counts from config.json (parameter_count.hpp), the shapes causal_lm.cpp builds.
#include "accel/llm/models/parameter_count.hpp"

#include "accel/errors.hpp"

#include <algorithm>
#include <utility>

namespace accel::llm {

namespace {

struct Projection {
  const char* name;
  std::int64_t in, out;
  bool bias;
};

// The Linear layers of one block, with their shapes (transformers' names).
std::vector<Projection> projections(const ModelConfig& c) {
  const std::int64_t q = c.num_attention_heads * c.head_dim, kv = c.num_key_value_heads * c.head_dim;
  return {{"q_proj", c.hidden_size, q, c.qkv_bias},
          {"k_proj", c.hidden_size, kv, c.qkv_bias},
          {"v_proj", c.hidden_size, kv, c.qkv_bias},
          {"o_proj", q, c.hidden_size, c.o_bias},
          {"gate_proj", c.hidden_size, c.intermediate_size, c.mlp_bias},
          {"up_proj", c.hidden_size, c.intermediate_size, c.mlp_bias},
          {"down_proj", c.intermediate_size, c.hidden_size, c.mlp_bias}};
}

}  // namespace

std::int64_t ParameterCount::largest_unit() const {
  return std::max({per_layer, embedding, lm_head});
}

ParameterCount count_parameters(const ModelConfig& c) {
  ParameterCount n;
  n.embedding = c.vocab_size * c.hidden_size;
  for (const auto& p : projections(c)) {
    n.per_layer += p.in * p.out + (p.bias ? p.out : 0);
    n.projection_weights += p.in * p.out * c.num_hidden_layers;
    n.largest_projection = std::max(n.largest_projection, p.in * p.out + (p.bias ? p.out : 0));
  }
  n.per_layer += 2 * c.hidden_size;              // input_layernorm, post_attention_layernorm
  if (c.qk_norm) n.per_layer += 2 * c.head_dim;  // q_norm, k_norm
  n.layers = n.per_layer * c.num_hidden_layers;
  n.final_norm = c.hidden_size;
  n.lm_head = c.tie_word_embeddings ? 0 : c.vocab_size * c.hidden_size;
  return n;
}

namespace {

// The block's projections LoRA adapts for `target_modules` (PEFT's list form, or all-linear); throws naming a
// target that names no Linear of this architecture.
std::vector<Projection> lora_targets(const ModelConfig& c, const std::vector<std::string>& target_modules) {
  const auto all = projections(c);
  const bool all_linear =
      target_modules.size() == 1 && (target_modules[0] == "all-linear" || target_modules[0] == "ALL-LINEAR");
  std::vector<Projection> out;
  for (const auto& p : all) {
    if (all_linear || std::find(target_modules.begin(), target_modules.end(), p.name) != target_modules.end())
      out.push_back(p);
  }
  for (const auto& t : target_modules) {
    if (all_linear) break;
    if (std::none_of(all.begin(), all.end(), [&](const Projection& p) { return t == p.name; })) {
      throw ConfigError(
          "lora_target_modules: '" + t + "' names no Linear of a " + c.model_type +
          " block (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, or all-linear)");
    }
  }
  return out;
}

}  // namespace

std::int64_t count_lora_parameters(const ModelConfig& c, const std::vector<std::string>& target_modules,
                                   std::int64_t r) {
  std::int64_t per_layer = 0;
  for (const auto& p : lora_targets(c, target_modules))
    per_layer += r * (p.in + p.out);
  return per_layer * c.num_hidden_layers;
}

std::int64_t largest_lora_matrix(const ModelConfig& c, const std::vector<std::string>& target_modules,
                                 std::int64_t r) {
  std::int64_t largest = 0;
  for (const auto& p : lora_targets(c, target_modules))
    largest = std::max(largest, r * std::max(p.in, p.out));
  return largest;
}

}  // namespace accel::llm
