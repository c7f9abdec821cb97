// accel::ModelArguments: TRL's ModelConfig keys (trl/trainer/model_config.py, TRL 1.16) read from YAML/JSON
// and the command line, with TRL's defaults and __post_init__ rules.
#include <accel/errors.hpp>
#include <accel/trainer/model_arguments.hpp>

#include "config/command_line.hpp"
#include "config/message_text.hpp"
#include "config/small_file.hpp"
#include "config/text_distance.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <sstream>

namespace accel {
// A named namespace, not an anonymous one: the unity build puts this file beside training_arguments.cpp,
// whose anonymous helpers have the same names.
namespace model_args_detail {

struct Value {
  std::string text;
  std::vector<std::string> items;
  bool is_null = false;
  bool is_sequence = false;
  bool is_map = false;
};

struct Where {
  std::string source;
  int line = 0;
};

[[noreturn]] void fail(const Where& w, const std::string& key, const std::string& message) {
  const std::string at = w.line > 0 ? fmt::format("{}:{}", w.source, w.line) : w.source;
  throw ConfigError(detail::bounded_message(fmt::format("{}: model config key '{}': {}", at, key, message)),
                    w.source, w.line, key);
}

std::string scalar(const Where& w, const std::string& key, const Value& v) {
  if (v.is_sequence || v.is_map) fail(w, key, "expected a single value, got a list or mapping");
  return v.text;
}

bool to_bool(const Where& w, const std::string& key, const Value& v) {
  std::string t = scalar(w, key, v);
  std::transform(t.begin(), t.end(), t.begin(), [](unsigned char c) { return std::tolower(c); });
  if (t == "true" || t == "yes" || t == "1") return true;
  if (t == "false" || t == "no" || t == "0") return false;
  fail(w, key, fmt::format("expected true or false, got '{}'", v.text));
}

double to_double(const Where& w, const std::string& key, const Value& v) {
  const std::string t = scalar(w, key, v);
  char* end = nullptr;
  errno = 0;
  const double x = std::strtod(t.c_str(), &end);
  if (t.empty() || *end != '\0' || errno == ERANGE || !std::isfinite(x))
    fail(w, key, fmt::format("expected a number, got '{}'", v.text));
  return x;
}

int to_int(const Where& w, const std::string& key, const Value& v) {
  const double x = to_double(w, key, v);
  if (x != std::floor(x) || std::fabs(x) > 1e9)
    fail(w, key, fmt::format("expected a whole number, got '{}'", v.text));
  return static_cast<int>(x);
}

std::optional<std::string> optional_text(const Where& w, const std::string& key, const Value& v) {
  if (v.is_null) return std::nullopt;
  return scalar(w, key, v);
}

std::vector<std::string> names(const Where& w, const std::string& key, const Value& v) {
  if (v.is_null) return {};
  if (v.is_map) fail(w, key, "expected a list of module names, got a mapping");
  return v.is_sequence ? v.items : std::vector<std::string>{v.text};
}

struct Field {
  TrainingKey key;
  std::function<void(ModelArguments&, const Where&, const std::string&, const Value&)> set;
};

using M = ModelArguments;
using W = Where;
using S = std::string;
using V = Value;

const std::vector<Field>& fields() {
  static const std::vector<Field> table = {
      {{"model_name_or_path", "null", "the model directory (config.json, safetensors, tokenizer files)"},
       [](M& m, const W& w, const S& k, const V& v) { m.model_name_or_path = optional_text(w, k, v); }},
      {{"model_revision", "main", "a Hub revision: accepted, nothing is downloaded"},
       [](M& m, const W& w, const S& k, const V& v) {
         m.model_revision = v.is_null ? "main" : scalar(w, k, v);
         if (m.model_revision != "main")
           m.notices.push_back(
               fmt::format("{}: model_revision {} is ignored: models are read from "
                           "model_name_or_path, nothing is downloaded",
                           w.source, m.model_revision));
       }},
      {{"dtype", "float32", "float32 | bfloat16 | float16 | auto (also the 4-bit compute dtype)"},
       [](M& m, const W& w, const S& k, const V& v) {
         m.dtype = v.is_null ? "float32" : scalar(w, k, v);
         static const std::vector<std::string> ok = {"float32", "bfloat16", "float16", "auto"};
         if (std::find(ok.begin(), ok.end(), m.dtype) == ok.end())
           fail(w, k, fmt::format("'{}' is not one of {}", m.dtype, fmt::join(ok, ", ")));
       }},
      {{"attn_implementation", "null", "null | eager | sdpa (flash_attention_2: SDPA, with a notice)"},
       [](M& m, const W& w, const S& k, const V& v) {
         m.attn_implementation = optional_text(w, k, v);
         if (!m.attn_implementation) return;
         const std::string& a = *m.attn_implementation;
         if (a == "flash_attention_2" || a == "flash_attention_3") {
           m.notices.push_back(fmt::format(
               "{}: attn_implementation {}: attention runs through scaled_dot_product_attention, which uses "
               "its own flash kernel where the device has one (the flash-attn package is Python's)",
               w.source, a));
         } else if (a != "eager" && a != "sdpa") {
           fail(w, k, fmt::format("'{}' is not one of eager, sdpa, flash_attention_2", a));
         }
       }},
      {{"use_peft", "false", "train LoRA adapters on a frozen base instead of every parameter"},
       [](M& m, const W& w, const S& k, const V& v) { m.use_peft = to_bool(w, k, v); }},
      {{"lora_r", "16", "LoRA rank"},
       [](M& m, const W& w, const S& k, const V& v) { m.lora_r = to_int(w, k, v); }},
      {{"lora_alpha", "32", "LoRA alpha (scaling alpha / r)"},
       [](M& m, const W& w, const S& k, const V& v) { m.lora_alpha = to_double(w, k, v); }},
      {{"lora_dropout", "0.05", "dropout on the adapters' input"},
       [](M& m, const W& w, const S& k, const V& v) { m.lora_dropout = to_double(w, k, v); }},
      {{"lora_target_modules", "null",
        "module names, all-linear (every Linear but the output head), or a regular expression"},
       [](M& m, const W& w, const S& k, const V& v) {
         m.lora_target_modules = names(w, k, v);
         m.lora_target_modules_string.reset();
         // TRL's __post_init__: a list of one becomes that string (PEFT then reads it as all-linear or a
         // regular expression over the whole module path).
         if (!v.is_sequence && !v.is_null) {
           m.lora_target_modules_string = v.text;
           m.lora_target_modules.clear();
         } else if (m.lora_target_modules.size() == 1) {
           m.lora_target_modules_string = m.lora_target_modules.front();
           m.lora_target_modules.clear();
         }
       }},
      {{"lora_target_parameters", "null", "not available (LoRA on parameters of MoE experts); leave it null"},
       [](M&, const W& w, const S& k, const V& v) {
         if (!v.is_null && !(v.is_sequence && v.items.empty()))
           fail(w, k,
                "LoRA on parameters (PEFT's target_parameters) is not available; target modules instead");
       }},
      {{"lora_modules_to_save", "null", "modules trained in full besides the adapters (a new head)"},
       [](M& m, const W& w, const S& k, const V& v) { m.lora_modules_to_save = names(w, k, v); }},
      {{"lora_task_type", "CAUSAL_LM", "PEFT's task_type, written into adapter_config.json"},
       [](M& m, const W& w, const S& k, const V& v) {
         m.lora_task_type = scalar(w, k, v);
         static const std::vector<std::string> ok = {"CAUSAL_LM", "SEQ_CLS",      "SEQ_2_SEQ_LM",
                                                     "TOKEN_CLS", "QUESTION_ANS", "FEATURE_EXTRACTION"};
         if (std::find(ok.begin(), ok.end(), m.lora_task_type) == ok.end())
           fail(w, k,
                fmt::format("'{}' is not one of PEFT's task types ({})", m.lora_task_type,
                            fmt::join(ok, ", ")));
       }},
      {{"use_rslora", "false", "rank-stabilised LoRA: scaling alpha / sqrt(r)"},
       [](M& m, const W& w, const S& k, const V& v) { m.use_rslora = to_bool(w, k, v); }},
      {{"use_dora", "false", "DoRA: not available (refused when true)"},
       [](M& m, const W& w, const S& k, const V& v) { m.use_dora = to_bool(w, k, v); }},
      {{"load_in_8bit", "false", "LLM.int8 base: not available (refused when true; use load_in_4bit)"},
       [](M& m, const W& w, const S& k, const V& v) { m.load_in_8bit = to_bool(w, k, v); }},
      {{"load_in_4bit", "false", "QLoRA: the base's Linear weights in 4 bits (needs use_peft)"},
       [](M& m, const W& w, const S& k, const V& v) { m.load_in_4bit = to_bool(w, k, v); }},
      {{"bnb_4bit_quant_type", "nf4", "nf4 | fp4"},
       [](M& m, const W& w, const S& k, const V& v) {
         m.bnb_4bit_quant_type = scalar(w, k, v);
         if (m.bnb_4bit_quant_type != "nf4" && m.bnb_4bit_quant_type != "fp4")
           fail(w, k, fmt::format("'{}' is not one of nf4, fp4", m.bnb_4bit_quant_type));
       }},
      {{"use_bnb_nested_quant", "false", "double quantisation of the 4-bit blocks' absmax"},
       [](M& m, const W& w, const S& k, const V& v) { m.use_bnb_nested_quant = to_bool(w, k, v); }},
      {{"bnb_4bit_quant_storage", "null", "null | uint8: the dtype the 4-bit codes are stored in"},
       [](M& m, const W& w, const S& k, const V& v) {
         m.bnb_4bit_quant_storage = optional_text(w, k, v);
         if (m.bnb_4bit_quant_storage && *m.bnb_4bit_quant_storage != "uint8")
           fail(w, k,
                fmt::format("'{}': the 4-bit codes are stored as uint8 here (other storage dtypes serve FSDP "
                            "in Python); set it to uint8 or null",
                            *m.bnb_4bit_quant_storage));
       }},
  };
  return table;
}

// Keys TRL's ModelConfig lacks, taken under PEFT's LoraConfig name (not in keys(), which is TRL's list).
const std::vector<Field>& peft_fields() {
  static const std::vector<Field> table = {
      {{"ensure_weight_tying", "false",
        "PEFT's LoraConfig.ensure_weight_tying: a tied embedding in lora_modules_to_save keeps the head "
        "tied"},
       [](M& m, const W& w, const S& k, const V& v) { m.ensure_weight_tying = to_bool(w, k, v); }},
  };
  return table;
}

// TRL's older name of a key, and keys users bring from BitsAndBytesConfig that TRL spells otherwise.
const Field* find_field(std::string key, const Where& w) {
  if (key == "torch_dtype") key = "dtype";
  if (key == "bnb_4bit_compute_dtype")
    fail(w, key,
         "TRL's ModelConfig has no such key: the 4-bit compute dtype is dtype (TRL's get_quantization_config "
         "passes dtype as bnb_4bit_compute_dtype); set dtype instead");
  for (const Field& f : fields())
    if (f.key.name == key) return &f;
  for (const Field& f : peft_fields())
    if (f.key.name == key) return &f;
  return nullptr;
}

std::vector<std::string> all_names() {
  std::vector<std::string> out;
  for (const Field& f : fields())
    out.push_back(f.key.name);
  for (const Field& f : peft_fields())
    out.push_back(f.key.name);
  return out;
}

void apply(ModelArguments& m, const std::string& key, const Value& v, const Where& w) {
  if (const Field* f = find_field(key, w)) {
    f->set(m, w, key, v);
    return;
  }
  const auto guess = detail::closest(key, all_names());
  fail(w, key,
       fmt::format("unknown key{}; the keys are those of TRL's ModelConfig (docs/trainer.md lists them)",
                   guess ? fmt::format(" (did you mean '{}'?)", *guess) : ""));
}

Value value_of(const YAML::Node& node) {
  Value v;
  if (node.IsNull()) {
    v.is_null = true;
  } else if (node.IsScalar()) {
    v.text = node.Scalar();
    if (node.Tag() != "!" && (v.text == "null" || v.text == "~" || v.text == "None")) v.is_null = true;
  } else if (node.IsSequence()) {
    v.is_sequence = true;
    for (const auto& item : node)
      v.items.push_back(item.IsScalar() ? item.Scalar() : "");
  } else {
    v.is_map = true;
  }
  return v;
}

// From the command line: "null"/"None" is null; "[a, b]" (or "a,b" for the list keys) is a list.
Value value_of_text(const std::string& key, const std::string& text) {
  Value v;
  v.text = text;
  v.is_null = text == "null" || text == "None";
  const bool list_key = key == "lora_target_modules" || key == "lora_modules_to_save";
  if (v.is_null || !list_key ||
      !(text.find(',') != std::string::npos || (!text.empty() && text.front() == '[')))
    return v;
  std::string t = text;
  if (t.front() == '[' && t.back() == ']') t = t.substr(1, t.size() - 2);
  std::stringstream ss(t);
  for (std::string item; std::getline(ss, item, ',');) {
    item.erase(0, item.find_first_not_of(" \"'"));
    item.erase(item.find_last_not_of(" \"'") + 1);
    if (!item.empty()) v.items.push_back(item);
  }
  v.is_sequence = true;
  return v;
}

const std::vector<TrainingKey>& keys_impl() {
  static const std::vector<TrainingKey> out = [] {
    std::vector<TrainingKey> k;
    for (const Field& f : fields())
      k.push_back(f.key);
    return k;
  }();
  return out;
}

ModelArguments load_string_impl(const std::string& text, const std::string& source) {
  if (const auto problem = config_detail::encoding_problem(text))
    throw ConfigError(fmt::format("{}:{}: {}", source, problem->first, problem->second), source,
                      problem->first);
  YAML::Node root;
  try {
    root = YAML::Load(text);
  } catch (const YAML::Exception& e) {
    throw ConfigError(detail::bounded_message(
                          fmt::format("{}:{}: not valid YAML or JSON: {}", source, e.mark.line + 1, e.msg)),
                      source, e.mark.line + 1);
  }
  ModelArguments m;
  m.source = source;
  if (root.IsNull()) return m;
  if (!root.IsMap())
    throw ConfigError(
        fmt::format("{}: a model config is a mapping of TRL's ModelConfig keys to values", source), source);
  for (const auto& entry : root) {
    const Where w{source, entry.first.Mark().line + 1};
    if (!entry.first.IsScalar()) fail(w, "?", "a key must be a plain name");
    apply(m, entry.first.Scalar(), value_of(entry.second), w);
  }
  return m;
}

ModelArguments load_file_impl(const std::string& path) {
  const auto file = config_detail::read_small_file(path, std::size_t{1} << 20);
  if (file.too_large)
    throw ConfigError(fmt::format("model config '{}' is larger than 1 MiB: not a model config", path), path);
  if (!file.error.empty())
    throw ConfigError(fmt::format("cannot open model config '{}': {}", path, file.error), path);
  return load_string_impl(file.text, path);
}

ModelArguments from_command_line_impl(const std::vector<std::string>& given,
                                      std::vector<std::string>* remaining) {
  std::vector<std::string> args = given;
  ModelArguments m;
  if (const auto file = config_detail::take_file_option(args, "model_config", "TYPE.model.yaml"))
    m = load_file_impl(*file);
  const std::string source = m.source.empty() ? "command line" : "command line (over " + m.source + ")";
  std::vector<std::string> rest;
  for (std::size_t i = 0; i < args.size(); ++i) {
    const std::string& arg = args[i];
    std::string key = arg.size() > 2 && arg.rfind("--", 0) == 0 ? arg.substr(2) : std::string();
    std::string value;
    bool has_value = false;
    if (const auto eq = key.find('='); eq != std::string::npos) {
      value = key.substr(eq + 1);
      key = key.substr(0, eq);
      has_value = true;
    }
    std::replace(key.begin(), key.end(), '-', '_');
    const Where w{"command line", 0};
    const Field* f = key.empty() ? nullptr : find_field(key, w);
    if (f == nullptr) {
      const auto guess = key.empty() ? std::nullopt : detail::closest(key, all_names());
      if (remaining == nullptr || (guess && detail::edit_distance(key, *guess) <= 1)) {
        throw ConfigError(fmt::format("command line: unknown model config option '{}'{}", arg,
                                      guess ? fmt::format(" (did you mean '--{}'?)", *guess) : ""),
                          "command line", 0, key);
      }
      rest.push_back(arg);
      continue;
    }
    if (!has_value) {
      const bool boolean =
          f->key.default_value == "false" && (i + 1 >= args.size() || args[i + 1].rfind("--", 0) == 0);
      if (boolean) {
        value = "true";
      } else {
        if (i + 1 >= args.size())
          throw ConfigError(fmt::format("command line: --{} needs a value", key), "command line", 0, key);
        value = args[++i];
        // TRL's command line (HfArgumentParser, nargs "+"): a list key takes every value up to the next
        // option.
        const bool list_key = f->key.name == "lora_target_modules" || f->key.name == "lora_modules_to_save";
        std::string more;
        while (list_key && i + 1 < args.size() && args[i + 1].rfind("--", 0) != 0)
          more += ", " + args[++i];
        if (!more.empty()) value = "[" + value + more + "]";
      }
    }
    m.set(f->key.name, value, source);
  }
  if (m.source.empty()) m.source = "command line";
  m.validate();
  if (remaining != nullptr) *remaining = std::move(rest);
  return m;
}

void validate_impl(ModelArguments& m) {
  const Where w{m.source.empty() ? "ModelArguments" : m.source, 0};
  if (m.load_in_8bit && m.load_in_4bit)
    fail(w, "load_in_8bit",
         "You can't use 8 bit and 4 bit precision at the same time (TRL's rule); choose one");
  if (m.load_in_8bit)
    fail(w, "load_in_8bit",
         "8-bit (LLM.int8) bases are not available in accelerate-cpp; use load_in_4bit: true (QLoRA, NF4 or "
         "FP4)");
  if (m.use_dora)
    fail(w, "use_dora",
         "DoRA (a trained magnitude vector per adapted layer) is not available in accelerate-cpp; set "
         "use_dora: "
         "false (plain LoRA, or use_rslora: true)");
  if (m.load_in_4bit && !m.use_peft)
    fail(w, "load_in_4bit", "a 4-bit base cannot be trained itself: set use_peft: true (QLoRA)");
  if (m.lora_r <= 0) fail(w, "lora_r", fmt::format("must be positive, got {}", m.lora_r));
  if (!(m.lora_dropout >= 0 && m.lora_dropout < 1))
    fail(w, "lora_dropout", fmt::format("must be in [0, 1), got {}", m.lora_dropout));
  if (m.use_peft && m.lora_target_modules.empty() && !m.lora_target_modules_string)
    fail(w, "lora_target_modules",
         "use_peft needs the modules to adapt: a list of names (e.g. [q_proj, v_proj]) or all-linear (PEFT's "
         "defaults per architecture are not built in)");
}

}  // namespace model_args_detail

const std::vector<TrainingKey>& ModelArguments::keys() {
  return model_args_detail::keys_impl();
}

ModelArguments ModelArguments::load_string(const std::string& text, const std::string& source) {
  return model_args_detail::load_string_impl(text, source);
}

ModelArguments ModelArguments::load_file(const std::string& path) {
  return model_args_detail::load_file_impl(path);
}

void ModelArguments::set(const std::string& key, const std::string& value, const std::string& where) {
  model_args_detail::apply(*this, key, model_args_detail::value_of_text(key, value),
                           model_args_detail::Where{where, 0});
}

ModelArguments ModelArguments::from_command_line(const std::vector<std::string>& args,
                                                 std::vector<std::string>* remaining) {
  return model_args_detail::from_command_line_impl(args, remaining);
}

void ModelArguments::validate() {
  model_args_detail::validate_impl(*this);
}

}  // namespace accel
