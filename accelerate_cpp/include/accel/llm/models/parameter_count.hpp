#pragma once
/// \file parameter_count.hpp
/// Parameter counts of a Llama / Qwen2 / Qwen3 causal LM from its config.json alone (torch-free): what
/// `accel-launch estimate-memory --model_config` needs to predict a training type's memory without building
/// the model. Equal to `sum(p.numel() for p in model.parameters())` of transformers' model (a tied head
/// counted once) and to accel::llm::CausalLM's parameters().

#include <accel/llm/models/model_config.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace accel::llm {

/// Elements of a model's parameters by part.
struct ParameterCount {
  std::int64_t embedding = 0;  ///< model.embed_tokens
  std::int64_t per_layer = 0;  ///< one decoder layer (every layer is the same)
  std::int64_t layers = 0;     ///< per_layer x num_hidden_layers
  std::int64_t final_norm = 0;
  std::int64_t lm_head = 0;  ///< 0 when tied to the embedding
  /// The blocks' Linear weights, every layer (part of `layers`): what load_in_4bit quantises; their biases,
  /// the norms, the embedding and the head stay in the compute dtype.
  std::int64_t projection_weights = 0;
  /// Elements of a block's largest Linear, weight and bias (the MLP's in Qwen2 and Llama): ZeRO-3 gathers
  /// module by module, so this is the largest unit a block contributes there.
  std::int64_t largest_projection = 0;
  std::int64_t total() const { return embedding + layers + final_norm + lm_head; }
  /// Elements of the largest unit FSDP / ZeRO-3 gathers at once (a decoder layer, or the embedding / head).
  std::int64_t largest_unit() const;
};

/// The counts of `config`'s model.
ParameterCount count_parameters(const ModelConfig& config);

/// Elements of LoRA adapters of rank `r` on `target_modules` (module names such as "q_proj", matched as
/// PEFT's list form; {"all-linear"}: every projection of the blocks, as PEFT's shorthand leaves out only the
/// output head): r x (in + out) per adapted Linear. Throws accel::ConfigError naming a target that names no
/// Linear of this architecture.
std::int64_t count_lora_parameters(const ModelConfig& config, const std::vector<std::string>& target_modules,
                                   std::int64_t r);

/// Elements of the largest LoRA matrix of rank `r` on `target_modules` (lora_A r x in, lora_B out x r, as
/// count_lora_parameters matches them): under ZeRO-3 each is a unit of its own, and its gradient buffer the
/// largest an adapter unit holds. Throws as count_lora_parameters.
std::int64_t largest_lora_matrix(const ModelConfig& config, const std::vector<std::string>& target_modules,
                                 std::int64_t r);

}  // namespace accel::llm
