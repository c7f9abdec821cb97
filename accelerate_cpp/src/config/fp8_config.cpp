// Accelerate's fp8 settings. Accelerate's launcher turns each `fp8_config` key K into the environment
// variable ACCELERATE_FP8_K, which the recipe classes read (utils/dataclasses.py): Transformer Engine's
// delayed scaling (TE), MS-AMP (MSAMP) or torchao's float8 training (AO). A key no recipe reads has no effect
// there; here it is an error naming it, as every unknown key is, except the three that `accelerate config`
// itself writes under names its recipes never read (a notice says so).
#include "config/fp8_config.hpp"

#include "config/text_distance.hpp"

#include <algorithm>

namespace accel::config_detail {
namespace {

enum class Kind { Backend, Format, Algo, OptLevel, Boolean, NonNegative, Positive, Integer, Override };

struct Fp8Key {
  const char* name;
  Kind kind;
  const char* backend;  // the recipe that reads it ("" any)
};

const std::vector<Fp8Key>& fp8_keys() {
  static const std::vector<Fp8Key> kKeys = {
      {"backend", Kind::Backend, ""},
      {"fp8_format", Kind::Format, "TE"},
      {"amax_history_len", Kind::Positive, "TE"},
      {"amax_compute_algo", Kind::Algo, "TE"},
      {"margin", Kind::NonNegative, "TE"},
      {"interval", Kind::Integer, "TE"},
      {"override_linear_precision", Kind::Override, "TE"},
      {"use_autocast_during_eval", Kind::Boolean, "TE"},
      {"use_mxfp8_block_scaling", Kind::Boolean, "TE"},
      {"opt_level", Kind::OptLevel, "MSAMP"},
      {"enable_fsdp_float8_all_gather", Kind::Boolean, "AO"},
      {"pad_inner_dim", Kind::Boolean, "AO"},
  };
  return kKeys;
}

// Written by `accelerate config` (commands/config/cluster.py) under names no recipe reads.
struct QuestionnaireKey {
  const char* name;
  const char* read_as;
};
const std::vector<QuestionnaireKey>& questionnaire_keys() {
  static const std::vector<QuestionnaireKey> kKeys = {{"amax_history_length", "amax_history_len"},
                                                      {"amax_compute_algorithm", "amax_compute_algo"},
                                                      {"optimization_level", "opt_level"}};
  return kKeys;
}

// The values a choice key takes, as Accelerate spells them after upper- or lower-casing the file's text.
std::vector<std::string> choices(Kind kind) {
  switch (kind) {
    case Kind::Backend:
      return {"AO", "TE", "MSAMP"};
    case Kind::Format:
      return {"HYBRID", "E4M3", "E5M2"};
    case Kind::Algo:
      return {"max", "most_recent"};
    case Kind::OptLevel:
      return {"O1", "O2"};
    default:
      return {};
  }
}

// One choice value, normalised as Accelerate normalises it (backend, fp8_format upper; amax_compute_algo
// lower; opt_level as written).
std::string read_choice(const Reader& r, const Entry& e, Kind kind) {
  const std::vector<std::string> allowed = choices(kind);
  std::string text = r.scalar(e, "one of " + join(allowed));
  if (kind == Kind::Backend || kind == Kind::Format) {
    std::transform(text.begin(), text.end(), text.begin(), [](unsigned char ch) { return std::toupper(ch); });
  } else if (kind == Kind::Algo) {
    text = lower(text);
  }
  if (std::find(allowed.begin(), allowed.end(), text) != allowed.end()) return text;
  const std::optional<std::string> guess = closest(text, allowed);
  r.fail_at(e, fmt::format("{}: invalid value '{}'{}; allowed values: {} (Accelerate refuses it too)", e.path,
                           e.value.Scalar(), guess ? fmt::format(" (did you mean '{}'?)", *guess) : "",
                           join(allowed)));
}

// override_linear_precision: three booleans (fprop, dgrad, wgrad), as a list or as the text "(false, false,
// true)" that `accelerate config` writes; Transformer Engine overrides only wgrad.
void read_override(const Reader& r, const Entry& e) {
  std::vector<std::string> parts;
  if (e.value.IsSequence()) {
    for (const auto& item : e.value)
      parts.push_back(item.IsScalar() ? item.Scalar() : "?");
  } else {
    std::string text = r.scalar(e, "three booleans such as [false, false, true]");
    text.erase(
        std::remove_if(text.begin(), text.end(), [](char ch) { return ch == '(' || ch == ')' || ch == ' '; }),
        text.end());
    std::size_t start = 0;
    while (start <= text.size()) {
      const std::size_t comma = std::min(text.find(',', start), text.size());
      parts.push_back(text.substr(start, comma - start));
      start = comma + 1;
    }
  }
  std::vector<bool> flags;
  for (const std::string& part : parts) {
    const std::string t = lower(part);
    if (t != "true" && t != "false") break;
    flags.push_back(t == "true");
  }
  if (flags.size() != 3 || parts.size() != 3) {
    r.fail_at(
        e, fmt::format("{}: expected three booleans (fprop, dgrad, wgrad) such as [false, false, true], got "
                       "{}",
                       e.path, describe(e.value)));
  }
  if (flags[0] || flags[1]) {
    r.fail_at(e, fmt::format("{}: Transformer Engine runs only the wgrad GEMM in higher precision (its "
                             "DelayedScaling accepts (false, false, false) or (false, false, true)); got {}",
                             e.path, describe(e.value)));
  }
}

void check_value(const Reader& r, const Entry& e, Kind kind) {
  switch (kind) {
    case Kind::Backend:
    case Kind::Format:
    case Kind::Algo:
    case Kind::OptLevel:
      read_choice(r, e, kind);
      return;
    case Kind::Boolean:
      r.boolean(e);
      return;
    case Kind::NonNegative:
      r.integer(e, 0, 1 << 30, kNonNegativeInt);
      return;
    case Kind::Positive:
      r.integer(e, 1, 1 << 30, kPositiveInt);
      return;
    case Kind::Integer:
      r.integer(e, -(1 << 30), 1 << 30, "an integer");
      return;
    case Kind::Override:
      read_override(r, e);
      return;
  }
}

const Fp8Key* find_key(const std::string& name) {
  for (const Fp8Key& k : fp8_keys()) {
    if (name == k.name) return &k;
  }
  return nullptr;
}

void read_fp8_config(Reader& r, const Entry& section, Config& c) {
  const std::vector<Entry> entries = section_entries(r, section, "fp8");
  std::string backend;
  for (const Entry& e : entries) {
    if (e.name == "backend" && !e.value.IsNull()) backend = read_choice(r, e, Kind::Backend);
  }
  std::vector<std::string> names;
  for (const Fp8Key& k : fp8_keys())
    names.emplace_back(k.name);
  for (const Entry& e : entries) {
    const auto q = std::find_if(questionnaire_keys().begin(), questionnaire_keys().end(),
                                [&](const QuestionnaireKey& k) { return e.name == k.name; });
    if (q != questionnaire_keys().end()) {
      c.notices.push_back(
          fmt::format("{}{}: `accelerate config` writes this key, but no Accelerate recipe "
                      "reads it (they read {}): it has no effect in Accelerate either",
                      location(r.source(), e.line), e.path, q->read_as));
      continue;
    }
    const Fp8Key* key = find_key(e.name);
    if (!key) {
      const std::optional<std::string> guess = closest(e.name, names);
      r.fail_at(e, fmt::format("unknown key '{}'{}; the fp8_config keys are {}", e.path,
                               guess ? fmt::format(" (did you mean '{}'?)", *guess) : "", join(names)));
    }
    if (e.value.IsNull()) continue;
    check_value(r, e, key->kind);
    if (key->kind == Kind::Format && backend == "TE" && read_choice(r, e, Kind::Format) == "E5M2") {
      r.fail_at(e, fmt::format("{}: E5M2 with backend TE: Transformer Engine refuses pure E5M2 training "
                               "(\"Pure E5M2 training is not supported.\"); use HYBRID (E4M3 forward, E5M2 "
                               "gradients) or E4M3",
                               e.path));
    }
    if (*key->backend && !backend.empty() && backend != key->backend) {
      c.notices.push_back(fmt::format("{}{}: read only by the {} recipe; no effect with backend {}",
                                      location(r.source(), e.line), e.path, key->backend, backend));
    }
  }
}

// "backend TE, fp8_format E4M3, ...": what the file asks for, Accelerate's defaults filling the rest.
std::string recipe_summary(const Entry* section) {
  std::map<std::string, std::string> set;
  if (section && section->value.IsMap()) {
    for (const auto& pair : section->value) {
      if (pair.second.IsScalar()) set[pair.first.Scalar()] = pair.second.Scalar();
    }
  }
  auto value = [&](const char* key, const char* fallback) {
    const auto it = set.find(key);
    return it == set.end() ? std::string(fallback) : it->second;
  };
  std::string backend = value("backend", "");
  std::transform(backend.begin(), backend.end(), backend.begin(),
                 [](unsigned char ch) { return std::toupper(ch); });
  if (backend.empty() || backend == "NO")
    return "torchao's float8 training (Accelerate picks torchao first when no backend is named): tensor-wise "
           "scales, E4M3 forward, E5M2 gradients";
  if (backend == "AO")
    return "backend AO (torchao's float8 training: tensor-wise scales, E4M3 forward, E5M2 gradients)";
  if (backend == "MSAMP")
    return fmt::format("backend MSAMP (MS-AMP, opt_level {})", value("opt_level", "O2"));
  return fmt::format(
      "backend TE (Transformer Engine's delayed scaling: fp8_format {}, amax_history_len {}, "
      "amax_compute_algo {}, margin {})",
      value("fp8_format", "HYBRID"), value("amax_history_len", "1024"),
      value("amax_compute_algo", "most_recent"), value("margin", "0"));
}

}  // namespace

KeyRow fp8_config_row() {
  KeyRow row;
  row.name = "fp8_config";
  row.section = kTop;
  row.doc =
      "Accelerate's fp8 recipe (backend AO | TE | MSAMP, fp8_format, amax_history_len, amax_compute_algo, "
      "margin, ...): checked as Accelerate checks it; mixed_precision: fp8 itself is refused";
  row.read = [](Reader& r, const Entry& e, Config& c, Pending&) { read_fp8_config(r, e, c); };
  return row;
}

void resolve_fp8(const Reader& r, Config& c, const Pending& p) {
  const Entry* mixed = p.find("mixed_precision");
  const Entry* section = p.find("fp8_config");
  const bool fp8 = mixed && mixed->value.IsScalar() && lower(mixed->value.Scalar()) == "fp8";
  if (!fp8) {
    if (section && section->value.IsMap() && section->value.size() > 0) {
      c.notices.push_back(
          fmt::format("{}fp8_config has no effect without mixed_precision: fp8 (Accelerate "
                      "passes it on only then)",
                      location(r.source(), section->line)));
    }
    return;
  }
  r.fail_at(
      *mixed,
      fmt::format("mixed_precision: fp8 ({}) is not supported by accelerate-cpp yet: fp8 training needs an "
                  "fp8 matmul (LibTorch's torch._scaled_mm, on CUDA GPUs of compute capability 8.9 or "
                  "newer); a CPU has none, and accelerate-cpp's CUDA fp8 path is not built yet (its scaling "
                  "arithmetic is: accel/precision/fp8_scaling.hpp). Use mixed_precision: bf16",
                  recipe_summary(section)));
}

}  // namespace accel::config_detail
