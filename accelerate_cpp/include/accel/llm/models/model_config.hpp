#pragma once
/// \file model_config.hpp
/// The architecture of a decoder-only causal language model, read from a Hugging Face `config.json`
/// (torch-free). Llama 2 / 3 / 3.x (`model_type: llama`), Qwen2 / Qwen2.5 (`qwen2`) and Qwen3 (`qwen3`) are
/// one architecture with a few switches (q/k/v biases, q/k norms, tied embeddings, rotary scaling); a key or
/// value this library does not implement is a ConfigError naming the file and the key, never a silent
/// default.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace accel::llm {

/// Rotary position embedding parameters: transformers 5's `rope_parameters`, or the older `rope_theta` +
/// `rope_scaling` pair (both are read).
struct RopeConfig {
  /// "default", "linear", "llama3" or "yarn".
  std::string rope_type = "default";
  double rope_theta = 10000.0;
  /// linear, llama3, yarn: the scaling factor (yarn: when absent, max_position_embeddings /
  /// original_max_position_embeddings).
  std::optional<double> factor;
  /// llama3: the low / high frequency factors.
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  /// llama3, yarn: the context length of pre-training (defaults to max_position_embeddings).
  std::optional<std::int64_t> original_max_position_embeddings;
  /// yarn: optional overrides, as transformers reads them.
  std::optional<double> attention_factor;
  std::optional<double> beta_fast;
  std::optional<double> beta_slow;
  std::optional<double> mscale;
  std::optional<double> mscale_all_dim;
  bool truncate = true;
};

/// The architecture of a Llama / Qwen2 / Qwen3 causal LM (the fields of transformers' configuration classes
/// that change what the model computes).
struct ModelConfig {
  std::string model_type;  ///< "llama", "qwen2" or "qwen3"
  std::int64_t vocab_size = 0;
  std::int64_t hidden_size = 0;
  std::int64_t intermediate_size = 0;
  std::int64_t num_hidden_layers = 0;
  std::int64_t num_attention_heads = 0;
  std::int64_t num_key_value_heads = 0;
  std::int64_t head_dim = 0;  ///< hidden_size / num_attention_heads unless the file sets it
  std::int64_t max_position_embeddings = 0;
  double rms_norm_eps = 1e-6;
  bool tie_word_embeddings = false;
  /// Bias on q/k/v (Qwen2: always; Llama, Qwen3: `attention_bias`, which also gives o_proj one).
  bool qkv_bias = false;
  bool o_bias = false;
  /// Bias on gate/up/down (Llama's `mlp_bias`).
  bool mlp_bias = false;
  /// RMSNorm over each head of q and k before the rotation (Qwen3).
  bool qk_norm = false;
  std::string hidden_act = "silu";
  RopeConfig rope;
  /// The checkpoint's dtype (`dtype`, or `torch_dtype` in older files): "float32", "bfloat16", "float16" or
  /// "" when the file does not say.
  std::string dtype;
  std::optional<std::int64_t> bos_token_id;
  std::vector<std::int64_t> eos_token_ids;  ///< `eos_token_id`: one id or a list
  std::optional<std::int64_t> pad_token_id;
  /// Sliding-window attention (Qwen2 / Qwen3: `use_sliding_window`, `sliding_window`, `max_window_layers`,
  /// `layer_types`, as transformers reads them): the window when `use_sliding_window` is true (a query at
  /// position p attends to the keys at p - sliding_window + 1 .. p), unset otherwise.
  std::optional<std::int64_t> sliding_window;
  /// `max_window_layers`: without `layer_types`, the layers from this index on slide (when the window is
  /// set).
  std::int64_t max_window_layers = 28;
  /// Transformers' `layer_types`: "full_attention" or "sliding_attention" per layer; the file's list, or
  /// derived from max_window_layers as transformers does. Empty: derived when asked (is_sliding_layer).
  std::vector<std::string> layer_types;
  /// Whether layer `layer` attends through the sliding window (false when sliding_window is unset).
  bool is_sliding_layer(std::int64_t layer) const;

  /// Parses the text of a config.json; `file` names it in errors. Throws accel::ConfigError naming the file
  /// and the key (an unknown `model_type`, a layer type other than full / sliding attention, a sliding window
  /// on a Llama config, an activation other than silu, a rope type not listed in RopeConfig, a missing or
  /// mistyped key, a key this library does not know).
  static ModelConfig from_json(const std::string& json_text, const std::string& file = "config.json");
  /// Reads `path` (a config.json) with from_json.
  static ModelConfig from_file(const std::string& path);
  /// The config.json text transformers writes for this architecture (transformers 5 keys: `rope_parameters`,
  /// `dtype`), which transformers' AutoConfig and from_json read back. `dtype` overrides the field when set.
  std::string to_json(const std::string& dtype = "") const;

  /// Transformers' class name of one block, e.g. "Qwen2DecoderLayer" (the block module's name(): what
  /// `fsdp_transformer_layer_cls_to_wrap` lists).
  std::string decoder_layer_class() const;
  /// Transformers' class name of the model, e.g. "Qwen2ForCausalLM" (config.json's `architectures`).
  std::string architecture() const;
};

}  // namespace accel::llm
