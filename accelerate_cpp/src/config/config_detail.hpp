#pragma once
// The private side of accel::Config (config_*.cpp and the backends' *_config.cpp only): the key schema, the
// YAML reader with its messages, the spelling tables of the enumerations, and what a backend contributes to
// the config (BackendPart). yaml-cpp and fmt stay out of the public header.

#include "accel/config/config.hpp"
#include "accel/config/questions.hpp"
#include "accel/monitor/memory.hpp"

#include "config/text_distance.hpp"

#include <fmt/format.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <locale>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace accel::config_detail {

using accel::detail::closest;

// -----------------------------------------------------------------------------------------------------------
// Small string helpers.

inline std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
  return s;
}

inline std::string join(const std::vector<std::string>& items, const char* separator = ", ") {
  std::string out;
  for (size_t i = 0; i < items.size(); ++i) {
    if (i > 0) out += separator;
    out += items[i];
  }
  return out;
}

inline std::string join_path(const std::string& prefix, const std::string& name) {
  return prefix.empty() ? name : prefix + "." + name;
}

/// How a YAML node is named in "expected X, got Y" messages.
std::string describe(const YAML::Node& node);
/// `text` as a YAML scalar that reads back as the same string (never as a bool, number or null).
std::string yaml_string(const std::string& text);
inline std::string yaml_bool(bool value) {
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

/// Backend names (canonical, listed) and aliases (not listed), from the backends' parts.
const ChoiceSet<std::string>& backend_choices();
const ChoiceSet<MixedPrecision>& mixed_precision_choices();
const ChoiceSet<CommHook>& comm_hook_choices();
/// distributed_type values (from the backends' parts) map onto backends; MULTI_CPU additionally implies
/// use_cpu.
const ChoiceSet<std::string>& distributed_type_choices();

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
inline std::string location(const std::string& source, int line) {
  if (source.empty()) return line > 0 ? fmt::format("line {}: ", line) : std::string();
  return line > 0 ? fmt::format("{}:{}: ", source, line) : source + ": ";
}

[[noreturn]] inline void fail(const std::string& source, int line, const std::string& key,
                              const std::string& body) {
  throw ConfigError(location(source, line) + body, source, line, key);
}

struct Entry {
  std::string name;  // key as written
  std::string path;  // dotted key path, e.g. fsdp_config.fsdp_version
  int line;          // 1-based line of the key, 0 if unknown
  YAML::Node value;
};

inline int line_of(const YAML::Node& node) {
  return std::max(0, node.Mark().line + 1);
}

// An integer as Accelerate's YAML loader (PyYAML, YAML 1.1) reads it: an optional sign, then decimal
// (underscores allowed), 0b binary, 0x hexadecimal, a leading 0 for octal ("017" is 15), or base 60
// ("1:30" is 90). False when `text` is none of these or does not fit 64 bits.
inline bool parse_yaml_int(const std::string& text, bool& negative, uint64_t& magnitude) {
  std::string t;
  for (char c : text)
    if (c != '_') t += c;
  if (t.empty() || text[0] == '_') return false;
  negative = t[0] == '-';
  if (t[0] == '-' || t[0] == '+') t.erase(0, 1);
  if (t.empty()) return false;
  auto digits = [&](const std::string& s, int base, uint64_t& v) {
    const auto r = std::from_chars(s.data(), s.data() + s.size(), v, base);
    return !s.empty() && r.ec == std::errc() && r.ptr == s.data() + s.size();
  };
  if (t.find(':') != std::string::npos) {  // base 60: [1-9][0-9]*(:[0-5]?[0-9])+
    if (t[0] < '1' || t[0] > '9') return false;
    magnitude = 0;
    std::size_t start = 0;
    for (bool first = true;; first = false) {
      const std::size_t colon = t.find(':', start);
      const std::string part =
          t.substr(start, colon == std::string::npos ? std::string::npos : colon - start);
      uint64_t v = 0;
      if (!digits(part, 10, v) || (!first && (part.size() > 2 || v > 59))) return false;
      if (magnitude > (UINT64_MAX - v) / 60) return false;
      magnitude = magnitude * 60 + v;
      if (colon == std::string::npos) return true;
      start = colon + 1;
    }
  }
  if (t.size() > 2 && t[0] == '0' && (t[1] == 'x' || t[1] == 'b'))
    return digits(t.substr(2), t[1] == 'x' ? 16 : 2, magnitude);
  if (t.size() > 1 && t[0] == '0') return digits(t.substr(1), 8, magnitude);
  return digits(t, 10, magnitude);
}

inline bool parse_int64(const std::string& text, int64_t& out) {
  bool negative = false;
  uint64_t magnitude = 0;
  if (!parse_yaml_int(text, negative, magnitude)) return false;
  if (negative ? magnitude > uint64_t{1} << 63 : magnitude > uint64_t{INT64_MAX}) return false;
  out = negative ? static_cast<int64_t>(0 - magnitude) : static_cast<int64_t>(magnitude);
  return true;
}

inline bool parse_double(const std::string& text, double& out) {
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
    // An explicit tag other than YAML's own scalar types (`!!binary`, which Accelerate's yaml.safe_load
    // decodes as base64 bytes, `!!python/...`, a custom `!tag`) would otherwise be read as its text.
    const std::string& tag = e.value.Tag();
    const std::string core = "tag:yaml.org,2002:";
    const bool plain = tag.empty() || tag == "?" || tag == "!" || tag == core + "str" ||
                       tag == core + "int" || tag == core + "float" || tag == core + "bool" ||
                       tag == core + "null";
    if (!plain) {
      const std::string shown = tag.rfind(core, 0) == 0 ? "!!" + tag.substr(core.size()) : tag;
      fail_at(e, fmt::format("{}: the YAML tag '{}' is not supported by accelerate-cpp (a setting is plain "
                             "text, a number, true/false or null; Accelerate's loader would not read it as "
                             "that text either); write the value without the tag",
                             e.path, shown));
    }
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
    bool negative = false;
    uint64_t value = 0;
    if (!parse_yaml_int(text, negative, value) || (negative && value != 0)) {
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
    int64_t as_int = 0;  // an integer as YAML 1.1 reads it ("017" is 15), else a float
    const std::string text = scalar(e, expected);
    if (parse_int64(text, as_int)) {
      value = static_cast<double>(as_int);
    } else if (!parse_double(text, value)) {
      value = -std::numeric_limits<double>::infinity();
    }
    if (value < min || (!min_inclusive && value == min) || !std::isfinite(value)) {
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
inline std::vector<Entry> section_entries(Reader& reader, const Entry& e, const std::string& what) {
  if (e.value.IsNull()) return {};
  if (!e.value.IsMap()) {
    reader.fail_at(e, fmt::format("{}: expected a mapping of {} keys (or {{}}), got {}", e.path, what,
                                  describe(e.value)));
  }
  return reader.entries(e.value, e.path);
}

// What the file set (non-null entries by key path), for the values that depend on other keys; resolved after
// the whole file has been read.
struct Pending {
  std::map<std::string, Entry> seen;
  const Entry* find(const std::string& path) const {
    const auto it = seen.find(path);
    return it == seen.end() ? nullptr : &it->second;
  }
};

// -----------------------------------------------------------------------------------------------------------
// The schema: one row per key. Reading, equality, writing, key lists, "did you mean" candidates and the docs
// table are all derived from it (config_schema.cpp).

/// A section is named by its YAML key: "" for the top level, "fsdp_config", "deepspeed_config", ...
using Section = std::string;
inline const Section kTop;

struct KeyRow {
  std::string name;  ///< the key as written in its section
  Section section;
  std::string doc;  ///< one line, for the docs table
  /// Reads a non-null value into the config or the pending values; nullptr: accepted, no effect (keys of
  /// Accelerate's that mean nothing here).
  std::function<void(Reader&, const Entry&, Config&, Pending&)> read;
  /// The value as YAML text; nullptr: never written (aliases, keys without effect). For a top-level row, ""
  /// leaves the key out, and text starting with a newline is a block of the section's keys below it.
  std::function<std::string(const Config&)> write;
  /// Whether two configs agree on the setting; nullptr: no setting of its own (derived, alias, ignored).
  std::function<bool(const Config&, const Config&)> equal;
  /// A valid non-default value (YAML text), used by the round-trip test; empty for rows without `equal`
  /// and for `only_default` rows.
  std::string example;
  /// The default is the only valid value (config_version, compute_environment).
  bool only_default = false;
  /// A comment line written above the key by to_yaml.
  std::string comment;
  /// The key opens this section (`fsdp_config:`), whose rows to_yaml writes nested.
  std::optional<Section> opens;
};

/// Every key, top level first, in the order to_yaml writes them.
const std::vector<KeyRow>& schema();
/// The rows of one section, in schema order.
std::vector<const KeyRow*> rows_of(const Section& section);
/// The key names of one section, for "did you mean" and "it belongs in ..." hints.
const std::vector<std::string>& key_names(const Section& section);
/// Whether `a` and `b` agree on every setting of `section` (on all settings when nullopt).
bool agree(const Config& a, const Config& b, const std::optional<Section>& section);
/// Whether to_yaml writes a section in full (else `{}`).
bool section_in_use(const Config& c, const Section& section);

/// Reads the entries of one section through its rows; an unknown key is an error with the best hint.
void dispatch(Reader& reader, const std::vector<Entry>& entries, const Section& section, Config& config,
              Pending& pending);
/// Settles the values that depend on other keys (backend vs distributed_type, ...).
void resolve(const Reader& r, Config& c, const Pending& p);
/// Cross-field validation; messages name the line of the offending key when `lines` knows it.
void validate_config(const Config& c, const LineMap& lines);
/// The refusal of a compute_environment other than LOCAL_MACHINE (checked before anything else in a file:
/// the decisive reason comes first).
std::string compute_environment_message(const std::string& value);

inline const char* kPositiveInt = "a positive integer";
inline const char* kNonNegativeInt = "a non-negative integer";

// --- value readers and writers for the rows ---

inline auto boolean() {
  return [](const Reader& r, const Entry& e) { return r.boolean(e); };
}
inline auto int_in(std::int64_t min, std::int64_t max, const char* expected) {
  return [=](const Reader& r, const Entry& e) { return static_cast<int>(r.integer(e, min, max, expected)); };
}
inline auto positive_int() {
  return int_in(1, std::numeric_limits<int>::max(), kPositiveInt);
}
inline auto text() {
  return [](const Reader& r, const Entry& e) { return r.string(e); };
}
// `all`, or the indices of the GPUs this machine's ranks may use, comma-separated (Accelerate's gpu_ids,
// which its launcher passes on as CUDA_VISIBLE_DEVICES): `0`, `0,1`, `'0, 2'`.
inline auto gpu_id_list() {
  return [](const Reader& r, const Entry& e) {
    static const char* kExpected = "all, or GPU indices separated by commas such as 0,1";
    std::string value = r.scalar(e, kExpected);
    if (value == "all") return value;
    std::string tidy;
    std::size_t start = 0;
    while (start <= value.size()) {
      const auto comma = std::min(value.find(',', start), value.size());
      auto token = value.substr(start, comma - start);
      token.erase(0, token.find_first_not_of(' '));
      token.erase(token.find_last_not_of(' ') + 1);
      if (token.empty() || token.size() > 4 || token.find_first_not_of("0123456789") != std::string::npos)
        r.fail_at(e, fmt::format("{}: expected {}, got '{}'", e.path, kExpected, value));
      tidy += (tidy.empty() ? "" : ",") + token;
      start = comma + 1;
    }
    return tidy;
  };
}
inline auto positive_number(const char* expected) {
  return [=](const Reader& r, const Entry& e) { return r.number(e, 0, false, expected); };
}
template <typename E>
auto choice(const ChoiceSet<E>& (*set)()) {
  return [set](const Reader& r, const Entry& e) { return r.choice(e, set()); };
}
// A number of bytes; 0 is allowed, as DeepSpeed's schema allows it (each key's row says what 0 means).
inline auto bytes() {
  return [](const Reader& r, const Entry& e) {
    return r.count(e, 0, "a non-negative number of bytes (such as 500000000 or 5e8)");
  };
}
// A number of bytes (0 allowed, as for bytes()) or `auto` (std::nullopt: the backend derives it from the
// model).
inline auto bytes_or_auto() {
  return [](const Reader& r, const Entry& e) -> std::optional<std::uint64_t> {
    static const char* kExpected = "a non-negative number of bytes (such as 500000000 or 5e8) or auto";
    if (r.scalar(e, kExpected) == "auto") return std::nullopt;
    return r.count(e, 0, kExpected);
  };
}
inline std::string write_bytes_or_auto(const std::optional<std::uint64_t>& v) {
  return v ? std::to_string(*v) : "auto";
}
inline std::string write_bool(bool v) {
  return yaml_bool(v);
}
inline std::string write_int(std::int64_t v) {
  return std::to_string(v);
}
inline std::string write_u64(std::uint64_t v) {
  return std::to_string(v);
}
inline std::string write_number(double v) {
  return fmt::format("{}", v);
}
template <typename E>
std::string write_enum(const E& v) {
  return to_string(v);
}

// A plain setting: `get(config)` is the field (works on const and non-const configs).
template <typename Get, typename Parse, typename Format>
KeyRow setting(const char* name, const Section& section, const char* doc, Get get, Parse parse, Format format,
               const char* example) {
  KeyRow row;
  row.name = name;
  row.section = section;
  row.doc = doc;
  row.example = example;
  row.read = [get, parse](Reader& r, const Entry& e, Config& c, Pending&) { get(c) = parse(r, e); };
  row.write = [get, format](const Config& c) { return format(get(c)); };
  row.equal = [get](const Config& a, const Config& b) { return get(a) == get(b); };
  return row;
}

// A key of Accelerate's that means nothing here (or is read only for the values depending on it): accepted,
// never written.
inline KeyRow ignored(const char* name, const Section& section, const char* doc) {
  KeyRow row;
  row.name = name;
  row.section = section;
  row.doc = doc;
  return row;
}

// The top-level key that opens `section` (its value a mapping of the section's keys, `what` in messages).
KeyRow section_row(const Section& section, const char* what, const char* doc);

// -----------------------------------------------------------------------------------------------------------
// Keys of Accelerate's and DeepSpeed's files that accelerate-cpp does not support: one table (data), whose
// rows the core (top-level YAML keys) and the backends' parts (their sections, a DeepSpeed JSON's keys)
// contribute, as they contribute schema rows. Reading a key checks it before "unknown key ... did you mean".

inline const char* kAccelerateYaml = "Accelerate YAML";
inline const char* kDeepSpeedJson = "DeepSpeed JSON";

/// The values of an unsupported key that ask for nothing, accepted without a word.
enum class AsksNothingWhen {
  Never,
  Null,      ///< null (a present {} already turns the feature on: DeepSpeed's zenflow)
  Empty,     ///< null, {}, [] or ""
  AllFalse,  ///< empty, or a mapping whose values are all false
  Disabled,  ///< empty, or a mapping whose `enabled` is false or absent (DeepSpeed's blocks default off)
  SizesAtMostOne,  ///< empty, or a mapping whose `*_size` / `*_degree` values are all 0 or 1
  Value            ///< the scalar `neutral_value` (case-insensitive)
};

struct UnsupportedKey {
  std::string file;  ///< kAccelerateYaml or kDeepSpeedJson
  std::string path;  ///< dotted, with its section
  bool refused = true;
  AsksNothingWhen asks_nothing = AsksNothingWhen::Never;
  std::string neutral_value;  ///< for AsksNothingWhen::Value
  std::string what;
  std::string instead;
};

/// The whole table: the core's rows, then each backend part's, in backends/builtin_backends.def order.
const std::vector<UnsupportedKey>& unsupported_keys();
/// The row for `path` in `file`, or nullptr.
const UnsupportedKey* find_unsupported(const std::string& file, const std::string& path);
/// Whether `value` (a YAML node; a JSON value is read as YAML) asks for nothing under `key`'s rule.
bool asks_nothing(const UnsupportedKey& key, const YAML::Node& value);
/// "<path> is not supported by accelerate-cpp: <what>; <instead>".
std::string unsupported_message(const UnsupportedKey& key);

// -----------------------------------------------------------------------------------------------------------
// Backends: each backend folder contributes one BackendPart (backends/<name>/<name>_config.cpp), listed in
// backends/builtin_backends.def. The core schema knows no backend by name.

/// Reports a validation failure for a key path ("deepspeed_config.zero_stage") with its line when known.
using FailKey = std::function<void(const std::string& key, const std::string& message)>;

struct BackendPart {
  BackendInfo info;
  /// The `distributed_type:` value to_yaml writes for a config with this backend (nullptr: the first of
  /// info.distributed_types).
  std::function<std::string(const Config&)> distributed_type;
  /// Other `distributed_type:` values read as this backend after a translation of their own (MEGATRON_LM:
  /// the zero backend at stage 0 or 1 with tensor parallelism and a pipeline); accepted and listed among the
  /// allowed values, never offered as advice or in the questionnaire.
  std::vector<std::string> mapped_distributed_types;
  /// The keys this backend owns: its section's opener (section_row) and the section's rows.
  std::vector<KeyRow> rows;
  /// Whether to_yaml writes the section in full (else `{}`): the backend is chosen or a setting differs from
  /// its default.
  std::function<bool(const Config&)> section_in_use;
  /// Settles values that depend on other keys, after the whole file has been read (may be empty).
  std::function<void(const Reader&, Config&, const Pending&)> resolve;
  /// Checks the section's settings (called for every config, whichever backend it names; may be empty).
  std::function<void(const Config&, const FailKey&)> validate;
  /// Sets the backend's settings of `config` from the estimate's input (`--zero_stage 2`), so that
  /// `estimate_memory` reads the layout from the fact sheet; throws ConfigError on a bad backend-specific
  /// field. Empty: the backend has no such field (local, ddp).
  std::function<void(const MemoryEstimateInput&, Config&)> estimate_config;
  /// Real keys of its section (and of the files it reads, such as a DeepSpeed JSON) that it does not
  /// support, as rows of the one unsupported-keys table.
  std::vector<UnsupportedKey> unsupported;
};

/// Every backend's part, in backends/builtin_backends.def order.
const std::vector<BackendPart>& backend_parts();
/// The part of the backend named `name`, or nullptr.
const BackendPart* find_part(const std::string& name);

}  // namespace accel::config_detail
