/// \file config.cpp
/// YAML reading, validation and writing of accel::Config. yaml-cpp and fmt stay private to this file.

#include "accel/config.hpp"

#include <fmt/format.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <sstream>
#include <utility>
#include <vector>

namespace accel {
namespace {

// -----------------------------------------------------------------------------------------------------------
// Small string helpers.

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
  return s;
}

std::string join(const std::vector<std::string>& items, const char* separator = ", ") {
  std::string out;
  for (size_t i = 0; i < items.size(); ++i) {
    if (i > 0) out += separator;
    out += items[i];
  }
  return out;
}

std::string join_path(const std::string& prefix, const std::string& name) {
  return prefix.empty() ? name : prefix + "." + name;
}

// Optimal-string-alignment distance (Damerau-Levenshtein with adjacent transpositions), case-insensitive, so
// that `mixed_precison` is one edit away from `mixed_precision`.
size_t edit_distance(const std::string& a_in, const std::string& b_in) {
  const std::string a = lower(a_in);
  const std::string b = lower(b_in);
  std::vector<std::vector<size_t>> d(a.size() + 1, std::vector<size_t>(b.size() + 1));
  for (size_t i = 0; i <= a.size(); ++i)
    d[i][0] = i;
  for (size_t j = 0; j <= b.size(); ++j)
    d[0][j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t cost = a[i - 1] == b[j - 1] ? 0 : 1;
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + cost});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1]) {
        d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
      }
    }
  }
  return d[a.size()][b.size()];
}

// The candidate closest to `word`, if it is close enough to be a plausible typo (about one edit per three
// characters), so that unrelated words get the full list instead of a misleading guess.
std::optional<std::string> closest(const std::string& word, const std::vector<std::string>& candidates) {
  std::optional<std::string> best;
  size_t best_distance = std::numeric_limits<size_t>::max();
  for (const std::string& candidate : candidates) {
    const size_t distance = edit_distance(word, candidate);
    const size_t limit = std::max<size_t>(1, std::min(word.size(), candidate.size()) / 3);
    if (distance <= limit && distance < best_distance) {
      best = candidate;
      best_distance = distance;
    }
  }
  return best;
}

// How a YAML node is named in "expected X, got Y" messages.
std::string describe(const YAML::Node& node) {
  switch (node.Type()) {
    case YAML::NodeType::Scalar:
      return fmt::format("'{}'", node.Scalar());
    case YAML::NodeType::Sequence:
      return "a sequence";
    case YAML::NodeType::Map:
      return "a mapping";
    default:
      return "nothing";
  }
}

// Writes `text` as a YAML scalar that reads back as the same string (never as a bool, number or null).
std::string yaml_string(const std::string& text) {
  static const std::vector<std::string> kKeywords = {"true", "false", "yes",  "no",   "on", "off",
                                                     "y",    "n",     "null", "none", "~"};
  bool plain = !text.empty() &&
               (std::isalpha(static_cast<unsigned char>(text[0])) || text[0] == '_' || text[0] == '/');
  for (char c : text) {
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '_' && c != '-' && c != '.' && c != '/') {
      plain = false;
    }
  }
  if (plain && std::find(kKeywords.begin(), kKeywords.end(), lower(text)) == kKeywords.end()) return text;
  bool control = false;
  for (char c : text)
    control = control || static_cast<unsigned char>(c) < 0x20;
  if (!control) {
    std::string out = "'";
    for (char c : text)
      out += c == '\'' ? std::string("''") : std::string(1, c);
    return out + "'";
  }
  std::string out = "\"";
  for (char c : text) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\t') {
      out += "\\t";
    } else if (static_cast<unsigned char>(c) < 0x20) {
      out += fmt::format("\\x{:02x}", static_cast<unsigned>(c));
    } else {
      out += c;
    }
  }
  return out + "\"";
}

std::string yaml_bool(bool value) {
  return value ? "true" : "false";
}

// -----------------------------------------------------------------------------------------------------------
// Enumerations: one table per enum gives the YAML spellings; the first spelling of a value is canonical.

template <typename E>
struct Choice {
  const char* text;
  E value;
  bool listed;  // shown in "allowed values" (aliases such as Accelerate's numeric forms are not)
};

template <typename E>
struct ChoiceSet {
  std::vector<Choice<E>> choices;
  std::vector<std::string> unsupported;  // known spellings that this build rejects with "not supported"
};

const ChoiceSet<BackendKind>& backend_choices() {
  static const ChoiceSet<BackendKind> kSet{{{"local", BackendKind::Local, true},
                                            {"ddp", BackendKind::Ddp, true},
                                            {"fsdp", BackendKind::Fsdp, true},
                                            {"zero", BackendKind::Zero, true},
                                            {"deepspeed", BackendKind::Zero, false}},
                                           {"megatron_lm", "xla", "tpu"}};
  return kSet;
}

const ChoiceSet<MixedPrecision>& mixed_precision_choices() {
  static const ChoiceSet<MixedPrecision> kSet{{{"no", MixedPrecision::No, true},
                                               {"fp16", MixedPrecision::Fp16, true},
                                               {"bf16", MixedPrecision::Bf16, true},
                                               {"false", MixedPrecision::No, false}},
                                              {"fp8"}};
  return kSet;
}

// distributed_type values map onto backends; MULTI_CPU additionally implies use_cpu.
const ChoiceSet<std::string>& distributed_type_choices() {
  static const ChoiceSet<std::string> kSet{{{"NO", "NO", true},
                                            {"MULTI_CPU", "MULTI_CPU", true},
                                            {"MULTI_GPU", "MULTI_GPU", true},
                                            {"FSDP", "FSDP", true},
                                            {"DEEPSPEED", "DEEPSPEED", true},
                                            {"false", "NO", false}},
                                           {"MULTI_NPU", "MULTI_MLU", "MULTI_SDAA", "MULTI_MUSA", "MULTI_XPU",
                                            "MULTI_HPU", "XLA", "TPU", "MEGATRON_LM"}};
  return kSet;
}

const ChoiceSet<ShardingStrategy>& sharding_choices() {
  static const ChoiceSet<ShardingStrategy> kSet{{{"FULL_SHARD", ShardingStrategy::FullShard, true},
                                                 {"SHARD_GRAD_OP", ShardingStrategy::ShardGradOp, true},
                                                 {"NO_SHARD", ShardingStrategy::NoShard, true},
                                                 {"1", ShardingStrategy::FullShard, false},
                                                 {"2", ShardingStrategy::ShardGradOp, false},
                                                 {"3", ShardingStrategy::NoShard, false}},
                                                {"HYBRID_SHARD", "HYBRID_SHARD_ZERO2", "4", "5"}};
  return kSet;
}

const ChoiceSet<AutoWrapPolicy>& wrap_choices() {
  static const ChoiceSet<AutoWrapPolicy> kSet{
      {{"TRANSFORMER_BASED_WRAP", AutoWrapPolicy::TransformerBasedWrap, true},
       {"SIZE_BASED_WRAP", AutoWrapPolicy::SizeBasedWrap, true},
       {"NO_WRAP", AutoWrapPolicy::NoWrap, true},
       {"PER_CHILD_WRAP", AutoWrapPolicy::PerChildWrap, true}},
      {}};
  return kSet;
}

const ChoiceSet<BackwardPrefetch>& prefetch_choices() {
  static const ChoiceSet<BackwardPrefetch> kSet{{{"BACKWARD_PRE", BackwardPrefetch::BackwardPre, true},
                                                 {"BACKWARD_POST", BackwardPrefetch::BackwardPost, true},
                                                 {"NO_PREFETCH", BackwardPrefetch::NoPrefetch, true}},
                                                {}};
  return kSet;
}

const ChoiceSet<StateDictType>& state_dict_choices() {
  static const ChoiceSet<StateDictType> kSet{{{"FULL_STATE_DICT", StateDictType::FullStateDict, true},
                                              {"SHARDED_STATE_DICT", StateDictType::ShardedStateDict, true}},
                                             {"LOCAL_STATE_DICT"}};
  return kSet;
}

const ChoiceSet<OffloadDevice>& offload_choices() {
  static const ChoiceSet<OffloadDevice> kSet{
      {{"none", OffloadDevice::None, true}, {"cpu", OffloadDevice::Cpu, true}}, {"nvme"}};
  return kSet;
}

template <typename E>
std::vector<std::string> listed_values(const ChoiceSet<E>& set) {
  std::vector<std::string> out;
  for (const Choice<E>& choice : set.choices) {
    if (choice.listed) out.emplace_back(choice.text);
  }
  return out;
}

template <typename E>
std::optional<E> match_choice(const ChoiceSet<E>& set, const std::string& text) {
  for (const Choice<E>& choice : set.choices) {
    if (lower(text) == lower(choice.text)) return choice.value;
  }
  return std::nullopt;
}

template <typename E>
std::string canonical_text(const ChoiceSet<E>& set, const E& value) {
  for (const Choice<E>& choice : set.choices) {
    if (choice.value == value) return choice.text;
  }
  return "?";
}

// "<path>: invalid value 'x' (did you mean 'y'?); allowed values: a, b" or "... is not supported ...".
template <typename E>
std::string bad_choice_message(const std::string& path, const ChoiceSet<E>& set, const std::string& text) {
  const std::vector<std::string> allowed = listed_values(set);
  for (const std::string& unsupported : set.unsupported) {
    if (lower(unsupported) == lower(text)) {
      return fmt::format("{}: '{}' is not supported by accelerate-cpp; allowed values: {}", path, text,
                         join(allowed));
    }
  }
  const std::optional<std::string> guess = closest(text, allowed);
  return fmt::format("{}: invalid value '{}'{}; allowed values: {}", path, text,
                     guess ? fmt::format(" (did you mean '{}'?)", *guess) : std::string(), join(allowed));
}

// -----------------------------------------------------------------------------------------------------------
// Reading.

using LineMap = std::map<std::string, int>;  // key path -> 1-based line of the key

// "<source>:<line>: " (parts left out when unknown).
std::string location(const std::string& source, int line) {
  if (source.empty()) return line > 0 ? fmt::format("line {}: ", line) : std::string();
  return line > 0 ? fmt::format("{}:{}: ", source, line) : source + ": ";
}

[[noreturn]] void fail(const std::string& source, int line, const std::string& key, const std::string& body) {
  throw ConfigError(location(source, line) + body, source, line, key);
}

struct Entry {
  std::string name;  // key as written
  std::string path;  // dotted key path, e.g. fsdp_config.fsdp_version
  int line;          // 1-based line of the key, 0 if unknown
  YAML::Node value;
};

int line_of(const YAML::Node& node) {
  return std::max(0, node.Mark().line + 1);
}

bool parse_int64(const std::string& text, int64_t& out) {
  const char* begin = text.data();
  const char* end = text.data() + text.size();
  if (begin != end && *begin == '+') ++begin;
  const auto result = std::from_chars(begin, end, out);
  return begin != end && result.ec == std::errc() && result.ptr == end;
}

bool parse_double(const std::string& text, double& out) {
  if (text.empty() || std::isspace(static_cast<unsigned char>(text[0]))) return false;
  std::istringstream stream(text);
  stream.imbue(std::locale::classic());
  stream >> out;
  return !stream.fail() && stream.eof() && std::isfinite(out);
}

// Typed access to the entries of one mapping; every failure names the file, line, key path and value.
class Reader {
 public:
  explicit Reader(std::string source) : source_(std::move(source)) {}

  const std::string& source() const { return source_; }
  LineMap& lines() { return lines_; }

  [[noreturn]] void fail_at(const Entry& entry, const std::string& body) const {
    fail(source_, entry.line, entry.path, body);
  }

  // The key/value pairs of `map`, in file order; rejects keys that are not plain names and duplicate keys.
  std::vector<Entry> entries(const YAML::Node& map, const std::string& prefix) {
    std::vector<Entry> out;
    std::map<std::string, int> seen;
    for (const auto& pair : map) {
      // Copies: yaml-cpp's iterator hands out a temporary pair, so references into it would dangle.
      const YAML::Node key = pair.first;
      const YAML::Node value = pair.second;
      const int line = line_of(key);
      if (!key.IsScalar()) {
        fail(source_, line, prefix,
             fmt::format("{}keys must be plain names such as 'num_processes', got {} as a key",
                         prefix.empty() ? std::string() : prefix + ": ", describe(key)));
      }
      Entry entry{key.Scalar(), join_path(prefix, key.Scalar()), line, value};
      const auto previous = seen.find(entry.name);
      if (previous != seen.end()) {
        fail(source_, line, entry.path,
             fmt::format("duplicate key '{}' (first set on line {}); keep only one of them", entry.path,
                         previous->second));
      }
      seen.emplace(entry.name, line);
      lines_[entry.path] = line;
      out.push_back(std::move(entry));
    }
    return out;
  }

  std::string scalar(const Entry& e, const std::string& expected) const {
    if (!e.value.IsScalar())
      fail_at(e, fmt::format("{}: expected {}, got {}", e.path, expected, describe(e.value)));
    return e.value.Scalar();
  }

  bool boolean(const Entry& e) const {
    const std::string text = lower(scalar(e, "true or false"));
    if (text == "true" || text == "yes" || text == "on" || text == "y") return true;
    if (text == "false" || text == "no" || text == "off" || text == "n") return false;
    fail_at(e, fmt::format("{}: expected true or false, got '{}'", e.path, e.value.Scalar()));
  }

  int64_t integer(const Entry& e, int64_t min, int64_t max, const std::string& expected) const {
    int64_t value = 0;
    if (!parse_int64(scalar(e, expected), value) || value < min || value > max) {
      fail_at(e, fmt::format("{}: expected {}, got '{}'", e.path, expected, e.value.Scalar()));
    }
    return value;
  }

  uint64_t unsigned64(const Entry& e, const std::string& expected) const {
    const std::string text = scalar(e, expected);
    const char* begin = text.data() + (text.rfind('+', 0) == 0 ? 1 : 0);
    const char* end = text.data() + text.size();
    uint64_t value = 0;
    const auto result = std::from_chars(begin, end, value);
    if (begin == end || result.ec != std::errc() || result.ptr != end) {
      fail_at(e, fmt::format("{}: expected {}, got '{}'", e.path, expected, text));
    }
    return value;
  }

  // An integer count that may also be written in float notation (5e8), as Accelerate/DeepSpeed files do.
  uint64_t count(const Entry& e, uint64_t min, const std::string& expected) const {
    const std::string text = scalar(e, expected);
    int64_t as_int = 0;
    if (parse_int64(text, as_int) && as_int >= 0 && static_cast<uint64_t>(as_int) >= min) {
      return static_cast<uint64_t>(as_int);
    }
    double as_double = 0;
    if (parse_double(text, as_double) && as_double >= static_cast<double>(min) && as_double < 1.8e19 &&
        std::floor(as_double) == as_double) {
      return static_cast<uint64_t>(as_double);
    }
    fail_at(e, fmt::format("{}: expected {}, got '{}'", e.path, expected, text));
  }

  double number(const Entry& e, double min, bool min_inclusive, const std::string& expected) const {
    double value = 0;
    if (!parse_double(scalar(e, expected), value) || value < min || (!min_inclusive && value == min)) {
      fail_at(e, fmt::format("{}: expected {}, got '{}'", e.path, expected, e.value.Scalar()));
    }
    return value;
  }

  std::string string(const Entry& e) const { return scalar(e, "a string"); }

  template <typename E>
  E choice(const Entry& e, const ChoiceSet<E>& set) const {
    const std::string text = scalar(e, "one of " + join(listed_values(set)));
    const std::optional<E> value = match_choice(set, text);
    if (!value) fail_at(e, bad_choice_message(e.path, set, text));
    return *value;
  }

 private:
  std::string source_;
  LineMap lines_;
};

// A section key (e.g. `fsdp_config:`) whose value must be a mapping; null and `{}` mean "all defaults".
std::vector<Entry> section_entries(Reader& reader, const Entry& e, const std::string& what) {
  if (e.value.IsNull()) return {};
  if (!e.value.IsMap()) {
    reader.fail_at(e, fmt::format("{}: expected a mapping of {} keys (or {{}}), got {}", e.path, what,
                                  describe(e.value)));
  }
  return reader.entries(e.value, e.path);
}

using Handler = std::function<void(const Entry&)>;
using HandlerTable = std::vector<std::pair<std::string, Handler>>;

std::vector<std::string> names_of(const HandlerTable& table) {
  std::vector<std::string> names;
  for (const auto& item : table)
    names.push_back(item.first);
  return names;
}

const std::vector<std::string>& fsdp_key_names();
const std::vector<std::string>& deepspeed_key_names();
const std::vector<std::string>& top_level_key_names();

// "unknown key" with the most useful hint: a section the key belongs in, a close spelling, or the full list.
[[noreturn]] void unknown_key(const Reader& reader, const Entry& e, const std::string& section,
                              const std::vector<std::string>& valid) {
  auto contains = [](const std::vector<std::string>& names, const std::string& name) {
    return std::find(names.begin(), names.end(), name) != names.end();
  };
  std::string hint;
  if (section.empty() && contains(fsdp_key_names(), e.name)) {
    hint =
        fmt::format(" (did you mean 'fsdp_config.{}'? it belongs inside the fsdp_config: section)", e.name);
  } else if (section.empty() && contains(deepspeed_key_names(), e.name)) {
    hint = fmt::format(
        " (did you mean 'deepspeed_config.{}'? it belongs inside the deepspeed_config: section)", e.name);
  } else if (!section.empty() && contains(top_level_key_names(), e.name)) {
    hint = fmt::format(" (it belongs at the top level, not inside {}:)", section);
  } else if (const std::optional<std::string> guess = closest(e.name, valid)) {
    hint = fmt::format(" (did you mean '{}'?)", join_path(section, *guess));
  } else {
    hint = fmt::format("; valid keys{}: {}", section.empty() ? std::string() : " in " + section, join(valid));
  }
  reader.fail_at(e, fmt::format("unknown key '{}'{}", e.path, hint));
}

void dispatch(Reader& reader, const std::vector<Entry>& entries, const HandlerTable& table,
              const std::string& section) {
  for (const Entry& e : entries) {
    const auto handler =
        std::find_if(table.begin(), table.end(), [&](const auto& h) { return h.first == e.name; });
    if (handler == table.end()) unknown_key(reader, e, section, names_of(table));
    if (e.value.IsNull()) continue;  // `key:` or `key: null` keeps the default, as Accelerate writes it
    handler->second(e);
  }
}

// Values whose meaning depends on other keys; resolved after the whole file has been read.
struct Pending {
  std::optional<Entry> backend;
  std::optional<Entry> distributed_type;
  std::optional<BackendKind> backend_value;
  std::optional<std::string> distributed_type_value;
  std::optional<Entry> use_cpu;
  std::optional<Entry> gradient_accumulation_steps;
  std::optional<Entry> deepspeed_gradient_accumulation_steps;
  std::optional<Entry> sharding_strategy;
  std::optional<Entry> reshard_after_forward;
  bool reshard_value = true;
};

const char* kPositiveInt = "a positive integer";
const char* kNonNegativeInt = "a non-negative integer";

void ignore(const Entry&) {}

HandlerTable fsdp_table(Reader& r, Config& c, Pending& p) {
  FsdpConfig& f = c.fsdp;
  return {
      {"fsdp_sharding_strategy",
       [&](const Entry& e) {
         f.sharding_strategy = r.choice(e, sharding_choices());
         p.sharding_strategy = e;
       }},
      {"fsdp_reshard_after_forward",
       [&](const Entry& e) {
         p.reshard_value = r.boolean(e);
         p.reshard_after_forward = e;
       }},
      {"fsdp_auto_wrap_policy", [&](const Entry& e) { f.auto_wrap_policy = r.choice(e, wrap_choices()); }},
      {"fsdp_min_num_params",
       [&](const Entry& e) {
         f.min_num_params = static_cast<int64_t>(std::min<uint64_t>(
             r.count(e, 0, kNonNegativeInt), static_cast<uint64_t>(std::numeric_limits<int64_t>::max())));
       }},
      {"fsdp_transformer_layer_cls_to_wrap",
       [&](const Entry& e) { f.transformer_layer_cls_to_wrap = r.string(e); }},
      {"fsdp_backward_prefetch",
       [&](const Entry& e) { f.backward_prefetch = r.choice(e, prefetch_choices()); }},
      // Older Accelerate versions wrote this name.
      {"fsdp_backward_prefetch_policy",
       [&](const Entry& e) { f.backward_prefetch = r.choice(e, prefetch_choices()); }},
      {"fsdp_forward_prefetch", [&](const Entry& e) { f.forward_prefetch = r.boolean(e); }},
      {"fsdp_offload_params", [&](const Entry& e) { f.offload_params = r.boolean(e); }},
      {"fsdp_state_dict_type",
       [&](const Entry& e) { f.state_dict_type = r.choice(e, state_dict_choices()); }},
      {"fsdp_activation_checkpointing", [&](const Entry& e) { f.activation_checkpointing = r.boolean(e); }},
      {"fsdp_version", [&](const Entry& e) { f.version = static_cast<int>(r.integer(e, 1, 2, "1 or 2")); }},
      {"fsdp_cpu_ram_efficient_loading", [&](const Entry& e) { f.cpu_ram_efficient_loading = r.boolean(e); }},
      {"fsdp_sync_module_states", [&](const Entry& e) { f.sync_module_states = r.boolean(e); }},
      {"fsdp_use_orig_params", [&](const Entry& e) { f.use_orig_params = r.boolean(e); }},
  };
}

HandlerTable deepspeed_table(Reader& r, Config& c, Pending& p) {
  ZeroConfig& z = c.zero;
  const std::string bytes = "a positive number of bytes (such as 500000000 or 5e8)";
  return {
      {"zero_stage", [&](const Entry& e) { z.stage = static_cast<int>(r.integer(e, 0, 3, "0, 1, 2 or 3")); }},
      {"offload_optimizer_device",
       [&](const Entry& e) { z.offload_optimizer_device = r.choice(e, offload_choices()); }},
      {"offload_param_device",
       [&](const Entry& e) { z.offload_param_device = r.choice(e, offload_choices()); }},
      {"gradient_accumulation_steps",
       [&](const Entry& e) {
         r.integer(e, 1, std::numeric_limits<int>::max(), kPositiveInt);
         p.deepspeed_gradient_accumulation_steps = e;
       }},
      {"gradient_clipping",
       [&](const Entry& e) {
         z.gradient_clipping = r.number(e, 0, true, "a non-negative number (0 disables)");
       }},
      {"zero3_init_flag", [&](const Entry& e) { z.zero3_init_flag = r.boolean(e); }},
      {"zero3_save_16bit_model", [&](const Entry& e) { z.zero3_save_16bit_model = r.boolean(e); }},
      {"reduce_bucket_size",
       [&r, &z, bytes](const Entry& e) { z.reduce_bucket_size = r.count(e, 1, bytes); }},
      {"overlap_comm", [&](const Entry& e) { z.overlap_comm = r.boolean(e); }},
      {"allgather_bucket_size",
       [&r, &z, bytes](const Entry& e) { z.allgather_bucket_size = r.count(e, 1, bytes); }},
      {"stage3_prefetch_bucket_size",
       [&r, &z, bytes](const Entry& e) { z.stage3_prefetch_bucket_size = r.count(e, 1, bytes); }},
      {"activation_checkpointing", [&](const Entry& e) { z.activation_checkpointing = r.boolean(e); }},
      {"deepspeed_multinode_launcher", ignore},
      {"deepspeed_config_file",
       [&](const Entry& e) {
         r.fail_at(
             e, fmt::format("{}: a DeepSpeed JSON file is not supported by accelerate-cpp; put its settings "
                            "(zero_stage, offload_optimizer_device, ...) into deepspeed_config:",
                            e.path));
       }},
  };
}

// dynamo_config: LibTorch has no torch.compile, so only "no dynamo" is accepted.
void check_dynamo_backend(const Reader& r, const Entry& e) {
  const std::string text = r.scalar(e, "'NO'");
  const std::string value = lower(text);
  if (value != "no" && value != "false") {
    r.fail_at(e,
              fmt::format("{}: '{}' is not supported by accelerate-cpp (LibTorch has no torch.compile); set "
                          "dynamo_backend: 'NO' or remove it",
                          e.path, text));
  }
}

void read_dynamo_config(Reader& r, const Entry& section) {
  const std::vector<Entry> entries = section_entries(r, section, "dynamo_*");
  const HandlerTable table = {{"dynamo_backend", [&](const Entry& e) { check_dynamo_backend(r, e); }},
                              {"dynamo_mode", ignore},
                              {"dynamo_use_fullgraph", ignore},
                              {"dynamo_use_dynamic", ignore},
                              {"dynamo_use_regional_compilation", ignore}};
  dispatch(r, entries, table, section.path);
}

// Accelerate plugin sections with no accelerate-cpp equivalent: fine when empty, an error otherwise.
void require_empty_section(const Reader& r, const Entry& e, const std::string& feature) {
  if (e.value.IsMap() && e.value.size() == 0) return;
  r.fail_at(e, fmt::format(
                   "{}: {} is not supported by accelerate-cpp; remove this section or leave it empty ({{}})",
                   e.path, feature));
}

HandlerTable top_level_table(Reader& r, Config& c, Pending& p) {
  return {
      {"config_version", ignore},  // read before everything else
      {"compute_environment", [&](const Entry& e) { c.compute_environment = r.string(e); }},
      {"backend",
       [&](const Entry& e) {
         p.backend_value = r.choice(e, backend_choices());
         p.backend = e;
       }},
      {"distributed_type",
       [&](const Entry& e) {
         p.distributed_type_value = r.choice(e, distributed_type_choices());
         p.distributed_type = e;
       }},
      {"use_cpu",
       [&](const Entry& e) {
         c.use_cpu = r.boolean(e);
         p.use_cpu = e;
       }},
      {"debug", [&](const Entry& e) { c.debug = r.boolean(e); }},
      {"gpu_ids", [&](const Entry& e) { c.gpu_ids = r.string(e); }},
      {"num_processes",
       [&](const Entry& e) {
         c.num_processes = static_cast<int>(r.integer(e, 1, std::numeric_limits<int>::max(), kPositiveInt));
       }},
      {"num_machines",
       [&](const Entry& e) {
         c.num_machines = static_cast<int>(r.integer(e, 1, std::numeric_limits<int>::max(), kPositiveInt));
       }},
      {"machine_rank",
       [&](const Entry& e) {
         c.machine_rank = static_cast<int>(r.integer(e, 0, std::numeric_limits<int>::max(), kNonNegativeInt));
       }},
      {"main_process_ip", [&](const Entry& e) { c.main_process_ip = r.string(e); }},
      {"main_process_port",
       [&](const Entry& e) {
         c.main_process_port = static_cast<int>(r.integer(e, 0, 65535, "a port number from 0 to 65535"));
       }},
      {"mixed_precision",
       [&](const Entry& e) { c.mixed_precision = r.choice(e, mixed_precision_choices()); }},
      {"gradient_accumulation_steps",
       [&](const Entry& e) {
         c.gradient_accumulation_steps =
             static_cast<int>(r.integer(e, 1, std::numeric_limits<int>::max(), kPositiveInt));
         p.gradient_accumulation_steps = e;
       }},
      {"collective_timeout_seconds",
       [&](const Entry& e) {
         c.collective_timeout_seconds = r.number(e, 0, false, "a positive number of seconds");
       }},
      {"seed", [&](const Entry& e) { c.seed = r.unsigned64(e, kNonNegativeInt); }},
      {"even_batches", [&](const Entry& e) { c.even_batches = r.boolean(e); }},
      {"split_batches", [&](const Entry& e) { c.split_batches = r.boolean(e); }},
      {"ddp_bucket_cap_mb",
       [&](const Entry& e) { c.ddp_bucket_cap_mb = r.number(e, 0, false, "a positive number of MiB"); }},
      {"ddp_first_bucket_cap_mb",
       [&](const Entry& e) {
         c.ddp_first_bucket_cap_mb = r.number(e, 0, false, "a positive number of MiB");
       }},
      {"ddp_find_unused_parameters", [&](const Entry& e) { c.ddp_find_unused_parameters = r.boolean(e); }},
      {"ddp_broadcast_buffers", [&](const Entry& e) { c.ddp_broadcast_buffers = r.boolean(e); }},
      {"fsdp_config",
       [&](const Entry& e) { dispatch(r, section_entries(r, e, "fsdp_*"), fsdp_table(r, c, p), e.path); }},
      {"deepspeed_config",
       [&](const Entry& e) {
         dispatch(r, section_entries(r, e, "DeepSpeed"), deepspeed_table(r, c, p), e.path);
       }},
      {"dynamo_config", [&](const Entry& e) { read_dynamo_config(r, e); }},
      {"dynamo_backend", [&](const Entry& e) { check_dynamo_backend(r, e); }},  // older Accelerate files
      {"megatron_lm_config", [&](const Entry& e) { require_empty_section(r, e, "Megatron-LM"); }},
      {"fp8_config", [&](const Entry& e) { require_empty_section(r, e, "fp8 training"); }},
      // Accelerate keys with no meaning for accelerate-cpp; accepted so that Accelerate's files load.
      {"main_training_function", ignore},
      {"downcast_bf16", ignore},
      {"enable_cpu_affinity", ignore},
      {"rdzv_backend", ignore},
      {"same_network", ignore},
      {"tpu_env", ignore},
      {"tpu_use_cluster", ignore},
      {"tpu_use_sudo", ignore},
      {"tpu_name", ignore},
      {"tpu_zone", ignore},
      {"commands", ignore},
      {"command_file", ignore},
  };
}

// Key names per section, for "did you mean" and "it belongs in ..." hints.
const std::vector<std::string>& fsdp_key_names() {
  static const std::vector<std::string> kNames = [] {
    Reader r("");
    Config c;
    Pending p;
    return names_of(fsdp_table(r, c, p));
  }();
  return kNames;
}

const std::vector<std::string>& deepspeed_key_names() {
  static const std::vector<std::string> kNames = [] {
    Reader r("");
    Config c;
    Pending p;
    return names_of(deepspeed_table(r, c, p));
  }();
  return kNames;
}

const std::vector<std::string>& top_level_key_names() {
  static const std::vector<std::string> kNames = [] {
    Reader r("");
    Config c;
    Pending p;
    return names_of(top_level_table(r, c, p));
  }();
  return kNames;
}

BackendKind backend_of_distributed_type(const std::string& type) {
  if (type == "MULTI_CPU" || type == "MULTI_GPU") return BackendKind::Ddp;
  if (type == "FSDP") return BackendKind::Fsdp;
  if (type == "DEEPSPEED") return BackendKind::Zero;
  return BackendKind::Local;
}

void resolve(const Reader& r, Config& c, const Pending& p) {
  if (p.distributed_type_value) {
    const BackendKind implied = backend_of_distributed_type(*p.distributed_type_value);
    if (p.backend_value && *p.backend_value != implied) {
      r.fail_at(
          *p.backend,
          fmt::format("backend: '{}' disagrees with distributed_type '{}' (line {}), which means backend {}; "
                      "make them agree or remove one of them",
                      p.backend->value.Scalar(), p.distributed_type->value.Scalar(), p.distributed_type->line,
                      to_string(implied)));
    }
    c.backend = implied;
    if (*p.distributed_type_value == "MULTI_CPU") {
      if (p.use_cpu && !c.use_cpu) {
        r.fail_at(*p.use_cpu,
                  fmt::format("use_cpu: false contradicts distributed_type 'MULTI_CPU' (line {}); set "
                              "use_cpu: true, or distributed_type: MULTI_GPU to train on GPUs",
                              p.distributed_type->line));
      }
      c.use_cpu = true;
    }
  } else if (p.backend_value) {
    c.backend = *p.backend_value;
  }

  if (p.deepspeed_gradient_accumulation_steps) {
    const Entry& ds = *p.deepspeed_gradient_accumulation_steps;
    const int ds_value = static_cast<int>(r.integer(ds, 1, std::numeric_limits<int>::max(), kPositiveInt));
    if (p.gradient_accumulation_steps && ds_value != c.gradient_accumulation_steps) {
      r.fail_at(
          ds,
          fmt::format("{}: {} disagrees with gradient_accumulation_steps {} (line {}); make them agree "
                      "or remove one of them",
                      ds.path, ds_value, c.gradient_accumulation_steps, p.gradient_accumulation_steps->line));
    }
    c.gradient_accumulation_steps = ds_value;
  }

  if (p.reshard_after_forward) {
    const ShardingStrategy implied =
        p.reshard_value ? ShardingStrategy::FullShard : ShardingStrategy::ShardGradOp;
    if (p.sharding_strategy && c.fsdp.sharding_strategy != ShardingStrategy::NoShard &&
        c.fsdp.sharding_strategy != implied) {
      r.fail_at(
          *p.reshard_after_forward,
          fmt::format("{}: {} disagrees with fsdp_sharding_strategy '{}' (line {}); reshard_after_forward "
                      "true means FULL_SHARD and false means SHARD_GRAD_OP: make them agree or remove one",
                      p.reshard_after_forward->path, yaml_bool(p.reshard_value),
                      p.sharding_strategy->value.Scalar(), p.sharding_strategy->line));
    }
    if (!p.sharding_strategy) c.fsdp.sharding_strategy = implied;
  }
}

// -----------------------------------------------------------------------------------------------------------
// Validation shared by Config::validate (no line numbers) and loading (lines of the offending keys).

void validate_config(const Config& c, const LineMap& lines) {
  auto fail_key = [&](const std::string& key, const std::string& body) {
    const auto it = lines.find(key);
    fail(c.source, it == lines.end() ? 0 : it->second, key, body);
  };
  if (c.config_version != 1) {
    fail_key("config_version",
             fmt::format("config_version: this build of accelerate-cpp reads config_version 1 only, got {}; "
                         "upgrade accelerate-cpp or write a new file with 'accel-launch config'",
                         c.config_version));
  }
  if (c.compute_environment != "LOCAL_MACHINE") {
    fail_key(
        "compute_environment",
        fmt::format(
            "compute_environment: '{}' is not supported by accelerate-cpp; allowed values: LOCAL_MACHINE",
            c.compute_environment));
  }
  if (c.num_machines < 1) {
    fail_key("num_machines", fmt::format("num_machines ({}) must be at least 1", c.num_machines));
  }
  if (c.num_processes < 1) {
    fail_key("num_processes", fmt::format("num_processes ({}) must be at least 1", c.num_processes));
  }
  if (c.machine_rank < 0 || c.machine_rank >= c.num_machines) {
    fail_key("machine_rank",
             fmt::format("machine_rank ({}) must be {} num_machines ({}); set machine_rank to 0..{}",
                         c.machine_rank, c.machine_rank < 0 ? "0 or more and less than" : "less than",
                         c.num_machines, c.num_machines - 1));
  }
  if (c.num_processes % c.num_machines != 0) {
    const int below = c.num_processes / c.num_machines * c.num_machines;
    const int above = below + c.num_machines;
    fail_key(
        "num_processes",
        fmt::format("num_processes ({}) must be a multiple of num_machines ({}), as it counts the processes "
                    "of all machines; set num_processes to {}",
                    c.num_processes, c.num_machines,
                    below > 0 ? fmt::format("{} or {}", below, above) : std::to_string(above)));
  }
  if (c.backend == BackendKind::Local && c.num_processes > 1) {
    fail_key("num_processes",
             fmt::format("num_processes ({}) needs a distributed backend, but the backend is local; set "
                         "distributed_type: MULTI_GPU (or MULTI_CPU, FSDP, DEEPSPEED) or num_processes: 1",
                         c.num_processes));
  }
  if (c.main_process_port < 0 || c.main_process_port > 65535) {
    fail_key(
        "main_process_port",
        fmt::format("main_process_port ({}) must be in 0..65535 (0 picks a free port)", c.main_process_port));
  }
  if (c.gradient_accumulation_steps < 1) {
    fail_key("gradient_accumulation_steps", fmt::format("gradient_accumulation_steps ({}) must be at least 1",
                                                        c.gradient_accumulation_steps));
  }
  if (!(c.collective_timeout_seconds > 0) || !std::isfinite(c.collective_timeout_seconds)) {
    fail_key("collective_timeout_seconds",
             fmt::format("collective_timeout_seconds ({}) must be a positive number",
                         c.collective_timeout_seconds));
  }
  if (!(c.ddp_bucket_cap_mb > 0) || !std::isfinite(c.ddp_bucket_cap_mb)) {
    fail_key("ddp_bucket_cap_mb",
             fmt::format("ddp_bucket_cap_mb ({}) must be a positive number", c.ddp_bucket_cap_mb));
  }
  if (!(c.ddp_first_bucket_cap_mb > 0) || !std::isfinite(c.ddp_first_bucket_cap_mb)) {
    fail_key("ddp_first_bucket_cap_mb", fmt::format("ddp_first_bucket_cap_mb ({}) must be a positive number",
                                                    c.ddp_first_bucket_cap_mb));
  }

  const FsdpConfig& f = c.fsdp;
  if (f.min_num_params < 0) {
    fail_key("fsdp_config.fsdp_min_num_params",
             fmt::format("fsdp_config.fsdp_min_num_params ({}) must not be negative", f.min_num_params));
  }
  if (f.version != 1 && f.version != 2) {
    fail_key("fsdp_config.fsdp_version",
             fmt::format("fsdp_config.fsdp_version ({}) must be 1 or 2", f.version));
  }
  if (c.backend == BackendKind::Fsdp && f.auto_wrap_policy == AutoWrapPolicy::TransformerBasedWrap &&
      f.transformer_layer_cls_to_wrap.empty()) {
    fail_key("fsdp_config.fsdp_auto_wrap_policy",
             "fsdp_config.fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP needs "
             "fsdp_config.fsdp_transformer_layer_cls_to_wrap (comma-separated module names as returned by "
             "Module::name()); set it, or use PER_CHILD_WRAP");
  }

  const ZeroConfig& z = c.zero;
  if (z.stage < 0 || z.stage > 3) {
    fail_key("deepspeed_config.zero_stage",
             fmt::format("deepspeed_config.zero_stage ({}) must be 0, 1, 2 or 3", z.stage));
  }
  if (z.offload_param_device == OffloadDevice::Cpu && z.stage != 3) {
    fail_key("deepspeed_config.offload_param_device",
             fmt::format(
                 "deepspeed_config.offload_param_device: cpu needs zero_stage 3, but zero_stage is {}; set "
                 "zero_stage: 3 or offload_param_device: none",
                 z.stage));
  }
  if (z.offload_optimizer_device == OffloadDevice::Cpu && z.stage == 0) {
    fail_key(
        "deepspeed_config.offload_optimizer_device",
        "deepspeed_config.offload_optimizer_device: cpu needs zero_stage 1, 2 or 3, but zero_stage is 0; set "
        "zero_stage or offload_optimizer_device: none");
  }
  if (!(z.gradient_clipping >= 0) || !std::isfinite(z.gradient_clipping)) {
    fail_key("deepspeed_config.gradient_clipping",
             fmt::format("deepspeed_config.gradient_clipping ({}) must be 0 (off) or a positive number",
                         z.gradient_clipping));
  }
  const std::pair<const char*, uint64_t> buckets[] = {
      {"reduce_bucket_size", z.reduce_bucket_size},
      {"allgather_bucket_size", z.allgather_bucket_size},
      {"stage3_prefetch_bucket_size", z.stage3_prefetch_bucket_size}};
  for (const auto& [name, bytes] : buckets) {
    if (bytes == 0) {
      const std::string key = join_path("deepspeed_config", name);
      fail_key(key, fmt::format("{} must be a positive number of bytes", key));
    }
  }
}

Config load_yaml(const std::string& text, const std::string& source) {
  Reader reader(source);
  std::vector<YAML::Node> documents;
  try {
    documents = YAML::LoadAll(text);
  } catch (const YAML::Exception& e) {
    fail(source, e.mark.line >= 0 ? e.mark.line + 1 : 0, "",
         fmt::format(
             "YAML syntax error: {}{}; check the indentation and quoting on this line and the one above",
             e.msg, e.mark.column >= 0 ? fmt::format(" (column {})", e.mark.column + 1) : std::string()));
  }
  for (size_t i = 1; i < documents.size(); ++i) {
    if (!documents[i].IsNull()) {
      fail(source, line_of(documents[i]), "",
           "a second YAML document starts here; a config file holds exactly one (remove the '---' line and "
           "what "
           "follows, or merge the two)");
    }
  }

  Config config;
  config.source = source;
  if (documents.empty() || documents[0].IsNull()) return config;  // an empty file means all defaults
  const YAML::Node& root = documents[0];
  if (!root.IsMap()) {
    fail(source, line_of(root), "",
         fmt::format("expected a mapping of 'key: value' lines at the top level, got {}; see "
                     "config_templates/local.yaml for an example",
                     describe(root)));
  }

  const std::vector<Entry> entries = reader.entries(root, "");
  // The schema version decides how everything else is read, so it is checked first.
  for (const Entry& e : entries) {
    if (e.name != "config_version" || e.value.IsNull()) continue;
    int64_t version = 0;
    if (!e.value.IsScalar() || !parse_int64(e.value.Scalar(), version) || version != 1) {
      reader.fail_at(
          e, fmt::format("config_version: this build of accelerate-cpp reads config_version 1 only, "
                         "got {}; upgrade accelerate-cpp or write a new file with 'accel-launch config'",
                         describe(e.value)));
    }
  }

  Pending pending;
  dispatch(reader, entries, top_level_table(reader, config, pending), "");
  resolve(reader, config, pending);
  validate_config(config, reader.lines());
  return config;
}

}  // namespace

// -----------------------------------------------------------------------------------------------------------
// Public API.

std::string to_string(BackendKind kind) {
  return canonical_text(backend_choices(), kind);
}
std::string to_string(MixedPrecision mode) {
  return canonical_text(mixed_precision_choices(), mode);
}
std::string to_string(ShardingStrategy strategy) {
  return canonical_text(sharding_choices(), strategy);
}
std::string to_string(AutoWrapPolicy policy) {
  return canonical_text(wrap_choices(), policy);
}
std::string to_string(BackwardPrefetch prefetch) {
  return canonical_text(prefetch_choices(), prefetch);
}
std::string to_string(StateDictType type) {
  return canonical_text(state_dict_choices(), type);
}
std::string to_string(OffloadDevice device) {
  return canonical_text(offload_choices(), device);
}

BackendKind parse_backend(const std::string& text) {
  const std::optional<BackendKind> kind = match_choice(backend_choices(), text);
  if (!kind) throw ConfigError(bad_choice_message("backend", backend_choices(), text), "", 0, "backend");
  return *kind;
}

MixedPrecision parse_mixed_precision(const std::string& text) {
  const std::optional<MixedPrecision> mode = match_choice(mixed_precision_choices(), text);
  if (!mode) {
    throw ConfigError(bad_choice_message("mixed_precision", mixed_precision_choices(), text), "", 0,
                      "mixed_precision");
  }
  return *mode;
}

bool operator==(const FsdpConfig& a, const FsdpConfig& b) {
  return a.sharding_strategy == b.sharding_strategy && a.auto_wrap_policy == b.auto_wrap_policy &&
         a.min_num_params == b.min_num_params &&
         a.transformer_layer_cls_to_wrap == b.transformer_layer_cls_to_wrap &&
         a.backward_prefetch == b.backward_prefetch && a.forward_prefetch == b.forward_prefetch &&
         a.offload_params == b.offload_params && a.state_dict_type == b.state_dict_type &&
         a.activation_checkpointing == b.activation_checkpointing && a.version == b.version &&
         a.cpu_ram_efficient_loading == b.cpu_ram_efficient_loading &&
         a.sync_module_states == b.sync_module_states && a.use_orig_params == b.use_orig_params;
}

bool operator==(const ZeroConfig& a, const ZeroConfig& b) {
  return a.stage == b.stage && a.offload_optimizer_device == b.offload_optimizer_device &&
         a.offload_param_device == b.offload_param_device && a.gradient_clipping == b.gradient_clipping &&
         a.zero3_init_flag == b.zero3_init_flag && a.zero3_save_16bit_model == b.zero3_save_16bit_model &&
         a.reduce_bucket_size == b.reduce_bucket_size && a.allgather_bucket_size == b.allgather_bucket_size &&
         a.stage3_prefetch_bucket_size == b.stage3_prefetch_bucket_size && a.overlap_comm == b.overlap_comm &&
         a.activation_checkpointing == b.activation_checkpointing;
}

bool operator==(const Config& a, const Config& b) {
  return a.config_version == b.config_version && a.compute_environment == b.compute_environment &&
         a.backend == b.backend && a.use_cpu == b.use_cpu && a.debug == b.debug && a.gpu_ids == b.gpu_ids &&
         a.num_processes == b.num_processes && a.num_machines == b.num_machines &&
         a.machine_rank == b.machine_rank && a.main_process_ip == b.main_process_ip &&
         a.main_process_port == b.main_process_port && a.mixed_precision == b.mixed_precision &&
         a.gradient_accumulation_steps == b.gradient_accumulation_steps &&
         a.collective_timeout_seconds == b.collective_timeout_seconds && a.seed == b.seed &&
         a.even_batches == b.even_batches && a.split_batches == b.split_batches &&
         a.ddp_bucket_cap_mb == b.ddp_bucket_cap_mb &&
         a.ddp_first_bucket_cap_mb == b.ddp_first_bucket_cap_mb &&
         a.ddp_find_unused_parameters == b.ddp_find_unused_parameters &&
         a.ddp_broadcast_buffers == b.ddp_broadcast_buffers && a.fsdp == b.fsdp && a.zero == b.zero;
}

Config Config::load_file(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) {
    throw ConfigError(
        fmt::format("cannot open config file '{}': it is a directory; pass the YAML file inside it, "
                    "or create one with 'accel-launch config'",
                    path),
        path);
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    const int error = errno;
    throw ConfigError(fmt::format("cannot open config file '{}': {}; create one with 'accel-launch config'",
                                  path, error != 0 ? std::strerror(error) : "unknown error"),
                      path);
  }
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) {
    throw ConfigError(fmt::format("cannot read config file '{}': {}", path, std::strerror(errno)), path);
  }
  return load_yaml(text.str(), path);
}

Config Config::load_string(const std::string& yaml, const std::string& source_name) {
  return load_yaml(yaml, source_name);
}

void Config::validate() const {
  validate_config(*this, LineMap{});
}

std::string Config::to_yaml() const {
  std::string distributed_type = "NO";
  if (backend == BackendKind::Ddp) distributed_type = use_cpu ? "MULTI_CPU" : "MULTI_GPU";
  if (backend == BackendKind::Fsdp) distributed_type = "FSDP";
  if (backend == BackendKind::Zero) distributed_type = "DEEPSPEED";

  std::string out;
  auto line = [&out](const std::string& key, const std::string& value) { out += key + ": " + value + "\n"; };
  out += "# accelerate-cpp configuration (Hugging Face Accelerate keys plus accelerate-cpp's own).\n";
  line("config_version", std::to_string(config_version));
  line("compute_environment", yaml_string(compute_environment));
  out +=
      "# backend (local|ddp|fsdp|zero) is accelerate-cpp's shorthand for distributed_type: the two must "
      "agree "
      "(or delete one).\n";
  line("backend", to_string(backend));
  line("distributed_type", distributed_type == "NO" ? "'NO'" : distributed_type);
  line("use_cpu", yaml_bool(use_cpu));
  line("debug", yaml_bool(debug));
  line("gpu_ids", yaml_string(gpu_ids));
  line("num_processes", std::to_string(num_processes));
  line("num_machines", std::to_string(num_machines));
  line("machine_rank", std::to_string(machine_rank));
  line("main_process_ip", main_process_ip.empty() ? "null" : yaml_string(main_process_ip));
  line("main_process_port", std::to_string(main_process_port));
  line("mixed_precision", "'" + to_string(mixed_precision) + "'");
  line("gradient_accumulation_steps", std::to_string(gradient_accumulation_steps));
  line("collective_timeout_seconds", fmt::format("{}", collective_timeout_seconds));
  line("seed", seed ? std::to_string(*seed) : "null");
  line("even_batches", yaml_bool(even_batches));
  line("split_batches", yaml_bool(split_batches));
  line("ddp_bucket_cap_mb", fmt::format("{}", ddp_bucket_cap_mb));
  line("ddp_first_bucket_cap_mb", fmt::format("{}", ddp_first_bucket_cap_mb));
  line("ddp_find_unused_parameters", yaml_bool(ddp_find_unused_parameters));
  line("ddp_broadcast_buffers", yaml_bool(ddp_broadcast_buffers));

  if (backend == BackendKind::Fsdp || fsdp != FsdpConfig{}) {
    out += "fsdp_config:\n";
    auto item = [&line](const std::string& key, const std::string& value) { line("  " + key, value); };
    item("fsdp_sharding_strategy", to_string(fsdp.sharding_strategy));
    item("fsdp_auto_wrap_policy", to_string(fsdp.auto_wrap_policy));
    item("fsdp_min_num_params", std::to_string(fsdp.min_num_params));
    item("fsdp_transformer_layer_cls_to_wrap", fsdp.transformer_layer_cls_to_wrap.empty()
                                                   ? "null"
                                                   : yaml_string(fsdp.transformer_layer_cls_to_wrap));
    item("fsdp_backward_prefetch", to_string(fsdp.backward_prefetch));
    item("fsdp_forward_prefetch", yaml_bool(fsdp.forward_prefetch));
    item("fsdp_offload_params", yaml_bool(fsdp.offload_params));
    item("fsdp_state_dict_type", to_string(fsdp.state_dict_type));
    item("fsdp_activation_checkpointing", yaml_bool(fsdp.activation_checkpointing));
    item("fsdp_version", std::to_string(fsdp.version));
    item("fsdp_cpu_ram_efficient_loading", yaml_bool(fsdp.cpu_ram_efficient_loading));
    item("fsdp_sync_module_states", yaml_bool(fsdp.sync_module_states));
    item("fsdp_use_orig_params", yaml_bool(fsdp.use_orig_params));
  } else {
    line("fsdp_config", "{}");
  }
  if (backend == BackendKind::Zero || zero != ZeroConfig{}) {
    out += "deepspeed_config:\n";
    auto item = [&line](const std::string& key, const std::string& value) { line("  " + key, value); };
    item("zero_stage", std::to_string(zero.stage));
    item("offload_optimizer_device", to_string(zero.offload_optimizer_device));
    item("offload_param_device", to_string(zero.offload_param_device));
    item("gradient_clipping", fmt::format("{}", zero.gradient_clipping));
    item("zero3_init_flag", yaml_bool(zero.zero3_init_flag));
    item("zero3_save_16bit_model", yaml_bool(zero.zero3_save_16bit_model));
    item("reduce_bucket_size", std::to_string(zero.reduce_bucket_size));
    item("overlap_comm", yaml_bool(zero.overlap_comm));
    item("allgather_bucket_size", std::to_string(zero.allgather_bucket_size));
    item("stage3_prefetch_bucket_size", std::to_string(zero.stage3_prefetch_bucket_size));
    item("activation_checkpointing", yaml_bool(zero.activation_checkpointing));
  } else {
    line("deepspeed_config", "{}");
  }
  return out;
}

void Config::save_file(const std::string& path) const {
  const std::string text = to_yaml();
  const std::filesystem::path file(path);
  std::error_code ec;
  if (file.has_parent_path()) {
    std::filesystem::create_directories(file.parent_path(), ec);
    if (ec) {
      throw ConfigError(fmt::format("cannot create directory '{}' for config file '{}': {}",
                                    file.parent_path().string(), path, ec.message()),
                        path);
    }
  }
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) {
    throw ConfigError(fmt::format("cannot write config file '{}': {}", path, std::strerror(errno)), path);
  }
  out << text;
  out.flush();
  if (!out) {
    throw ConfigError(fmt::format("cannot write config file '{}': {}", path, std::strerror(errno)), path);
  }
}

}  // namespace accel
