#include "accel/llm/models/model_config.hpp"

#include <algorithm>
#include <cmath>
#include <set>
#include <string>

#include <nlohmann/json.hpp>

#include "accel/errors.hpp"
#include "config/small_file.hpp"

namespace accel::llm {
namespace {

using Json = nlohmann::json;

// Keys transformers writes that do not change what the model computes (bookkeeping, training-time defaults of
// other code, generation defaults read elsewhere). Anything else unknown is refused, naming the key.
const std::set<std::string> kIgnoredKeys = {"architectures",
                                            "auto_map",
                                            "_name_or_path",
                                            "transformers_version",
                                            "use_cache",
                                            "initializer_range",
                                            "max_window_layers",
                                            "sliding_window",
                                            "output_attentions",
                                            "output_hidden_states",
                                            "return_dict",
                                            "use_return_dict",
                                            "torchscript",
                                            "id2label",
                                            "label2id",
                                            "problem_type",
                                            "tokenizer_class",
                                            "prefix",
                                            "task_specific_params",
                                            "finetuning_task",
                                            "chunk_size_feed_forward",
                                            "is_encoder_decoder",
                                            "is_decoder",
                                            "add_cross_attention",
                                            "tie_encoder_decoder",
                                            "pruned_heads",
                                            "cross_attention_hidden_size",
                                            "pretraining_tp",
                                            "bos_token_id",
                                            "eos_token_id",
                                            "pad_token_id",
                                            "sep_token_id",
                                            "decoder_start_token_id",
                                            "model_type",
                                            "attention_dropout",
                                            "layer_types",
                                            "use_sliding_window",
                                            "rope_theta",
                                            "rope_scaling",
                                            "rope_parameters",
                                            "dtype",
                                            "torch_dtype",
                                            "head_dim",
                                            "attention_bias",
                                            "mlp_bias",
                                            "hidden_act",
                                            "tie_word_embeddings",
                                            "vocab_size",
                                            "hidden_size",
                                            "intermediate_size",
                                            "num_hidden_layers",
                                            "num_attention_heads",
                                            "num_key_value_heads",
                                            "rms_norm_eps",
                                            "max_position_embeddings",
                                            "partial_rotary_factor",
                                            "quantization_config",
                                            "embedding_multiplier",
                                            "use_bfloat16",
                                            "_attn_implementation",
                                            "_attn_implementation_autoset",
                                            "attn_implementation",
                                            "output_router_logits",
                                            "keys_to_ignore_at_inference",
                                            "max_length",
                                            "min_length",
                                            "do_sample",
                                            "early_stopping",
                                            "num_beams",
                                            "temperature",
                                            "top_k",
                                            "top_p",
                                            "repetition_penalty",
                                            "length_penalty",
                                            "no_repeat_ngram_size",
                                            "bad_words_ids",
                                            "num_return_sequences",
                                            "diversity_penalty",
                                            "num_beam_groups",
                                            "typical_p",
                                            "forced_bos_token_id",
                                            "forced_eos_token_id",
                                            "remove_invalid_values",
                                            "exponential_decay_length_penalty",
                                            "suppress_tokens",
                                            "begin_suppress_tokens",
                                            "encoder_no_repeat_ngram_size",
                                            "tf_legacy_loss",
                                            "return_dict_in_generate",
                                            "output_scores"};

class Reader {
 public:
  Reader(const Json& root, std::string file) : root_(root), file_(std::move(file)) {}

  [[noreturn]] void fail(const std::string& key, const std::string& what) const {
    throw ConfigError(file_ + ": key \"" + key + "\" " + what, file_, 0, key);
  }
  bool has(const std::string& key) const { return root_.contains(key) && !root_.at(key).is_null(); }
  bool present(const std::string& key) const { return root_.contains(key); }
  const Json& at(const std::string& key) const { return root_.at(key); }

  std::int64_t integer(const std::string& key) const {
    if (!has(key)) fail(key, "is missing; a " + model_type() + " config.json must set it");
    return integer_of(at(key), key);
  }
  std::int64_t integer_or(const std::string& key, std::int64_t fallback) const {
    return has(key) ? integer_of(at(key), key) : fallback;
  }
  double number_or(const std::string& key, double fallback) const {
    if (!has(key)) return fallback;
    if (!at(key).is_number()) fail(key, "is " + at(key).dump() + " but must be a number");
    return at(key).get<double>();
  }
  bool boolean_or(const std::string& key, bool fallback) const {
    if (!has(key)) return fallback;
    if (!at(key).is_boolean()) fail(key, "is " + at(key).dump() + " but must be true or false");
    return at(key).get<bool>();
  }
  std::string string_or(const std::string& key, const std::string& fallback) const {
    if (!has(key)) return fallback;
    if (!at(key).is_string()) fail(key, "is " + at(key).dump() + " but must be a string");
    return at(key).get<std::string>();
  }
  std::int64_t integer_of(const Json& value, const std::string& key) const {
    if (!value.is_number_integer()) fail(key, "is " + value.dump() + " but must be an integer");
    return value.get<std::int64_t>();
  }
  std::string model_type() const {
    return root_.contains("model_type") && root_["model_type"].is_string()
               ? root_["model_type"].get<std::string>()
               : std::string("llama/qwen2/qwen3");
  }
  const std::string& file() const { return file_; }

 private:
  const Json& root_;
  std::string file_;
};

std::optional<double> optional_number(const Reader& r, const Json& dict, const std::string& dict_key,
                                      const std::string& key) {
  if (!dict.contains(key) || dict[key].is_null()) return std::nullopt;
  if (!dict[key].is_number())
    r.fail(dict_key + "." + key, "is " + dict[key].dump() + " but must be a number");
  return dict[key].get<double>();
}

// The keys a rope dict of each type may hold (transformers' _validate_*_rope_parameters).
const std::set<std::string>& rope_keys(const std::string& type) {
  static const std::set<std::string> kDefault = {"rope_type", "type", "rope_theta"};
  static const std::set<std::string> kLinear = {"rope_type", "type", "rope_theta", "factor"};
  static const std::set<std::string> kLlama3 = {"rope_type",
                                                "type",
                                                "rope_theta",
                                                "factor",
                                                "low_freq_factor",
                                                "high_freq_factor",
                                                "original_max_position_embeddings"};
  static const std::set<std::string> kYarn = {
      "rope_type",        "type",      "rope_theta", "factor", "original_max_position_embeddings",
      "attention_factor", "beta_fast", "beta_slow",  "mscale", "mscale_all_dim",
      "truncate"};
  if (type == "linear") return kLinear;
  if (type == "llama3") return kLlama3;
  if (type == "yarn") return kYarn;
  return kDefault;
}

RopeConfig read_rope(const Reader& r, std::int64_t max_positions) {
  RopeConfig rope;
  rope.rope_theta = r.number_or("rope_theta", 10000.0);
  std::string dict_key = r.has("rope_parameters") ? "rope_parameters" : "rope_scaling";
  if (!r.has(dict_key)) return rope;
  const Json& dict = r.at(dict_key);
  if (!dict.is_object()) r.fail(dict_key, "is " + dict.dump() + " but must be an object");
  if (dict.contains("rope_type") && dict["rope_type"].is_string()) {
    rope.rope_type = dict["rope_type"].get<std::string>();
  } else if (dict.contains("type") && dict["type"].is_string()) {
    rope.rope_type = dict["type"].get<std::string>();
  }
  if (rope.rope_type != "default" && rope.rope_type != "linear" && rope.rope_type != "llama3" &&
      rope.rope_type != "yarn") {
    r.fail(dict_key + ".rope_type",
           "is \"" + rope.rope_type +
               "\", which accelerate-cpp does not implement; supported: default, linear, llama3, yarn");
  }
  for (const auto& item : dict.items()) {
    if (rope_keys(rope.rope_type).count(item.key()) == 0) {
      r.fail(dict_key + "." + item.key(), "is not implemented for rope_type \"" + rope.rope_type +
                                              "\" (accelerate-cpp would ignore it and compute other "
                                              "positions than transformers)");
    }
  }
  if (auto theta = optional_number(r, dict, dict_key, "rope_theta")) rope.rope_theta = *theta;
  rope.factor = optional_number(r, dict, dict_key, "factor");
  if ((rope.rope_type == "linear" || rope.rope_type == "llama3") && !rope.factor)
    r.fail(dict_key + ".factor", "is missing; rope_type \"" + rope.rope_type + "\" needs it");
  if (rope.rope_type == "llama3") {
    for (const char* key : {"low_freq_factor", "high_freq_factor"}) {
      if (!optional_number(r, dict, dict_key, key))
        r.fail(dict_key + "." + key, "is missing; rope_type \"llama3\" needs it");
    }
    rope.low_freq_factor = *optional_number(r, dict, dict_key, "low_freq_factor");
    rope.high_freq_factor = *optional_number(r, dict, dict_key, "high_freq_factor");
  }
  if (auto original = optional_number(r, dict, dict_key, "original_max_position_embeddings")) {
    rope.original_max_position_embeddings = static_cast<std::int64_t>(*original);
  } else if (rope.rope_type == "llama3" || rope.rope_type == "yarn") {
    rope.original_max_position_embeddings = r.integer_or("original_max_position_embeddings", max_positions);
  }
  rope.attention_factor = optional_number(r, dict, dict_key, "attention_factor");
  rope.beta_fast = optional_number(r, dict, dict_key, "beta_fast");
  rope.beta_slow = optional_number(r, dict, dict_key, "beta_slow");
  rope.mscale = optional_number(r, dict, dict_key, "mscale");
  rope.mscale_all_dim = optional_number(r, dict, dict_key, "mscale_all_dim");
  if (dict.contains("truncate") && dict["truncate"].is_boolean())
    rope.truncate = dict["truncate"].get<bool>();
  return rope;
}

// Llama: LlamaConfig has no sliding-window keys; transformers keeps them as attributes and LlamaModel attends
// over every position. A window there (a Mistral-style file) is refused rather than silently dropped.
void refuse_llama_window(const Reader& r) {
  const std::string why =
      ", but transformers' LlamaForCausalLM has no sliding window and attends over every position; "
      "accel::llm implements sliding windows for qwen2 and qwen3 only. Remove the key to load the model "
      "with full attention, as transformers computes it";
  if (r.boolean_or("use_sliding_window", false)) r.fail("use_sliding_window", "is true" + why);
  if (r.has("sliding_window")) r.fail("sliding_window", "is " + r.at("sliding_window").dump() + why);
  if (r.has("layer_types")) {
    for (const Json& t : r.at("layer_types"))
      if (!t.is_string() || (t.get<std::string>() != "full_attention" && t.get<std::string>() != "attention"))
        r.fail("layer_types", "holds " + t.dump() + why);
  }
}

// Qwen2Config / Qwen3Config.__post_init__: the window only with use_sliding_window (sliding_window defaults
// to 4096 when absent, null means none); layer_types from the file, else layers >= max_window_layers slide.
void read_sliding_window(const Reader& r, ModelConfig& c) {
  c.max_window_layers = r.integer_or("max_window_layers", 28);
  if (c.model_type == "llama") return refuse_llama_window(r);
  if (r.boolean_or("use_sliding_window", false) &&
      (r.has("sliding_window") || !r.present("sliding_window"))) {
    c.sliding_window = r.integer_or("sliding_window", 4096);
    if (*c.sliding_window <= 0)
      r.fail("sliding_window", "is " + std::to_string(*c.sliding_window) + "; a window must be positive");
  }
  c.layer_types.clear();
  if (!r.has("layer_types")) {
    for (std::int64_t i = 0; i < c.num_hidden_layers; ++i)
      c.layer_types.push_back(c.sliding_window && i >= c.max_window_layers ? "sliding_attention"
                                                                           : "full_attention");
    return;
  }
  const Json& types = r.at("layer_types");
  if (!types.is_array() || static_cast<std::int64_t>(types.size()) != c.num_hidden_layers)
    r.fail("layer_types", "must be a list of num_hidden_layers (" + std::to_string(c.num_hidden_layers) +
                              ") layer types, got " + types.dump());
  for (const Json& t : types) {
    const std::string type = t.is_string() ? t.get<std::string>() : t.dump();
    if (type == "attention" || type == "full_attention") {  // "attention": transformers' legacy name
      c.layer_types.push_back("full_attention");
    } else if (type == "sliding_attention") {
      if (!c.sliding_window)
        r.fail("layer_types",
               "holds \"sliding_attention\" but no window is set (use_sliding_window false or "
               "sliding_window null: transformers' forward then fails); set use_sliding_window "
               "true and sliding_window, or make every layer \"full_attention\"");
      c.layer_types.push_back(type);
    } else {
      r.fail("layer_types", "holds " + t.dump() +
                                ": only \"full_attention\" and \"sliding_attention\" layers are implemented");
    }
  }
}

// Keys that exist but whose values other than the default are not implemented.
void refuse_unimplemented(const Reader& r, const ModelConfig& c) {
  if (c.hidden_act != "silu")
    r.fail("hidden_act", "is \"" + c.hidden_act + "\": only \"silu\" (SwiGLU) is implemented");
  if (r.number_or("attention_dropout", 0.0) != 0.0)
    r.fail("attention_dropout", "is non-zero: attention dropout is not implemented; set it to 0.0");
  if (r.number_or("partial_rotary_factor", 1.0) != 1.0)
    r.fail("partial_rotary_factor", "is not 1.0: partial rotary embeddings are not implemented");
  if (r.has("quantization_config"))
    r.fail("quantization_config",
           "is set: pre-quantised checkpoints are not implemented; load the full-precision checkpoint "
           "(with load_in_4bit to quantise it while loading)");
  if (c.hidden_size <= 0 || c.num_attention_heads <= 0 || c.num_key_value_heads <= 0 || c.head_dim <= 0 ||
      c.num_hidden_layers <= 0 || c.vocab_size <= 0 || c.intermediate_size <= 0)
    r.fail("hidden_size", "and the other sizes must be positive");
  if (c.num_attention_heads % c.num_key_value_heads != 0)
    r.fail("num_key_value_heads", "(" + std::to_string(c.num_key_value_heads) +
                                      ") must divide num_attention_heads (" +
                                      std::to_string(c.num_attention_heads) + ")");
  if (c.head_dim % 2 != 0) r.fail("head_dim", "is odd; rotary embeddings need an even head_dim");
}

std::string read_dtype(const Reader& r) {
  const std::string key = r.has("dtype") ? "dtype" : "torch_dtype";
  std::string dtype = r.string_or(key, "");
  if (dtype.rfind("torch.", 0) == 0) dtype = dtype.substr(6);
  if (!dtype.empty() && dtype != "float32" && dtype != "bfloat16" && dtype != "float16")
    r.fail(key, "is \"" + dtype + "\"; supported: float32, bfloat16, float16");
  return dtype;
}

std::vector<std::int64_t> read_eos(const Reader& r) {
  std::vector<std::int64_t> ids;
  if (!r.has("eos_token_id")) return ids;
  const Json& v = r.at("eos_token_id");
  if (v.is_array()) {
    for (const Json& id : v)
      ids.push_back(r.integer_of(id, "eos_token_id"));
  } else {
    ids.push_back(r.integer_of(v, "eos_token_id"));
  }
  return ids;
}

}  // namespace

ModelConfig ModelConfig::from_json(const std::string& json_text, const std::string& file) {
  Json root;
  try {
    root = Json::parse(json_text);
  } catch (const Json::exception& e) {
    throw ConfigError(file + ": not valid JSON (" + std::string(e.what()) + ")", file);
  }
  if (!root.is_object()) throw ConfigError(file + ": a config.json holds a JSON object", file);
  const Reader r(root, file);
  ModelConfig c;
  c.model_type = r.string_or("model_type", "");
  if (c.model_type != "llama" && c.model_type != "qwen2" && c.model_type != "qwen3") {
    r.fail("model_type", "is \"" + c.model_type +
                             "\", which accelerate-cpp does not implement; supported: llama, qwen2, qwen3");
  }
  for (const auto& item : root.items()) {
    if (kIgnoredKeys.count(item.key()) == 0)
      r.fail(item.key(), "is not a " + c.model_type +
                             " config key accelerate-cpp knows; remove it if it does "
                             "not change the model, else this model is not supported");
  }
  c.vocab_size = r.integer("vocab_size");
  c.hidden_size = r.integer("hidden_size");
  c.intermediate_size = r.integer("intermediate_size");
  c.num_hidden_layers = r.integer("num_hidden_layers");
  c.num_attention_heads = r.integer("num_attention_heads");
  c.num_key_value_heads = r.integer_or("num_key_value_heads", c.num_attention_heads);
  c.head_dim =
      r.integer_or("head_dim", c.num_attention_heads > 0 ? c.hidden_size / c.num_attention_heads : 0);
  c.max_position_embeddings = r.integer_or("max_position_embeddings", c.model_type == "llama" ? 2048 : 32768);
  c.rms_norm_eps = r.number_or("rms_norm_eps", 1e-6);
  c.tie_word_embeddings = r.boolean_or("tie_word_embeddings", false);
  const bool attention_bias = r.boolean_or("attention_bias", false);
  c.qkv_bias = c.model_type == "qwen2" ? true : attention_bias;
  c.o_bias = c.model_type == "qwen2" ? false : attention_bias;
  if (c.model_type == "qwen2" && r.has("attention_bias") && !attention_bias)
    r.fail("attention_bias", "is false, but transformers' Qwen2 always has q/k/v biases; remove the key");
  c.mlp_bias = c.model_type == "llama" ? r.boolean_or("mlp_bias", false) : false;
  if (c.model_type != "llama" && r.boolean_or("mlp_bias", false))
    r.fail("mlp_bias", "is true, but transformers' " + c.model_type + " has no MLP biases");
  c.qk_norm = c.model_type == "qwen3";
  c.hidden_act = r.string_or("hidden_act", "silu");
  c.rope = read_rope(r, c.max_position_embeddings);
  c.dtype = read_dtype(r);
  if (r.has("bos_token_id")) c.bos_token_id = r.integer_of(r.at("bos_token_id"), "bos_token_id");
  if (r.has("pad_token_id")) c.pad_token_id = r.integer_of(r.at("pad_token_id"), "pad_token_id");
  c.eos_token_ids = read_eos(r);
  read_sliding_window(r, c);
  refuse_unimplemented(r, c);
  return c;
}

ModelConfig ModelConfig::from_file(const std::string& path) {
  const auto file = config_detail::read_small_file(path, 16u << 20);
  if (!file.error.empty())
    throw ConfigError(
        "cannot read model config '" + path + "': " + file.error + "; a model directory holds config.json",
        path);
  if (file.too_large) throw ConfigError("model config '" + path + "' is larger than 16 MiB", path);
  return from_json(file.text, path);
}

bool ModelConfig::is_sliding_layer(std::int64_t layer) const {
  if (!sliding_window) return false;
  if (!layer_types.empty())
    return layer < static_cast<std::int64_t>(layer_types.size()) &&
           layer_types[static_cast<std::size_t>(layer)] == "sliding_attention";
  return layer >= max_window_layers;
}

std::string ModelConfig::decoder_layer_class() const {
  if (model_type == "qwen2") return "Qwen2DecoderLayer";
  if (model_type == "qwen3") return "Qwen3DecoderLayer";
  return "LlamaDecoderLayer";
}

std::string ModelConfig::architecture() const {
  if (model_type == "qwen2") return "Qwen2ForCausalLM";
  if (model_type == "qwen3") return "Qwen3ForCausalLM";
  return "LlamaForCausalLM";
}

std::string ModelConfig::to_json(const std::string& dtype_override) const {
  Json j;
  j["architectures"] = Json::array({architecture()});
  j["model_type"] = model_type;
  j["vocab_size"] = vocab_size;
  j["hidden_size"] = hidden_size;
  j["intermediate_size"] = intermediate_size;
  j["num_hidden_layers"] = num_hidden_layers;
  j["num_attention_heads"] = num_attention_heads;
  j["num_key_value_heads"] = num_key_value_heads;
  j["head_dim"] = head_dim;
  j["max_position_embeddings"] = max_position_embeddings;
  j["rms_norm_eps"] = rms_norm_eps;
  j["tie_word_embeddings"] = tie_word_embeddings;
  j["hidden_act"] = hidden_act;
  if (model_type != "qwen2") j["attention_bias"] = qkv_bias;
  if (model_type == "llama") j["mlp_bias"] = mlp_bias;
  if (model_type != "llama") {  // what Qwen2Config / Qwen3Config write (sliding_window null when off)
    j["use_sliding_window"] = sliding_window.has_value();
    j["sliding_window"] = sliding_window ? Json(*sliding_window) : Json(nullptr);
    j["max_window_layers"] = max_window_layers;
    Json types = Json::array();
    for (std::int64_t i = 0; i < num_hidden_layers; ++i)
      types.push_back(is_sliding_layer(i) ? "sliding_attention" : "full_attention");
    j["layer_types"] = types;
  }
  Json rope_json;
  rope_json["rope_type"] = rope.rope_type;
  rope_json["rope_theta"] = rope.rope_theta;
  if (rope.factor) rope_json["factor"] = *rope.factor;
  if (rope.rope_type == "llama3") {
    rope_json["low_freq_factor"] = rope.low_freq_factor;
    rope_json["high_freq_factor"] = rope.high_freq_factor;
  }
  if (rope.original_max_position_embeddings)
    rope_json["original_max_position_embeddings"] = *rope.original_max_position_embeddings;
  if (rope.rope_type == "yarn") {
    if (rope.attention_factor) rope_json["attention_factor"] = *rope.attention_factor;
    if (rope.beta_fast) rope_json["beta_fast"] = *rope.beta_fast;
    if (rope.beta_slow) rope_json["beta_slow"] = *rope.beta_slow;
    if (rope.mscale) rope_json["mscale"] = *rope.mscale;
    if (rope.mscale_all_dim) rope_json["mscale_all_dim"] = *rope.mscale_all_dim;
    if (!rope.truncate) rope_json["truncate"] = false;
  }
  j["rope_parameters"] = rope_json;
  const std::string d = dtype_override.empty() ? dtype : dtype_override;
  if (!d.empty()) j["dtype"] = d;
  j["bos_token_id"] = bos_token_id ? Json(*bos_token_id) : Json(nullptr);
  j["pad_token_id"] = pad_token_id ? Json(*pad_token_id) : Json(nullptr);
  if (eos_token_ids.size() == 1) {
    j["eos_token_id"] = eos_token_ids[0];
  } else if (eos_token_ids.empty()) {
    j["eos_token_id"] = nullptr;
  } else {
    j["eos_token_id"] = eos_token_ids;
  }
  return j.dump(2) + "\n";
}

}  // namespace accel::llm
