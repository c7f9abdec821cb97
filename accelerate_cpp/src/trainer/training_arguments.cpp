// accel::TrainingArguments: HF's TrainingArguments keys read from YAML/JSON and the command line, with HF's
// defaults and __post_init__ rules, and the table of HF keys the Trainer does not implement.
#include <accel/errors.hpp>
#include <accel/trainer/training_arguments.hpp>

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
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <sstream>

namespace accel {
namespace {

// A value as read: its text (a scalar), its items (a sequence), or null.
struct Value {
  std::string text;
  std::vector<std::string> items;
  bool is_null = false;
  bool is_sequence = false;
  bool is_map = false;
  bool map_empty = true;
  std::vector<std::pair<std::string, std::string>> entries;  // a mapping's entries (scalars)
  bool map_nested = false;                                   // a mapping with a non-scalar value
};

// Where the Trainer takes what the arguments do not describe: the Trainer's own API (its names are checked
// against trainer.hpp by tests/trainer/api_names_test.cpp).
constexpr const char* kOwnOptimizer =
    "build one and give it to Trainer::set_optimizer(optimizer, schedule), the Trainer's way of Hugging "
    "Face's "
    "optimizers=(optimizer, scheduler)";
constexpr const char* kOwnSchedule =
    "build one and give it as the second argument of Trainer::set_optimizer(optimizer, schedule)";

// The optimizers and schedules the arguments can name (one list for the doc line, the check and the message).
const std::vector<std::string>& optimizer_names() {
  static const std::vector<std::string> names = {"adamw_torch",
                                                 "adamw_torch_fused",
                                                 "adamw_bnb_8bit",
                                                 "adamw_8bit",
                                                 "paged_adamw_8bit",
                                                 "paged_adamw_32bit",
                                                 "sgd",
                                                 "lamb"};
  return names;
}
const std::vector<std::string>& schedule_names() {
  static const std::vector<std::string> names = {
      "linear", "cosine", "cosine_with_min_lr", "constant", "constant_with_warmup", "polynomial"};
  return names;
}

// The keys of lr_scheduler_kwargs each schedule takes (transformers' get_scheduler passes them on).
std::vector<std::string> schedule_kwargs(const std::string& type) {
  if (type == "cosine") return {"num_cycles"};
  if (type == "cosine_with_min_lr") return {"min_lr", "min_lr_rate", "num_cycles"};
  if (type == "polynomial") return {"lr_end", "power"};
  return {};
}

// Where a value came from, for messages.
struct Where {
  std::string source;
  int line = 0;  // 1-based; 0 unknown
};

[[noreturn]] void fail(const Where& w, const std::string& key, const std::string& message) {
  const std::string at = w.line > 0 ? fmt::format("{}:{}", w.source, w.line) : w.source;
  throw ConfigError(
      detail::bounded_message(fmt::format("{}: TrainingArguments key '{}': {}", at, key, message)), w.source,
      w.line, key);
}

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
  return s;
}

bool to_bool(const Where& w, const std::string& key, const Value& v) {
  const std::string t = lower(v.text);
  if (v.is_sequence || v.is_map) fail(w, key, "expected true or false, got a list or mapping");
  if (t == "true" || t == "yes" || t == "1" || t == "y" || t == "t") return true;
  if (t == "false" || t == "no" || t == "0" || t == "n" || t == "f") return false;
  fail(w, key, fmt::format("expected true or false, got '{}'", v.text));
}

double to_double(const Where& w, const std::string& key, const Value& v) {
  if (v.is_sequence || v.is_map) fail(w, key, "expected a number, got a list or mapping");
  const char* begin = v.text.c_str();
  char* end = nullptr;
  errno = 0;
  const double x = std::strtod(begin, &end);
  if (v.text.empty() || *end != '\0' || errno == ERANGE || !std::isfinite(x))
    fail(w, key, fmt::format("expected a number, got '{}'", v.text));
  return x;
}

std::int64_t to_int(const Where& w, const std::string& key, const Value& v) {
  const double x = to_double(w, key, v);
  if (x != std::floor(x) || std::fabs(x) > 9.0e15)
    fail(w, key, fmt::format("expected a whole number, got '{}'", v.text));
  return static_cast<std::int64_t>(x);
}

int to_int32(const Where& w, const std::string& key, const Value& v) {
  const std::int64_t x = to_int(w, key, v);
  if (x > std::numeric_limits<int>::max() || x < std::numeric_limits<int>::min())
    fail(w, key, fmt::format("{} is out of range", v.text));
  return static_cast<int>(x);
}

std::string to_string(const Where& w, const std::string& key, const Value& v) {
  if (v.is_sequence || v.is_map) fail(w, key, "expected a string, got a list or mapping");
  return v.text;
}

std::string one_of(const Where& w, const std::string& key, const Value& v, const std::vector<std::string>& ok,
                   const std::string& hint = "") {
  const std::string s = to_string(w, key, v);
  if (std::find(ok.begin(), ok.end(), s) != ok.end()) return s;
  fail(w, key,
       fmt::format("'{}' is not one of {}{}", s, fmt::join(ok, ", "), hint.empty() ? "" : "; " + hint));
}

// A mapping's entries (null or an empty mapping: none).
std::vector<std::pair<std::string, std::string>> map_entries(const Where& w, const std::string& key,
                                                             const Value& v) {
  if (v.is_null || (v.is_sequence && v.items.empty())) return {};
  if (!v.is_map) fail(w, key, fmt::format("expected a mapping (e.g. {{name: value}}), got '{}'", v.text));
  if (v.map_nested) fail(w, key, "expected a mapping of names to plain values, got a nested list or mapping");
  return v.entries;
}

// One implemented key: its default (as YAML), doc, and how it is set.
struct Field {
  TrainingKey key;
  std::function<void(TrainingArguments&, const Where&, const std::string&, const Value&)> set;
};

const std::vector<Field>& fields() {
  using A = TrainingArguments;
  using W = Where;
  using S = std::string;
  using V = Value;
  static const std::vector<Field> table = {
      {{"output_dir", "trainer_output", "where checkpoints (checkpoint-<step>) and trainer_state.json go"},
       [](A& a, const W& w, const S& k, const V& v) { a.output_dir = to_string(w, k, v); }},
      {{"overwrite_output_dir", "false",
        "accepted; checkpoints in output_dir are never deleted by a new run"},
       [](A& a, const W& w, const S& k, const V& v) { a.overwrite_output_dir = to_bool(w, k, v); }},
      {{"num_train_epochs", "3.0", "epochs (fractional allowed) when max_steps <= 0"},
       [](A& a, const W& w, const S& k, const V& v) { a.num_train_epochs = to_double(w, k, v); }},
      {{"max_steps", "-1", "optimizer steps to train; > 0 overrides num_train_epochs"},
       [](A& a, const W& w, const S& k, const V& v) { a.max_steps = to_int(w, k, v); }},
      {{"per_device_train_batch_size", "8", "batch size per rank for training"},
       [](A& a, const W& w, const S& k, const V& v) { a.per_device_train_batch_size = to_int(w, k, v); }},
      {{"per_device_eval_batch_size", "8", "batch size per rank for evaluation"},
       [](A& a, const W& w, const S& k, const V& v) { a.per_device_eval_batch_size = to_int(w, k, v); }},
      {{"learning_rate", "5.0e-05", "peak learning rate"},
       [](A& a, const W& w, const S& k, const V& v) { a.learning_rate = to_double(w, k, v); }},
      {{"weight_decay", "0.0", "decoupled weight decay (not on biases and LayerNorm weights)"},
       [](A& a, const W& w, const S& k, const V& v) { a.weight_decay = to_double(w, k, v); }},
      {{"adam_beta1", "0.9", "Adam beta1"},
       [](A& a, const W& w, const S& k, const V& v) { a.adam_beta1 = to_double(w, k, v); }},
      {{"adam_beta2", "0.999", "Adam beta2"},
       [](A& a, const W& w, const S& k, const V& v) { a.adam_beta2 = to_double(w, k, v); }},
      {{"adam_epsilon", "1.0e-08", "Adam epsilon"},
       [](A& a, const W& w, const S& k, const V& v) { a.adam_epsilon = to_double(w, k, v); }},
      {{"optim", "adamw_torch", fmt::format("{}", fmt::join(optimizer_names(), " | "))},
       [](A& a, const W& w, const S& k, const V& v) {
         a.optim = one_of(w, k, v, optimizer_names(), std::string("for another optimizer ") + kOwnOptimizer);
       }},
      {{"lr_scheduler_type", "linear", fmt::format("{}", fmt::join(schedule_names(), " | "))},
       [](A& a, const W& w, const S& k, const V& v) {
         a.lr_scheduler_type =
             one_of(w, k, v, schedule_names(), std::string("for another schedule ") + kOwnSchedule);
       }},
      {{"lr_scheduler_kwargs", "{}",
        "the schedule's arguments: cosine num_cycles; cosine_with_min_lr min_lr or min_lr_rate, num_cycles; "
        "polynomial lr_end, power"},
       [](A& a, const W& w, const S& k, const V& v) {
         a.lr_scheduler_kwargs.clear();
         for (const auto& [name, text] : map_entries(w, k, v)) {
           Value item;
           item.text = text;
           a.lr_scheduler_kwargs[name] = to_double(w, k + "." + name, item);
         }
       }},
      {{"warmup_steps", "0", "warmup optimizer steps (a value below 1 is a ratio of the total, as HF 5)"},
       [](A& a, const W& w, const S& k, const V& v) {
         const double x = to_double(w, k, v);
         if (x > 0 && x < 1) {
           a.warmup_ratio = x;
           a.warmup_steps = 0;
         } else {
           a.warmup_steps = to_int(w, k, v);
         }
       }},
      {{"warmup_ratio", "0.0", "warmup as a fraction of the optimizer steps (when warmup_steps is 0)"},
       [](A& a, const W& w, const S& k, const V& v) { a.warmup_ratio = to_double(w, k, v); }},
      {{"gradient_accumulation_steps", "1", "micro-batches per optimizer step"},
       [](A& a, const W& w, const S& k, const V& v) { a.gradient_accumulation_steps = to_int32(w, k, v); }},
      {{"average_tokens_across_devices", "true",
        "a loss summed over label tokens is divided by every rank's label tokens of the window (false: each "
        "rank's own, the ranks then averaged)"},
       [](A& a, const W& w, const S& k, const V& v) { a.average_tokens_across_devices = to_bool(w, k, v); }},
      {{"max_grad_norm", "1.0", "gradient clipping norm; 0 disables"},
       [](A& a, const W& w, const S& k, const V& v) { a.max_grad_norm = to_double(w, k, v); }},
      {{"bf16", "false", "bf16 mixed precision"},
       [](A& a, const W& w, const S& k, const V& v) { a.bf16 = to_bool(w, k, v); }},
      {{"fp16", "false", "fp16 mixed precision with loss scaling"},
       [](A& a, const W& w, const S& k, const V& v) { a.fp16 = to_bool(w, k, v); }},
      {{"gradient_checkpointing", "false", "activation checkpointing of the model's blocks"},
       [](A& a, const W& w, const S& k, const V& v) { a.gradient_checkpointing = to_bool(w, k, v); }},
      {{"gradient_checkpointing_kwargs", "{}",
        "use_reentrant (true or false: the same gradients, one mechanism here), preserve_rng_state"},
       [](A& a, const W& w, const S& k, const V& v) {
         a.gradient_checkpointing_kwargs.clear();
         for (const auto& [name, text] : map_entries(w, k, v)) {
           if (name != "use_reentrant" && name != "preserve_rng_state")
             fail(w, k,
                  fmt::format("'{}' is not an argument accel::checkpoint takes (use_reentrant, "
                              "preserve_rng_state); remove it",
                              name));
           Value item;
           item.text = text;
           a.gradient_checkpointing_kwargs[name] = to_bool(w, k + "." + name, item);
         }
       }},
      {{"logging_dir", "null", "where trackers write (default <output_dir>/runs)"},
       [](A& a, const W& w, const S& k, const V& v) { a.logging_dir = v.is_null ? "" : to_string(w, k, v); }},
      {{"logging_strategy", "steps", "no | steps | epoch"},
       [](A& a, const W& w, const S& k, const V& v) {
         a.logging_strategy = one_of(w, k, v, {"no", "steps", "epoch"});
       }},
      {{"logging_steps", "500", "log every this many optimizer steps (below 1: a ratio of the total)"},
       [](A& a, const W& w, const S& k, const V& v) { a.logging_steps = to_double(w, k, v); }},
      {{"logging_first_step", "false", "also log after the first optimizer step"},
       [](A& a, const W& w, const S& k, const V& v) { a.logging_first_step = to_bool(w, k, v); }},
      {{"logging_nan_inf_filter", "true", "leave non-finite losses out of the logged mean"},
       [](A& a, const W& w, const S& k, const V& v) { a.logging_nan_inf_filter = to_bool(w, k, v); }},
      {{"eval_strategy", "no", "no | steps | epoch"},
       [](A& a, const W& w, const S& k, const V& v) {
         a.eval_strategy = one_of(w, k, v, {"no", "steps", "epoch"});
       }},
      {{"eval_steps", "null", "evaluate every this many optimizer steps (default logging_steps)"},
       [](A& a, const W& w, const S& k, const V& v) {
         a.eval_steps = v.is_null ? std::nullopt : std::optional<double>(to_double(w, k, v));
       }},
      {{"save_strategy", "steps", "no | steps | epoch | best (at each evaluation that sets a new best)"},
       [](A& a, const W& w, const S& k, const V& v) {
         a.save_strategy = one_of(w, k, v, {"no", "steps", "epoch", "best"}, "");
       }},
      {{"save_steps", "500", "save a checkpoint every this many optimizer steps"},
       [](A& a, const W& w, const S& k, const V& v) { a.save_steps = to_double(w, k, v); }},
      {{"save_total_limit", "null", "keep at most this many checkpoints (the newest, plus the best)"},
       [](A& a, const W& w, const S& k, const V& v) {
         a.save_total_limit = v.is_null ? std::nullopt : std::optional<int>(to_int32(w, k, v));
       }},
      {{"save_only_model", "false", "checkpoints hold the model only; they cannot be resumed from"},
       [](A& a, const W& w, const S& k, const V& v) { a.save_only_model = to_bool(w, k, v); }},
      {{"load_best_model_at_end", "false", "load the best checkpoint's state when training ends"},
       [](A& a, const W& w, const S& k, const V& v) { a.load_best_model_at_end = to_bool(w, k, v); }},
      {{"metric_for_best_model", "null", "the evaluation metric that ranks checkpoints (default loss)"},
       [](A& a, const W& w, const S& k, const V& v) {
         a.metric_for_best_model = v.is_null ? std::nullopt : std::optional<std::string>(to_string(w, k, v));
       }},
      {{"greater_is_better", "null", "whether a larger metric is better (default: false for a loss)"},
       [](A& a, const W& w, const S& k, const V& v) {
         a.greater_is_better = v.is_null ? std::nullopt : std::optional<bool>(to_bool(w, k, v));
       }},
      {{"report_to", "none", "trackers: tensorboard, jsonl, csv, all or none (a list or one name)"},
       [](A& a, const W& w, const S& k, const V& v) {
         if (v.is_map) fail(w, k, "expected a tracker name or a list of them");
         a.report_to = v.is_sequence ? v.items : std::vector<std::string>{v.is_null ? "none" : v.text};
         if (a.report_to.empty()) a.report_to = {"none"};
       }},
      {{"run_name", "null", "the run's name in trackers"},
       [](A& a, const W& w, const S& k,
          const V&
              v) { a.run_name = v.is_null ? std::nullopt : std::optional<std::string>(to_string(w, k, v)); }},
      {{"seed", "42", "seed set before training (model init happens before: seed it yourself too)"},
       [](A& a, const W& w, const S& k, const V& v) {
         const auto x = to_int(w, k, v);
         if (x < 0) fail(w, k, fmt::format("a seed is not negative, got {}", x));
         a.seed = static_cast<std::uint64_t>(x);
       }},
      {{"data_seed", "null", "seed of the data shuffling (default seed)"},
       [](A& a, const W& w, const S& k, const V& v) {
         if (v.is_null) {
           a.data_seed.reset();
           return;
         }
         const auto x = to_int(w, k, v);
         if (x < 0) fail(w, k, fmt::format("a seed is not negative, got {}", x));
         a.data_seed = static_cast<std::uint64_t>(x);
       }},
      {{"resume_from_checkpoint", "null", "a checkpoint directory, or latest (the newest in output_dir)"},
       [](A& a, const W& w, const S& k, const V& v) {
         a.resume_from_checkpoint = v.is_null ? std::nullopt : std::optional<std::string>(to_string(w, k, v));
       }},
      {{"dataloader_num_workers", "0", "background threads building batches"},
       [](A& a, const W& w, const S& k, const V& v) { a.dataloader_num_workers = to_int32(w, k, v); }},
      {{"dataloader_drop_last", "false", "drop the last incomplete batch"},
       [](A& a, const W& w, const S& k, const V& v) { a.dataloader_drop_last = to_bool(w, k, v); }},
      {{"dataloader_pin_memory", "true", "batches in page-locked memory on a GPU (no effect on the CPU)"},
       [](A& a, const W& w, const S& k, const V& v) { a.dataloader_pin_memory = to_bool(w, k, v); }},
      {{"disable_tqdm", "false", "no progress bar"},
       [](A& a, const W& w, const S& k, const V& v) { a.disable_tqdm = to_bool(w, k, v); }},
      {{"nonfinite_loss", "skip", "accelerate-cpp: skip (drop that step's update) or stop on a NaN/Inf loss"},
       [](A& a, const W& w, const S& k, const V& v) {
         a.nonfinite_loss = one_of(w, k, v, {"skip", "stop"});
       }},
  };
  return table;
}

// Older HF names of implemented keys.
const std::vector<std::pair<std::string, std::string>>& aliases() {
  static const std::vector<std::pair<std::string, std::string>> table = {
      {"evaluation_strategy", "eval_strategy"}};
  return table;
}

const Field* find_field(const std::string& key) {
  std::string name = key;
  for (const auto& [old, now] : aliases())
    if (key == old) name = now;
  for (const Field& f : fields())
    if (f.key.name == name) return &f;
  return nullptr;
}

const UnsupportedTrainingKey* find_unsupported(const std::string& key) {
  for (const auto& u : unsupported_training_keys())
    if (u.name == key) return &u;
  return nullptr;
}

std::vector<std::string> all_names() {
  std::vector<std::string> names;
  for (const Field& f : fields())
    names.push_back(f.key.name);
  for (const auto& u : unsupported_training_keys())
    names.push_back(u.name);
  return names;
}

// Whether `v` is what `accepted` describes: "null", "empty", a scalar's text, or "a|b" alternatives.
bool accepted_value(const Value& v, const std::string& accepted) {
  if (v.is_null || accepted == "any") return true;
  if ((v.is_sequence && v.items.empty()) || (v.is_map && v.map_empty)) return true;
  if (v.is_sequence || v.is_map) return false;
  std::stringstream alternatives(accepted);
  for (std::string a; std::getline(alternatives, a, '|');) {
    if (a == "empty" && v.text.empty()) return true;
    if (lower(a) == lower(v.text)) return true;
    char* end = nullptr;
    const double x = std::strtod(v.text.c_str(), &end);
    char* end2 = nullptr;
    const double y = std::strtod(a.c_str(), &end2);
    if (!v.text.empty() && *end == '\0' && !a.empty() && *end2 == '\0' && x == y) return true;
  }
  return false;
}

void apply(TrainingArguments& a, const std::string& key, const Value& v, const Where& w) {
  if (const Field* f = find_field(key)) {
    f->set(a, w, key, v);
    if (std::find(a.explicit_keys.begin(), a.explicit_keys.end(), f->key.name) == a.explicit_keys.end())
      a.explicit_keys.push_back(f->key.name);
    return;
  }
  if (const UnsupportedTrainingKey* u = find_unsupported(key)) {
    if (u->ignored) {
      if (!accepted_value(v, u->accepted_when))
        a.notices.push_back(
            fmt::format("{}: TrainingArguments key '{}' is ignored ({})", w.source, key, u->instead));
      return;
    }
    if (accepted_value(v, u->accepted_when)) return;
    fail(w, key,
         fmt::format("{} is not supported by accel::Trainer (accepted: {}); {}",
                     v.is_sequence ? "a list" : (v.is_map ? "a mapping" : "'" + v.text + "'"),
                     u->accepted_when, u->instead));
  }
  const auto guess = detail::closest(key, all_names());
  fail(w, key,
       fmt::format("unknown key{}; the keys are those of Hugging Face's TrainingArguments "
                   "(accel-cpp implements: see docs/trainer.md)",
                   guess ? fmt::format(" (did you mean '{}'?)", *guess) : ""));
}

Value value_of(const YAML::Node& node) {
  Value v;
  if (node.IsNull()) {
    v.is_null = true;
  } else if (node.IsScalar()) {
    v.text = node.Scalar();
    // An unquoted null spelling; a quoted "null" is the string.
    if (node.Tag() != "!" && (v.text == "null" || v.text == "~" || v.text == "None" || v.text == "Null"))
      v.is_null = true;
  } else if (node.IsSequence()) {
    v.is_sequence = true;
    for (const auto& item : node)
      v.items.push_back(item.IsScalar() ? item.Scalar() : "");
  } else if (node.IsMap()) {
    v.is_map = true;
    v.map_empty = node.size() == 0;
    for (const auto& entry : node) {
      if (!entry.first.IsScalar() || !entry.second.IsScalar()) {
        v.map_nested = true;
        continue;
      }
      v.entries.emplace_back(entry.first.Scalar(), entry.second.Scalar());
    }
  }
  return v;
}

// A value from the command line: "null"/"None" is null, "[a, b]" or "a,b" for report_to is a list.
Value value_of_text(const std::string& key, const std::string& text) {
  // A mapping given as JSON on the command line, as HF's parser takes it: --lr_scheduler_kwargs '{"min_lr":
  // 1e-5}'
  if (!text.empty() && text.front() == '{') {
    try {
      const YAML::Node node = YAML::Load(text);
      if (node.IsMap()) return value_of(node);
    } catch (const YAML::Exception&) {
    }
    throw ConfigError(fmt::format("command line: --{} '{}' is not a JSON or YAML mapping", key, text),
                      "command line", 0, key);
  }
  Value v;
  v.text = text;
  v.is_null = text == "null" || text == "None";
  if (key == "report_to" && !v.is_null) {
    std::string t = text;
    if (!t.empty() && t.front() == '[' && t.back() == ']') t = t.substr(1, t.size() - 2);
    std::stringstream ss(t);
    for (std::string item; std::getline(ss, item, ',');) {
      item.erase(0, item.find_first_not_of(" \"'"));
      item.erase(item.find_last_not_of(" \"'") + 1);
      if (!item.empty()) v.items.push_back(item);
    }
    v.is_sequence = true;
  }
  return v;
}

// transformers' get_scheduler passes lr_scheduler_kwargs to the schedule's function, which refuses an
// argument it does not take; get_cosine_with_min_lr_schedule_with_warmup wants exactly one of min_lr and
// min_lr_rate.
void validate_schedule_kwargs(const TrainingArguments& a, const Where& w) {
  const auto allowed = schedule_kwargs(a.lr_scheduler_type);
  for (const auto& [name, value] : a.lr_scheduler_kwargs) {
    if (std::find(allowed.begin(), allowed.end(), name) != allowed.end()) continue;
    fail(w, "lr_scheduler_kwargs",
         fmt::format("'{}' is not an argument of lr_scheduler_type {} (it takes {})", name,
                     a.lr_scheduler_type,
                     allowed.empty() ? std::string("none") : fmt::format("{}", fmt::join(allowed, ", "))));
  }
  if (a.lr_scheduler_type != "cosine_with_min_lr") return;
  const bool lr = a.lr_scheduler_kwargs.count("min_lr") > 0,
             rate = a.lr_scheduler_kwargs.count("min_lr_rate") > 0;
  if (lr == rate)
    fail(w, "lr_scheduler_kwargs",
         lr ? "set one of min_lr and min_lr_rate, not both (as transformers' "
              "get_cosine_with_min_lr_schedule_with_warmup)"
            : "lr_scheduler_type cosine_with_min_lr needs min_lr or min_lr_rate in lr_scheduler_kwargs, e.g. "
              "lr_scheduler_kwargs: {min_lr_rate: 0.1}");
  if (rate && !(a.lr_scheduler_kwargs.at("min_lr_rate") >= 0 && a.lr_scheduler_kwargs.at("min_lr_rate") <= 1))
    fail(w, "lr_scheduler_kwargs",
         fmt::format("min_lr_rate must be in [0, 1], got {}", a.lr_scheduler_kwargs.at("min_lr_rate")));
  if (lr && a.lr_scheduler_kwargs.at("min_lr") < 0)
    fail(w, "lr_scheduler_kwargs",
         fmt::format("min_lr must not be negative, got {}", a.lr_scheduler_kwargs.at("min_lr")));
}

bool positive_steps(double x) {
  return x > 0;
}

std::string yaml_scalar(double x) {
  return fmt::format("{}", x);
}

}  // namespace

bool TrainingArguments::is_explicit(const std::string& key) const {
  return std::find(explicit_keys.begin(), explicit_keys.end(), key) != explicit_keys.end();
}

const std::vector<TrainingKey>& TrainingArguments::keys() {
  static const std::vector<TrainingKey> out = [] {
    std::vector<TrainingKey> k;
    for (const Field& f : fields())
      k.push_back(f.key);
    return k;
  }();
  return out;
}

TrainingArguments TrainingArguments::load_string(const std::string& text, const std::string& source) {
  // yaml-cpp would read a file with a NUL byte (UTF-16, binary) as empty: all defaults, silently.
  if (const auto problem = config_detail::encoding_problem(text)) {
    throw ConfigError(fmt::format("{}:{}: {}", source, problem->first, problem->second), source,
                      problem->first);
  }
  YAML::Node root;
  try {
    root = YAML::Load(text);
  } catch (const YAML::Exception& e) {
    throw ConfigError(detail::bounded_message(
                          fmt::format("{}:{}: not valid YAML or JSON: {}", source, e.mark.line + 1, e.msg)),
                      source, e.mark.line + 1);
  }
  TrainingArguments a;
  a.source = source;
  if (root.IsNull()) return a;
  if (!root.IsMap()) {
    throw ConfigError(fmt::format("{}: a TrainingArguments file is a mapping of keys to values (as HF's "
                                  "training_args.json), got {}",
                                  source, root.IsSequence() ? "a list" : "a single value"),
                      source);
  }
  for (const auto& entry : root) {
    const Where w{source, entry.first.Mark().line + 1};
    if (!entry.first.IsScalar()) fail(w, "?", "a key must be a plain name");
    apply(a, entry.first.Scalar(), value_of(entry.second), w);
  }
  return a;
}

TrainingArguments TrainingArguments::load_file(const std::string& path) {
  const auto file = config_detail::read_small_file(path, std::size_t{4} << 20);
  if (file.too_large)
    throw ConfigError(
        fmt::format("training arguments '{}' are larger than 4 MiB: not a TrainingArguments file", path),
        path);
  if (!file.error.empty())
    throw ConfigError(fmt::format("cannot open training arguments '{}': {}", path, file.error), path);
  return load_string(file.text, path);
}

void TrainingArguments::set(const std::string& key, const std::string& value, const std::string& where) {
  apply(*this, key, value_of_text(key, value), Where{where, 0});
}

TrainingArguments TrainingArguments::from_command_line(int argc, const char* const* argv,
                                                       std::vector<std::string>* remaining) {
  std::vector<std::string> args(argv + (argc > 0 ? 1 : 0), argv + argc);
  TrainingArguments a;
  // The file first, wherever it is on the line.
  if (const auto file =
          config_detail::take_file_option(args, "training_args", "YAML or HF's training_args.json"))
    a = load_file(*file);
  const std::string source = a.source.empty() ? "command line" : "command line (over " + a.source + ")";
  for (std::size_t i = 0; i < args.size(); ++i) {
    const std::string& arg = args[i];
    if (arg.rfind("--", 0) != 0 || arg.size() == 2) {
      if (remaining == nullptr)
        throw ConfigError(fmt::format("command line: unexpected argument '{}' (expected --key value)", arg));
      remaining->push_back(arg);
      continue;
    }
    std::string key = arg.substr(2), value;
    bool has_value = false;
    if (const auto eq = key.find('='); eq != std::string::npos) {
      value = key.substr(eq + 1);
      key = key.substr(0, eq);
      has_value = true;
    }
    std::string name = key;
    std::replace(name.begin(), name.end(), '-', '_');
    const Field* f = find_field(name);
    if (f == nullptr && find_unsupported(name) == nullptr) {
      const auto guess = detail::closest(name, all_names());
      if (remaining != nullptr && !(guess && detail::edit_distance(name, *guess) <= 2)) {
        remaining->push_back(arg);
        continue;
      }
      throw ConfigError(fmt::format("command line: unknown TrainingArguments option '--{}'{}", key,
                                    guess ? fmt::format(" (did you mean '--{}'?)", *guess) : ""),
                        "command line", 0, name);
    }
    if (!has_value) {
      // A bool flag alone means true (HF's `--bf16`); otherwise the next argument is the value.
      const bool boolean = f != nullptr && f->key.default_value == "false" &&
                           (i + 1 >= args.size() || args[i + 1].rfind("--", 0) == 0);
      if (boolean) {
        value = "true";
      } else {
        if (i + 1 >= args.size())
          throw ConfigError(fmt::format("command line: --{} needs a value", key), "command line", 0, name);
        value = args[++i];
      }
    }
    a.set(name, value, source);
  }
  if (a.source.empty()) a.source = "command line";
  return a;
}

void TrainingArguments::validate() {
  const Where w{source.empty() ? "TrainingArguments" : source, 0};
  if (output_dir.empty()) fail(w, "output_dir", "must not be empty");
  if (per_device_train_batch_size <= 0)
    fail(w, "per_device_train_batch_size",
         fmt::format("must be positive, got {}", per_device_train_batch_size));
  if (per_device_eval_batch_size <= 0)
    fail(w, "per_device_eval_batch_size",
         fmt::format("must be positive, got {}", per_device_eval_batch_size));
  if (gradient_accumulation_steps < 1)
    fail(w, "gradient_accumulation_steps",
         fmt::format("must be at least 1, got {}", gradient_accumulation_steps));
  if (max_steps <= 0 && !(num_train_epochs > 0))
    fail(w, "num_train_epochs",
         fmt::format("must be positive when max_steps is not set, got {}", yaml_scalar(num_train_epochs)));
  if (learning_rate < 0) fail(w, "learning_rate", fmt::format("must not be negative, got {}", learning_rate));
  if (weight_decay < 0) fail(w, "weight_decay", fmt::format("must not be negative, got {}", weight_decay));
  if (max_grad_norm < 0)
    fail(w, "max_grad_norm",
         fmt::format("must not be negative (0 disables clipping), got {}", max_grad_norm));
  if (adam_beta1 < 0 || adam_beta1 >= 1)
    fail(w, "adam_beta1", fmt::format("must be in [0, 1), got {}", adam_beta1));
  if (adam_beta2 < 0 || adam_beta2 >= 1)
    fail(w, "adam_beta2", fmt::format("must be in [0, 1), got {}", adam_beta2));
  if (!(adam_epsilon > 0)) fail(w, "adam_epsilon", fmt::format("must be positive, got {}", adam_epsilon));
  if (warmup_ratio < 0 || warmup_ratio > 1)
    fail(w, "warmup_ratio", fmt::format("must be in [0, 1], got {}", warmup_ratio));
  if (warmup_steps < 0) fail(w, "warmup_steps", fmt::format("must not be negative, got {}", warmup_steps));
  if (bf16 && fp16) fail(w, "fp16", "fp16 and bf16 are both true: choose one");
  validate_schedule_kwargs(*this, w);
  if (logging_strategy == "steps" && !positive_steps(logging_steps))
    fail(w, "logging_steps",
         fmt::format("must be positive with logging_strategy steps, got {}", logging_steps));
  if (!eval_steps) eval_steps = logging_steps;  // HF: eval_steps defaults to logging_steps
  if (eval_strategy == "steps" && !positive_steps(*eval_steps))
    fail(w, "eval_steps", fmt::format("must be positive with eval_strategy steps, got {}", *eval_steps));
  if (save_strategy == "steps" && !positive_steps(save_steps))
    fail(w, "save_steps", fmt::format("must be positive with save_strategy steps, got {}", save_steps));
  if (save_total_limit && *save_total_limit < 0)
    fail(w, "save_total_limit",
         fmt::format("must not be negative (null keeps all), got {}", *save_total_limit));
  if (dataloader_num_workers < 0)
    fail(w, "dataloader_num_workers", fmt::format("must not be negative, got {}", dataloader_num_workers));
  if (load_best_model_at_end) {
    if (eval_strategy == "no")
      fail(w, "load_best_model_at_end", "needs evaluation: set eval_strategy to steps or epoch");
    // HF: save_strategy best saves at evaluations, whatever eval_strategy is.
    if (save_strategy != "best" && save_strategy != eval_strategy)
      fail(
          w, "load_best_model_at_end",
          fmt::format("needs save_strategy to match eval_strategy, got save_strategy {} and eval_strategy {}",
                      save_strategy, eval_strategy));
    if (eval_strategy == "steps" && save_strategy != "best") {
      const bool ratios = *eval_steps < 1 && save_steps < 1;
      const double q = save_steps / *eval_steps;
      if ((!ratios && (save_steps < 1) != (*eval_steps < 1)) || std::fabs(q - std::round(q)) > 1e-9)
        fail(w, "save_steps",
             fmt::format(
                 "must be a round multiple of eval_steps with load_best_model_at_end, got save_steps {} "
                 "and eval_steps {}",
                 save_steps, *eval_steps));
    }
    if (save_only_model)
      fail(w, "save_only_model",
           "cannot be combined with load_best_model_at_end in accel::Trainer (the best "
           "checkpoint is loaded with load_state); set one of them to false");
    if (!metric_for_best_model) metric_for_best_model = "loss";
  }
  if (save_strategy == "best") {
    if (!metric_for_best_model)
      fail(w, "metric_for_best_model",
           "must be set with save_strategy best (a checkpoint is saved when this evaluation metric reaches a "
           "new best), as HF's Trainer requires");
    if (eval_strategy == "no")
      fail(w, "save_strategy", "best saves at evaluations: set eval_strategy to steps or epoch");
  }
  if (metric_for_best_model && !greater_is_better) {  // HF: greater unless the name ends with "loss"
    const std::string& m = *metric_for_best_model;
    greater_is_better = !(m.size() >= 4 && m.compare(m.size() - 4, 4, "loss") == 0);
  }
  if (logging_dir.empty()) logging_dir = (std::filesystem::path(output_dir) / "runs").string();
  for (const auto& name : report_to) {
    static const std::vector<std::string> known = {"none", "all", "tensorboard", "jsonl", "csv"};
    if (std::find(known.begin(), known.end(), name) == known.end())
      fail(w, "report_to",
           fmt::format("'{}' is not a tracker accelerate-cpp has (tensorboard, jsonl, csv, all, none); "
                       "wandb and the other Python integrations are not available in C++",
                       name));
  }
}

std::string TrainingArguments::to_yaml() const {
  YAML::Emitter out;
  out << YAML::BeginMap;
  auto opt_str = [&](const char* k, const std::optional<std::string>& v) {
    out << YAML::Key << k << YAML::Value;
    if (v) {
      out << *v;
    } else {
      out << YAML::Null;
    }
  };
  out << YAML::Key << "output_dir" << YAML::Value << output_dir;
  out << YAML::Key << "overwrite_output_dir" << YAML::Value << overwrite_output_dir;
  out << YAML::Key << "num_train_epochs" << YAML::Value << num_train_epochs;
  out << YAML::Key << "max_steps" << YAML::Value << max_steps;
  out << YAML::Key << "per_device_train_batch_size" << YAML::Value << per_device_train_batch_size;
  out << YAML::Key << "per_device_eval_batch_size" << YAML::Value << per_device_eval_batch_size;
  out << YAML::Key << "learning_rate" << YAML::Value << learning_rate;
  out << YAML::Key << "weight_decay" << YAML::Value << weight_decay;
  out << YAML::Key << "adam_beta1" << YAML::Value << adam_beta1;
  out << YAML::Key << "adam_beta2" << YAML::Value << adam_beta2;
  out << YAML::Key << "adam_epsilon" << YAML::Value << adam_epsilon;
  out << YAML::Key << "optim" << YAML::Value << optim;
  out << YAML::Key << "lr_scheduler_type" << YAML::Value << lr_scheduler_type;
  out << YAML::Key << "lr_scheduler_kwargs" << YAML::Value << YAML::Flow << YAML::BeginMap;
  for (const auto& [k, v] : lr_scheduler_kwargs)
    out << YAML::Key << k << YAML::Value << v;
  out << YAML::EndMap;
  out << YAML::Key << "warmup_steps" << YAML::Value << warmup_steps;
  out << YAML::Key << "warmup_ratio" << YAML::Value << warmup_ratio;
  out << YAML::Key << "gradient_accumulation_steps" << YAML::Value << gradient_accumulation_steps;
  out << YAML::Key << "average_tokens_across_devices" << YAML::Value << average_tokens_across_devices;
  out << YAML::Key << "max_grad_norm" << YAML::Value << max_grad_norm;
  out << YAML::Key << "bf16" << YAML::Value << bf16;
  out << YAML::Key << "fp16" << YAML::Value << fp16;
  out << YAML::Key << "gradient_checkpointing" << YAML::Value << gradient_checkpointing;
  out << YAML::Key << "gradient_checkpointing_kwargs" << YAML::Value << YAML::Flow << YAML::BeginMap;
  for (const auto& [k, v] : gradient_checkpointing_kwargs)
    out << YAML::Key << k << YAML::Value << v;
  out << YAML::EndMap;
  opt_str("logging_dir", logging_dir.empty() ? std::nullopt : std::optional<std::string>(logging_dir));
  out << YAML::Key << "logging_strategy" << YAML::Value << logging_strategy;
  out << YAML::Key << "logging_steps" << YAML::Value << logging_steps;
  out << YAML::Key << "logging_first_step" << YAML::Value << logging_first_step;
  out << YAML::Key << "logging_nan_inf_filter" << YAML::Value << logging_nan_inf_filter;
  out << YAML::Key << "eval_strategy" << YAML::Value << eval_strategy;
  out << YAML::Key << "eval_steps" << YAML::Value;
  if (eval_steps) {
    out << *eval_steps;
  } else {
    out << YAML::Null;
  }
  out << YAML::Key << "save_strategy" << YAML::Value << save_strategy;
  out << YAML::Key << "save_steps" << YAML::Value << save_steps;
  out << YAML::Key << "save_total_limit" << YAML::Value;
  if (save_total_limit) {
    out << *save_total_limit;
  } else {
    out << YAML::Null;
  }
  out << YAML::Key << "save_only_model" << YAML::Value << save_only_model;
  out << YAML::Key << "load_best_model_at_end" << YAML::Value << load_best_model_at_end;
  opt_str("metric_for_best_model", metric_for_best_model);
  out << YAML::Key << "greater_is_better" << YAML::Value;
  if (greater_is_better) {
    out << *greater_is_better;
  } else {
    out << YAML::Null;
  }
  out << YAML::Key << "report_to" << YAML::Value << YAML::Flow << report_to;
  opt_str("run_name", run_name);
  out << YAML::Key << "seed" << YAML::Value << seed;
  out << YAML::Key << "data_seed" << YAML::Value;
  if (data_seed) {
    out << *data_seed;
  } else {
    out << YAML::Null;
  }
  opt_str("resume_from_checkpoint", resume_from_checkpoint);
  out << YAML::Key << "dataloader_num_workers" << YAML::Value << dataloader_num_workers;
  out << YAML::Key << "dataloader_drop_last" << YAML::Value << dataloader_drop_last;
  out << YAML::Key << "dataloader_pin_memory" << YAML::Value << dataloader_pin_memory;
  out << YAML::Key << "disable_tqdm" << YAML::Value << disable_tqdm;
  out << YAML::Key << "nonfinite_loss" << YAML::Value << nonfinite_loss;
  out << YAML::EndMap;
  return std::string(out.c_str()) + "\n";
}

std::string TrainingArguments::to_json() const {
  // YAML's flow style with double-quoted strings is JSON for these value types.
  YAML::Node node = YAML::Load(to_yaml());
  YAML::Emitter out;
  out << YAML::DoubleQuoted << YAML::Flow << node;
  return std::string(out.c_str()) + "\n";
}

const std::vector<UnsupportedTrainingKey>& unsupported_training_keys() {
  // HF TrainingArguments keys (transformers 4.4x-4.5x) with HF's default. `ignored` keys never change the
  // numbers of a run (Hub upload, Python logging, memory reports); the others are refused unless default.
  static const std::vector<UnsupportedTrainingKey> table = {
      {"do_train", "true|false", true, "the program decides what it runs"},
      {"do_eval", "true|false", true, "the program decides what it runs"},
      {"do_predict", "true|false", true, "the program decides what it runs"},
      {"local_rank", "any", true, "the rank comes from the launcher's RANK/LOCAL_RANK"},
      {"log_level", "passive", true, "Python logging"},
      {"log_level_replica", "warning", true, "Python logging"},
      {"log_on_each_node", "true", true, "Python logging"},
      {"skip_memory_metrics", "true", true, "memory reports: use Accelerator::memory_report"},
      {"push_to_hub", "false", false, "uploading to the Hugging Face Hub is not available; remove it"},
      {"hub_model_id", "null", true, "Hub upload is not available"},
      {"hub_strategy", "every_save", true, "Hub upload is not available"},
      {"hub_token", "<HUB_TOKEN>", true, "Hub upload is not available"},
      {"hub_private_repo", "null", true, "Hub upload is not available"},
      {"hub_always_push", "false", true, "Hub upload is not available"},
      {"hub_revision", "null", true, "Hub upload is not available"},
      {"push_to_hub_model_id", "null", true, "Hub upload is not available"},
      {"push_to_hub_organization", "null", true, "Hub upload is not available"},
      {"push_to_hub_token", "<PUSH_TO_HUB_TOKEN>", true, "Hub upload is not available"},
      {"project", "huggingface", true, "trackio project name"},
      {"trackio_space_id", "trackio", true, "trackio is not available"},
      {"remove_unused_columns", "true", true, "Python datasets only"},
      {"label_names", "null", true, "Python datasets only: compute_loss reads the batch"},
      {"length_column_name", "length", true, "Python datasets only"},
      {"dataloader_persistent_workers", "false|true", true, "loader threads persist"},
      {"dataloader_prefetch_factor", "null", true, "workers build dataloader_num_workers batches ahead"},
      {"save_safetensors", "true", true, "checkpoints are accelerate-cpp's format; export with save_model"},
      {"save_on_each_node", "false", false, "checkpoints are written to one shared directory; remove it"},
      {"ddp_timeout", "1800", true, "set collective_timeout_seconds in the Accelerate config"},
      {"ddp_backend", "null", false, "the backend comes from the Accelerate config; remove it"},
      {"ddp_find_unused_parameters", "null", false,
       "set ddp_find_unused_parameters in the Accelerate config"},
      {"ddp_bucket_cap_mb", "null", false, "set ddp_bucket_cap_mb in the Accelerate config"},
      {"ddp_broadcast_buffers", "null", false, "set ddp_broadcast_buffers in the Accelerate config"},
      {"deepspeed", "null", false,
       "give the DeepSpeed JSON as deepspeed_config_file in the Accelerate config"},
      {"fsdp", "empty", false, "choose FSDP in the Accelerate config (backend: fsdp)"},
      {"fsdp_config", "empty", true, "FSDP settings come from the Accelerate config"},
      {"fsdp_min_num_params", "0", false, "set fsdp_min_num_params in the Accelerate config"},
      {"fsdp_transformer_layer_cls_to_wrap", "null", false, "set it in the Accelerate config's fsdp_config"},
      {"accelerator_config", "empty", true, "Accelerator settings come from the Accelerate config"},
      {"parallelism_config", "null", false, "set parallelism in the Accelerate config"},
      {"use_cpu", "false", false, "set use_cpu in the Accelerate config or pass --cpu to accel-launch"},
      {"no_cuda", "false", false, "set use_cpu in the Accelerate config or pass --cpu to accel-launch"},
      {"use_mps_device", "false", false, "MPS is not available"},
      {"use_ipex", "false", false, "IPEX is not available"},
      {"bf16_full_eval", "false", false, "evaluation runs in the training precision; remove it"},
      {"fp16_full_eval", "false", false, "evaluation runs in the training precision; remove it"},
      {"fp16_opt_level", "O1", true, "apex only"},
      {"fp16_backend", "auto", true, "loss scaling is built in"},
      {"half_precision_backend", "auto", true, "loss scaling is built in"},
      {"tf32", "null|false", false, "TF32 is not switched by the Trainer; remove it"},
      {"jit_mode_eval", "false", false, "not available"},
      {"torch_compile", "false", false, "torch.compile is Python-only; remove it"},
      {"torch_compile_backend", "null", false, "torch.compile is Python-only; remove it"},
      {"torch_compile_mode", "null", false, "torch.compile is Python-only; remove it"},
      {"torchdynamo", "null", false, "torch.compile is Python-only; remove it"},
      {"torch_empty_cache_steps", "null", false,
       "not available; call Accelerator::free_memory in a callback"},
      {"tpu_num_cores", "null", false, "TPUs are not available"},
      {"tpu_metrics_debug", "false", false, "TPUs are not available"},
      {"debug", "empty", false, "not available; remove it"},
      {"past_index", "-1", false, "not available; remove it"},
      {"adafactor", "false", false,
       fmt::format("Adafactor is not available: optim {}", fmt::join(optimizer_names(), ", "))},
      {"optim_args", "null|empty", false, std::string("optimizer arguments: ") + kOwnOptimizer},
      {"optim_target_modules", "null", false, "GaLore is not available"},
      {"group_by_length", "false", false, "not available; order the dataset yourself"},
      {"label_smoothing_factor", "0.0", false, "apply label smoothing in compute_loss"},
      {"neftune_noise_alpha", "null", false, "not available"},
      {"auto_find_batch_size", "false", false, "not available: set per_device_train_batch_size"},
      {"full_determinism", "false", false, "not available; remove it"},
      {"eval_accumulation_steps", "null", false, "not available: evaluation results are gathered per batch"},
      {"eval_delay", "0|0.0", false, "not available; remove it"},
      {"eval_on_start", "false", false, "call Trainer::evaluate() before train()"},
      {"eval_do_concat_batches", "true", false, "evaluation concatenates batches"},
      {"eval_use_gather_object", "false", false, "not available"},
      {"batch_eval_metrics", "false", false, "compute_metrics sees the whole evaluation"},
      {"prediction_loss_only", "false", false, "give no eval_step to get only the loss"},
      {"include_inputs_for_metrics", "false", false, "not available"},
      {"include_for_metrics", "empty", false, "not available"},
      {"include_num_input_tokens_seen", "false|no", true,
       "tokens are counted when the program calls Trainer::set_count_tokens"},
      {"include_tokens_per_second", "false", true,
       "tokens/s are logged when the program calls Trainer::set_count_tokens"},
      {"ignore_data_skip", "false", false, "resuming always continues at the saved batch"},
      {"restore_callback_states_from_checkpoint", "false", false, "callback states are always restored"},
      {"split_batches", "null", false, "set split_batches in the Accelerate config"},
      {"dispatch_batches", "null", false, "not available"},
      {"per_gpu_train_batch_size", "null", false, "use per_device_train_batch_size"},
      {"per_gpu_eval_batch_size", "null", false, "use per_device_eval_batch_size"},
      {"mp_parameters", "empty", true, "SageMaker only"},
      {"ray_scope", "last", true, "Ray Tune only"},
      {"use_legacy_prediction_loop", "false", false, "not available"},
      {"use_liger_kernel", "false", false, "Liger kernels are Python-only"},
      {"liger_kernel_config", "null", false, "Liger kernels are Python-only"},
  };
  return table;
}

}  // namespace accel
