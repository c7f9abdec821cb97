// What Hugging Face's Trainer makes of a DeepSpeed JSON file (<accel/config/deepspeed_trainer.hpp>),
// torch-free: transformers 5.24's HfTrainerDeepSpeedConfig (integrations/deepspeed.py: fill_match,
// trainer_config_process, trainer_config_finalize), DeepSpeed 0.19.6's optimizer choice (runtime/engine.py
// _configure_basic_optimizer) and its schedules (runtime/lr_schedules.py WarmupLR, WarmupDecayLR,
// WarmupCosineLR). The reader keeps the keys concerned in Config::zero.trainer_keys (read_trainer_keys);
// accel::Trainer fills and checks them.
#include <accel/config/deepspeed_trainer.hpp>

#include "config/text_distance.hpp"
#include "deepspeed_json_parts.hpp"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <limits>

namespace accel {
namespace config_detail::ds_json {

namespace {

const char* const kTopKeys[] = {"train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                                "train_batch_size", "gradient_clipping"};

std::string lower(std::string s) {
  for (auto& ch : s)
    ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  return s;
}

}  // namespace

bool supported_optimizer_type(const std::string& type) {
  return lower(type) == "adam" || lower(type) == "adamw";
}

bool supported_scheduler_type(const std::string& type) {
  return type == "WarmupLR" || type == "WarmupDecayLR" || type == "WarmupCosineLR";
}

// The optimizer or scheduler block: an object with a string "type" this build implements, and "params" an
// object (or absent). Its parameters are checked when accel::Trainer builds it.
void check_block(const JsonFile& f, const Json& block, const std::string& name) {
  if (!block.is_object())
    f.fail(name, name,
           fmt::format("{}: expected an object such as {{\"type\": ..., \"params\": {{...}}}}", name));
  if (!block.contains("type") || !block.at("type").is_string())
    f.fail(name, name,
           fmt::format("{}: expected a \"type\" string (DeepSpeed builds the {} it names)", name, name));
  const std::string type = block.at("type").get<std::string>();
  if (name == "optimizer" && !supported_optimizer_type(type)) {
    f.fail(
        "optimizer.type", "type",
        fmt::format("optimizer.type '{}' is not supported: accelerate-cpp builds DeepSpeed's \"Adam\" and "
                    "\"AdamW\" (its FusedAdam / CPU Adam), as Hugging Face's Trainer hands the block to "
                    "DeepSpeed; use one of them, or remove the optimizer block (accel::Trainer then builds "
                    "TrainingArguments' optim)",
                    type));
  }
  if (name == "scheduler" && !supported_scheduler_type(type)) {
    f.fail("scheduler.type", "type",
           fmt::format(
               "scheduler.type '{}' is not supported: accelerate-cpp builds DeepSpeed's WarmupLR, "
               "WarmupDecayLR and WarmupCosineLR (not OneCycle, LRRangeTest or torch's schedulers); use "
               "one of them, or remove the scheduler block (accel::Trainer then builds TrainingArguments' "
               "lr_scheduler_type)",
               type));
  }
  for (const auto& [key, value] : block.items()) {
    if (key == "type" || (key == "params" && (value.is_object() || value.is_null()))) continue;
    f.fail(name + "." + key, key,
           fmt::format("{}.{}: a DeepSpeed {} block has \"type\" and \"params\" (an object); {}", name, key,
                       name, key == "params" ? "params must be an object" : "remove this key"));
  }
}

void read_trainer_keys(const JsonFile& f, const Json& root, Config& c) {
  Json keep = Json::object();
  for (const char* key : kTopKeys) {
    if (root.contains(key)) keep[key] = root.at(key);
  }
  for (const char* block : {"fp16", "bf16"}) {
    if (root.contains(block) && root.at(block).is_object() && root.at(block).contains("enabled"))
      keep[block] = Json{{"enabled", root.at(block).at("enabled")}};
  }
  std::vector<std::string> built;
  for (const char* block : {"optimizer", "scheduler"}) {
    if (!root.contains(block) || root.at(block).is_null()) continue;
    check_block(f, root.at(block), block);
    keep[block] = root.at(block);
    built.push_back(fmt::format("{} {}", block, root.at(block).at("type").get<std::string>()));
  }
  c.zero.trainer_keys = keep.empty() ? std::string() : keep.dump();
  if (!built.empty()) {
    c.notices.push_back(fmt::format(
        "{}: {}: accel::Trainer builds {} from the block, \"auto\" filled from TrainingArguments, as Hugging "
        "Face's Trainer has DeepSpeed build it; a loop of your own creates its optimizer and schedule (the "
        "block then has no effect)",
        f.path(), join(built, ", "), built.size() == 1 ? "it" : "them"));
  }
}

}  // namespace config_detail::ds_json

namespace {

using config_detail::ds_json::Json;

// Python's `!=` between a JSON value and the TrainingArguments value (bool is the integer 0 / 1 there).
bool py_equal(const Json& a, const Json& b) {
  const auto as_number = [](const Json& v) {
    return v.is_boolean() ? (v.get<bool>() ? 1.0 : 0.0) : v.get<double>();
  };
  const bool a_num = a.is_number() || a.is_boolean(), b_num = b.is_number() || b.is_boolean();
  if (a_num && b_num) return as_number(a) == as_number(b);
  if (a.is_array() && b.is_array()) {
    if (a.size() != b.size()) return false;
    for (std::size_t i = 0; i < a.size(); ++i)
      if (!py_equal(a[i], b[i])) return false;
    return true;
  }
  return a == b;
}

// A value as HF's message shows it (Python's repr of JSON numbers, lists and booleans).
std::string shown(const Json& v) {
  if (v.is_boolean()) return v.get<bool>() ? "True" : "False";
  if (v.is_array()) {
    std::vector<std::string> items;
    for (const auto& x : v)
      items.push_back(shown(x));
    return "[" + config_detail::join(items, ", ") + "]";
  }
  if (v.is_number_float()) return fmt::format("{}", v.get<double>());
  return v.dump();
}

struct Filler {
  Json& config;
  DeepSpeedTrainerConfig& out;

  // HF's fill_match: "auto" becomes the TrainingArguments value; another non-null value must equal it.
  void fill(const std::string& path, const Json& hf_value, const std::string& hf_key,
            bool must_match = true) {
    Json* node = &config;
    std::string::size_type start = 0;
    for (auto dot = path.find('.'); dot != std::string::npos; dot = path.find('.', start)) {
      const std::string part = path.substr(start, dot - start);
      if (!node->is_object() || !node->contains(part) || !node->at(part).is_object()) return;
      node = &node->at(part);
      start = dot + 1;
    }
    const std::string leaf = path.substr(start);
    if (!node->contains(leaf)) return;
    Json& value = node->at(leaf);
    if (config_detail::ds_json::is_auto(value)) {
      value = hf_value;
      return;
    }
    if (!must_match || value.is_null() || py_equal(value, hf_value)) return;
    out.mismatched_keys.push_back(path);
    out.mismatches.push_back(
        fmt::format("{}={} vs TrainingArguments {}={}", path, shown(value), hf_key, shown(hf_value)));
  }
};

[[noreturn]] void fail(const std::string& file, const std::string& key, const std::string& body) {
  throw ConfigError(fmt::format("{}: {}", file, body), file, 0, key);
}

double number(const std::string& file, const Json& params, const std::string& block, const char* key,
              double fallback) {
  if (!params.contains(key) || params.at(key).is_null()) return fallback;
  const Json& v = params.at(key);
  if (!v.is_number() || !std::isfinite(v.get<double>())) {
    fail(
        file, block + ".params." + key,
        fmt::format(
            "{}.params.{}: expected a number{}, got {}", block, key,
            config_detail::ds_json::is_auto(v) ? " (Hugging Face's Trainer does not fill this \"auto\")" : "",
            v.dump()));
  }
  return v.get<double>();
}

// A switch as DeepSpeed's engine reads it: `optimizer_parameters.pop(key, default)` tested for truth, so an
// absent key is the default, null is false and a number is its truth (0 false); text is refused (Python
// would read "false" as true).
bool flag(const std::string& file, const Json& params, const std::string& block, const char* key,
          bool fallback) {
  if (!params.contains(key)) return fallback;
  const Json& v = params.at(key);
  if (v.is_null()) return false;
  if (v.is_number()) return v.get<double>() != 0.0;
  if (!v.is_boolean())
    fail(file, block + ".params." + key,
         fmt::format("{}.params.{}: expected true or false, got {}", block, key, v.dump()));
  return v.get<bool>();
}

void check_param_names(const std::string& file, const Json& params, const std::string& block,
                       const std::string& type, const std::vector<std::string>& valid) {
  for (const auto& [key, value] : params.items()) {
    if (std::find(valid.begin(), valid.end(), key) != valid.end()) continue;
    if (block == "optimizer" && key == "max_grad_norm") {
      fail(file, "optimizer.params.max_grad_norm",
           "optimizer.params.max_grad_norm is not an optimizer parameter (DeepSpeed refuses it too): use the "
           "top-level \"gradient_clipping\" (or TrainingArguments max_grad_norm with gradient_clipping "
           "\"auto\")");
    }
    const auto guess = config_detail::closest(key, valid);
    fail(file, block + ".params." + key,
         fmt::format("{}.params.{} is not a parameter of DeepSpeed's {} (it would refuse it too){}", block,
                     key, type,
                     guess ? fmt::format("; did you mean '{}'?", *guess)
                           : fmt::format("; its parameters: {}", config_detail::join(valid))));
  }
}

DeepSpeedOptimizer read_optimizer(const std::string& file, const Json& block) {
  DeepSpeedOptimizer o;
  o.type = block.at("type").get<std::string>();
  const Json params =
      block.contains("params") && block.at("params").is_object() ? block.at("params") : Json::object();
  // engine.py: FusedAdam / DeepSpeedCPUAdam (lr, bias_correction, betas, eps, weight_decay, amsgrad, and the
  // CPU Adam's fp32_optimizer_states), after popping torch_adam and adam_w_mode.
  check_param_names(file, params, "optimizer", o.type,
                    {"lr", "betas", "eps", "weight_decay", "bias_correction", "amsgrad", "adam_w_mode",
                     "torch_adam", "fp32_optimizer_states"});
  o.torch_adam = flag(file, params, "optimizer", "torch_adam", false);
  const bool adam_w_mode = flag(file, params, "optimizer", "adam_w_mode", true);
  std::string type = o.type;
  for (auto& ch : type)
    ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  o.adamw_mode = type == "adamw" || adam_w_mode;  // "Optimizer name of Adam forces AdamW logic unless ..."
  o.lr = number(file, params, "optimizer", "lr", 1e-3);
  o.eps = number(file, params, "optimizer", "eps", 1e-8);
  // torch.optim.AdamW's default weight decay is 0.01; FusedAdam's, CPU Adam's and torch.optim.Adam's 0.
  o.weight_decay =
      number(file, params, "optimizer", "weight_decay", o.torch_adam && o.adamw_mode ? 0.01 : 0.0);
  if (params.contains("betas") && !params.at("betas").is_null()) {
    const Json& b = params.at("betas");
    if (!b.is_array() || b.size() != 2 || !b[0].is_number() || !b[1].is_number())
      fail(
          file, "optimizer.params.betas",
          fmt::format("optimizer.params.betas: expected two numbers such as [0.9, 0.999], got {}", b.dump()));
    o.beta1 = b[0].get<double>();
    o.beta2 = b[1].get<double>();
  }
  if (params.contains("bias_correction") && o.torch_adam) {
    // engine.py passes the remaining parameters to torch.optim.Adam / AdamW, which have no such argument.
    fail(file, "optimizer.params.bias_correction",
         "optimizer.params.bias_correction with torch_adam: true: DeepSpeed hands it to torch.optim.Adam / "
         "AdamW, which have no bias_correction parameter (TypeError); remove one of the two");
  }
  // FusedAdam tests it for truth ("1 if group['bias_correction'] else 0") and CPU Adam's binding converts it
  // to bool: null and 0 mean false there.
  o.bias_correction = flag(file, params, "optimizer", "bias_correction", true);
  if (flag(file, params, "optimizer", "amsgrad", false)) {
    fail(file, "optimizer.params.amsgrad",
         "optimizer.params.amsgrad: true is refused by DeepSpeed's FusedAdam and not supported here; remove "
         "it");
  }
  if (!flag(file, params, "optimizer", "fp32_optimizer_states", true)) {
    fail(file, "optimizer.params.fp32_optimizer_states",
         "optimizer.params.fp32_optimizer_states: false (CPU Adam's 16-bit moments) is not supported: the "
         "optimizer state is fp32 here; remove it");
  }
  return o;
}

std::int64_t whole(const std::string& file, const Json& params, const char* key, std::int64_t fallback) {
  if (!params.contains(key)) return fallback;
  const Json& v = params.at(key);
  if (!v.is_number_integer()) {
    fail(file, std::string("scheduler.params.") + key,
         fmt::format("scheduler.params.{}: expected an integer (DeepSpeed requires an int), got {}", key,
                     v.dump()));
  }
  return v.get<std::int64_t>();
}

DeepSpeedScheduler read_scheduler(const std::string& file, const Json& block) {
  DeepSpeedScheduler s;
  s.type = block.at("type").get<std::string>();
  const Json params =
      block.contains("params") && block.at("params").is_object() ? block.at("params") : Json::object();
  const bool cosine = s.type == "WarmupCosineLR", decay = s.type == "WarmupDecayLR";
  std::vector<std::string> valid = {"warmup_num_steps", "warmup_type", "last_batch_iteration"};
  if (cosine) {
    valid.insert(valid.end(), {"total_num_steps", "warmup_min_ratio", "cos_min_ratio"});
  } else {
    valid.insert(valid.end(), {"warmup_min_lr", "warmup_max_lr"});
    if (decay) valid.push_back("total_num_steps");
  }
  check_param_names(file, params, "scheduler", s.type, valid);
  if ((cosine || decay) && !params.contains("total_num_steps")) {
    fail(file, "scheduler.params.total_num_steps",
         fmt::format("scheduler.params.total_num_steps: DeepSpeed's {} needs it; set it to \"auto\" (the "
                     "Trainer's optimizer steps) or a number",
                     s.type));
  }
  s.warmup_num_steps = whole(file, params, "warmup_num_steps", 1000);
  if (s.warmup_num_steps <= 0) {
    fail(
        file, "scheduler.params.warmup_num_steps",
        fmt::format("scheduler.params.warmup_num_steps: must be a positive integer, got {} (DeepSpeed 0.19.6 "
                    "refuses it too)",
                    s.warmup_num_steps));
  }
  s.total_num_steps = whole(file, params, "total_num_steps", 0);
  if (whole(file, params, "last_batch_iteration", -1) != -1) {
    fail(file, "scheduler.params.last_batch_iteration",
         "scheduler.params.last_batch_iteration: only -1 (a new schedule) is supported; a resumed run "
         "restores "
         "the schedule from its checkpoint");
  }
  if (params.contains("warmup_type") && !params.at("warmup_type").is_string())
    fail(file, "scheduler.params.warmup_type",
         fmt::format("scheduler.params.warmup_type: expected \"log\" or \"linear\", got {}",
                     params.at("warmup_type").dump()));
  // DeepSpeed warns about another warmup_type and uses "log".
  s.log_warmup = !params.contains("warmup_type") || params.at("warmup_type").get<std::string>() != "linear";
  s.warmup_min_lr = number(file, params, "scheduler", "warmup_min_lr", 0.0);
  if (params.contains("warmup_max_lr") && !params.at("warmup_max_lr").is_null())
    s.warmup_max_lr = number(file, params, "scheduler", "warmup_max_lr", 0.0);
  else if (decay)
    s.warmup_max_lr = 0.001;  // WarmupDecayLR's default; WarmupLR's is the optimizer's rate
  s.warmup_min_ratio = number(file, params, "scheduler", "warmup_min_ratio", 0.0);
  s.cos_min_ratio = number(file, params, "scheduler", "cos_min_ratio", 0.0001);
  return s;
}

std::string mismatch_message(const DeepSpeedTrainerConfig& out, const DeepSpeedTrainerArgs& a) {
  std::string lines;
  for (const auto& m : out.mismatches)
    lines += "\n  - " + m;
  return fmt::format(
      "these DeepSpeed config values mismatch the TrainingArguments ({}), which Hugging Face's Trainer "
      "refuses "
      "too (\"Please correct the following DeepSpeed config values that mismatch TrainingArguments "
      "values\"):{}\n"
      "Set each of these keys to \"auto\" in {} (the Trainer then fills it from TrainingArguments), or make "
      "the "
      "two values equal",
      a.source.empty() ? "defaults" : a.source, lines, out.file);
}

}  // namespace

bool deepspeed_trainer_sets(const Config& config, const std::string& key) {
  if (config.zero.trainer_keys.empty()) return false;
  const Json keys = Json::parse(config.zero.trainer_keys, nullptr, /*allow_exceptions=*/false);
  const Json* node = &keys;
  std::string::size_type start = 0;
  while (true) {
    const auto dot = key.find('.', start);
    const std::string part = key.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
    if (!node->is_object() || !node->contains(part)) return false;
    node = &node->at(part);
    if (dot == std::string::npos) break;
    start = dot + 1;
  }
  return !node->is_null() && !config_detail::ds_json::is_auto(*node);
}

DeepSpeedTrainerConfig deepspeed_trainer_config(const Config& config, const DeepSpeedTrainerArgs& a,
                                                bool throw_on_mismatch) {
  DeepSpeedTrainerConfig out;
  out.file = config.zero.config_file.empty() ? std::string("the DeepSpeed config") : config.zero.config_file;
  if (config.zero.trainer_keys.empty()) return out;
  Json keys = Json::parse(config.zero.trainer_keys, nullptr, /*allow_exceptions=*/false);
  if (!keys.is_object()) {
    throw ConfigError(
        fmt::format(
            "deepspeed_config.deepspeed_trainer_keys: expected a JSON object (accel-launch writes it from "
            "the DeepSpeed config file), got '{}'",
            config.zero.trainer_keys),
        config.source, 0, "deepspeed_config.deepspeed_trainer_keys");
  }
  Filler fill{keys, out};
  // trainer_config_process, in HF's order.
  const std::int64_t train_batch_size =
      a.world_size * a.per_device_train_batch_size * a.gradient_accumulation_steps;
  fill.fill("train_micro_batch_size_per_gpu", a.per_device_train_batch_size, "per_device_train_batch_size");
  fill.fill("gradient_accumulation_steps", a.gradient_accumulation_steps, "gradient_accumulation_steps");
  fill.fill("train_batch_size", train_batch_size, "train_batch_size (calculated)");
  fill.fill("gradient_clipping", a.max_grad_norm, "max_grad_norm");
  fill.fill("optimizer.params.lr", a.learning_rate, "learning_rate");
  fill.fill("optimizer.params.betas", Json::array({a.adam_beta1, a.adam_beta2}), "adam_beta1+adam_beta2");
  fill.fill("optimizer.params.eps", a.adam_epsilon, "adam_epsilon");
  fill.fill("optimizer.params.weight_decay", a.weight_decay, "weight_decay");
  fill.fill("scheduler.params.warmup_min_lr", 0, "", /*must_match=*/false);
  fill.fill("scheduler.params.warmup_max_lr", a.learning_rate, "learning_rate");
  fill.fill("fp16.enabled", a.fp16, "fp16|fp16_full_eval");
  fill.fill("bf16.enabled", a.bf16, "bf16|bf16_full_eval");
  // trainer_config_finalize.
  fill.fill("scheduler.params.total_num_steps", a.num_training_steps, "num_training_steps (calculated)");
  fill.fill("scheduler.params.warmup_num_steps", std::max<std::int64_t>(1, a.warmup_steps), "warmup_steps");
  out.filled = keys.dump();
  if (throw_on_mismatch && !out.mismatches.empty())
    throw ConfigError(out.file + ": " + mismatch_message(out, a), out.file, 0, out.mismatched_keys.front());
  if (keys.contains("optimizer")) out.optimizer = read_optimizer(out.file, keys.at("optimizer"));
  if (keys.contains("scheduler")) out.scheduler = read_scheduler(out.file, keys.at("scheduler"));
  return out;
}

double deepspeed_schedule_lr(const DeepSpeedScheduler& s, double optimizer_lr, std::int64_t steps) {
  const std::int64_t last = steps - 1;  // DeepSpeed's last_batch_iteration
  const std::int64_t warmup = std::max<std::int64_t>(2, s.warmup_num_steps);
  const double inverse_log_warm_up = 1.0 / std::log(static_cast<double>(warmup));
  const auto warmup_gamma = [&]() {
    return s.log_warmup ? inverse_log_warm_up * std::log(static_cast<double>(last + 1))
                        : static_cast<double>(last) / static_cast<double>(warmup);
  };
  if (s.type == "WarmupCosineLR") {  // lr_schedules.py WarmupCosineLR.get_lr_ratio
    if (last < 0) return 0.0;
    if (last < warmup)
      return optimizer_lr * (s.warmup_min_ratio + warmup_gamma() * (1.0 - s.warmup_min_ratio));
    const double real_last_step = static_cast<double>(last - warmup + 1);
    const double real_total_steps =
        static_cast<double>(std::max<std::int64_t>(1, s.total_num_steps - warmup));
    const double progress = std::min(1.0, real_last_step / real_total_steps);
    const double ratio = (1 + std::cos(M_PI * progress)) / 2;
    return optimizer_lr * std::max(0.0, s.cos_min_ratio + (1.0 - s.cos_min_ratio) * ratio);
  }
  // WarmupLR.get_lr / _get_gamma, WarmupDecayLR._get_gamma.
  const double min_lr = s.warmup_min_lr;
  const double delta = s.warmup_max_lr.value_or(optimizer_lr) - min_lr;
  if (last < 0) return min_lr;
  double gamma = 1.0;
  if (last < warmup) {
    gamma = warmup_gamma();
  } else if (s.type == "WarmupDecayLR") {
    gamma = std::max(0.0, static_cast<double>(s.total_num_steps - last) /
                              std::max(1.0, static_cast<double>(s.total_num_steps - warmup)));
  }
  return min_lr + delta * gamma;
}

}  // namespace accel
