// TrainerState as HF's trainer_state.json, the built-in callbacks, and HF's checkpoint rotation.
#include <accel/errors.hpp>
#include <accel/trainer/callbacks.hpp>

#include "config/message_text.hpp"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>

namespace accel {
namespace {

using Json = nlohmann::json;

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Keys of a log entry written as whole numbers.
bool integral_key(const std::string& k) {
  return k == "step" || k == "num_input_tokens_seen";
}

template <class T>
Json optional_json(const std::optional<T>& v) {
  return v ? Json(*v) : Json(nullptr);
}

}  // namespace

std::string TrainerState::to_json() const {
  Json history = Json::array();
  for (const auto& entry : log_history) {
    Json e = Json::object();
    for (const auto& [k, v] : entry) {
      if (integral_key(k)) {
        e[k] = static_cast<std::int64_t>(v);
      } else {
        e[k] = v;
      }
    }
    history.push_back(e);
  }
  Json callbacks = Json::object();
  for (const auto& [name, attributes] : stateful_callbacks)
    callbacks[name] = {{"args", Json::object()}, {"attributes", attributes}};
  const Json root = {{"best_global_step", optional_json(best_global_step)},
                     {"best_metric", optional_json(best_metric)},
                     {"best_model_checkpoint", optional_json(best_model_checkpoint)},
                     {"epoch", epoch},
                     {"eval_steps", eval_steps},
                     {"global_step", global_step},
                     {"is_hyper_param_search", false},
                     {"is_local_process_zero", is_local_process_zero},
                     {"is_world_process_zero", is_world_process_zero},
                     {"log_history", history},
                     {"logging_steps", logging_steps},
                     {"max_steps", max_steps},
                     {"num_input_tokens_seen", num_input_tokens_seen},
                     {"num_samples_seen", num_samples_seen},
                     {"num_train_epochs", num_train_epochs},
                     {"save_steps", save_steps},
                     {"skipped_steps", skipped_steps},
                     {"stateful_callbacks", callbacks},
                     {"total_flos", 0.0},
                     {"train_batch_size", train_batch_size},
                     {"trial_name", nullptr},
                     {"trial_params", nullptr}};
  return root.dump(2) + "\n";
}

TrainerState TrainerState::from_json(const std::string& text, const std::string& source) {
  TrainerState s;
  try {
    const Json root = Json::parse(text);
    if (!root.is_object())
      throw ConfigError(fmt::format("{}: not a trainer_state.json (not an object)", source));
    auto get = [&](const char* key, auto& out) {
      if (root.contains(key) && !root.at(key).is_null())
        out = root.at(key).get<std::decay_t<decltype(out)>>();
    };
    get("epoch", s.epoch);
    get("global_step", s.global_step);
    get("max_steps", s.max_steps);
    get("logging_steps", s.logging_steps);
    get("eval_steps", s.eval_steps);
    get("save_steps", s.save_steps);
    get("train_batch_size", s.train_batch_size);
    get("num_train_epochs", s.num_train_epochs);
    get("num_input_tokens_seen", s.num_input_tokens_seen);
    get("num_samples_seen", s.num_samples_seen);
    get("skipped_steps", s.skipped_steps);
    if (root.contains("best_metric") && !root.at("best_metric").is_null())
      s.best_metric = root.at("best_metric").get<double>();
    if (root.contains("best_global_step") && !root.at("best_global_step").is_null())
      s.best_global_step = root.at("best_global_step").get<std::int64_t>();
    if (root.contains("best_model_checkpoint") && !root.at("best_model_checkpoint").is_null())
      s.best_model_checkpoint = root.at("best_model_checkpoint").get<std::string>();
    if (root.contains("log_history")) {
      for (const auto& e : root.at("log_history")) {
        LogEntry entry;
        for (const auto& [k, v] : e.items())
          if (v.is_number()) entry[k] = v.get<double>();
        s.log_history.push_back(std::move(entry));
      }
    }
    if (root.contains("stateful_callbacks")) {
      for (const auto& [name, cb] : root.at("stateful_callbacks").items()) {
        if (!cb.is_object() || !cb.contains("attributes")) continue;
        for (const auto& [k, v] : cb.at("attributes").items())
          if (v.is_number()) s.stateful_callbacks[name][k] = v.get<double>();
      }
    }
  } catch (const Json::exception& e) {
    throw ConfigError(
        detail::bounded_message(fmt::format("{}: not a valid trainer_state.json: {}", source, e.what())),
        source);
  }
  return s;
}

EarlyStoppingCallback::EarlyStoppingCallback(int patience, double threshold)
    : patience_(patience), threshold_(threshold) {
  if (patience < 1)
    throw UsageError(fmt::format("EarlyStoppingCallback: patience must be at least 1, got {}", patience));
  if (threshold < 0)
    throw UsageError(fmt::format("EarlyStoppingCallback: threshold must not be negative, got {}", threshold));
}

void EarlyStoppingCallback::on_train_begin(const TrainingArguments& args, TrainerState&, TrainerControl&) {
  // HF asserts the same three.
  if (!args.load_best_model_at_end)
    throw ConfigError("EarlyStoppingCallback requires load_best_model_at_end: true (as Hugging Face's)",
                      args.source, 0, "load_best_model_at_end");
  if (!args.metric_for_best_model)
    throw ConfigError("EarlyStoppingCallback requires metric_for_best_model", args.source, 0,
                      "metric_for_best_model");
  if (args.eval_strategy == "no")
    throw ConfigError("EarlyStoppingCallback requires eval_strategy steps or epoch", args.source, 0,
                      "eval_strategy");
}

void EarlyStoppingCallback::on_evaluate(const TrainingArguments& args, TrainerState& state,
                                        TrainerControl& control,
                                        const std::map<std::string, double>& metrics) {
  std::string key = *args.metric_for_best_model;
  if (key.rfind("eval_", 0) != 0) key = "eval_" + key;
  const auto it = metrics.find(key);
  if (it == metrics.end()) {
    throw UsageError(
        fmt::format("EarlyStoppingCallback: the evaluation gave no '{}' (metric_for_best_model); "
                    "compute_metrics returned {} metric(s)",
                    key, metrics.size()));
  }
  const double value = it->second;
  const bool greater = args.greater_is_better.value_or(true);
  // HF: judged against the best metric as it stood before this evaluation (the Trainer updates it after).
  const bool better = greater ? value > state.best_metric.value_or(0) : value < state.best_metric.value_or(0);
  const bool improved = !state.best_metric || (better && std::fabs(value - *state.best_metric) > threshold_);
  counter_ = improved ? 0 : counter_ + 1;
  if (counter_ >= patience_) control.should_training_stop = true;
}

std::map<std::string, double> EarlyStoppingCallback::attributes() const {
  return {{"early_stopping_patience_counter", counter_}};
}

void EarlyStoppingCallback::load_attributes(const std::map<std::string, double>& a) {
  if (const auto it = a.find("early_stopping_patience_counter"); it != a.end())
    counter_ = static_cast<int>(it->second);
}

ThroughputMonitor::ThroughputMonitor(double flops_per_sample, double peak_flops_per_device, int world_size)
    : flops_per_sample_(flops_per_sample), peak_(peak_flops_per_device), world_(world_size) {
  if (!(flops_per_sample >= 0) || !(peak_flops_per_device > 0) || world_size < 1) {
    throw UsageError(
        fmt::format("ThroughputMonitor: flops_per_sample ({}) must be >= 0, peak_flops_per_device "
                    "({}) > 0 and world_size ({}) >= 1",
                    flops_per_sample, peak_flops_per_device, world_size));
  }
}

void ThroughputMonitor::on_train_begin(const TrainingArguments&, TrainerState& state, TrainerControl&) {
  last_time_ = now_seconds();
  last_samples_ = state.num_samples_seen;
  last_tokens_ = state.num_input_tokens_seen;
}

void ThroughputMonitor::on_log(const TrainingArguments&, TrainerState& state, TrainerControl&,
                               LogEntry& logs) {
  if (logs.count("loss") == 0) return;  // training logs only
  const double t = now_seconds();
  const double dt = t - last_time_;
  if (dt <= 0) return;
  const double samples = static_cast<double>(state.num_samples_seen - last_samples_) / dt;
  logs["throughput/samples_per_sec"] = samples;
  if (state.num_input_tokens_seen > last_tokens_)
    logs["throughput/tokens_per_sec"] = static_cast<double>(state.num_input_tokens_seen - last_tokens_) / dt;
  if (flops_per_sample_ > 0) {
    const double flops = samples * flops_per_sample_;
    logs["throughput/flops_per_sec"] = flops;
    logs["throughput/mfu"] = flops / (peak_ * world_);
  }
  last_time_ = t;
  last_samples_ = state.num_samples_seen;
  last_tokens_ = state.num_input_tokens_seen;
}

std::vector<std::string> checkpoints_to_delete(std::vector<std::string> sorted, int limit,
                                               const std::optional<std::string>& best) {
  if (limit <= 0 || sorted.size() <= 1) return {};
  // HF's _sorted_checkpoints: the best moves to the second newest place, so that it is deleted last.
  if (best) {
    const auto it = std::find(sorted.begin(), sorted.end(), *best);
    if (it != sorted.end()) {
      for (auto i = static_cast<std::size_t>(it - sorted.begin()); i + 2 < sorted.size(); ++i)
        std::swap(sorted[i], sorted[i + 1]);
    }
  }
  // HF's _rotate_checkpoints: with limit 1 and a best that is not the newest, keep two.
  int keep = limit;
  if (best && limit == 1 && sorted.back() != *best) keep = 2;
  const auto remove = sorted.size() > static_cast<std::size_t>(keep) ? sorted.size() - keep : 0;
  return {sorted.begin(), sorted.begin() + static_cast<std::ptrdiff_t>(remove)};
}

}  // namespace accel
