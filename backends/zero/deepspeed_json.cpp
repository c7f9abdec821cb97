// DeepSpeed JSON configs (`deepspeed_config_file:` in an Accelerate DEEPSPEED config), read by DeepSpeed's
// rules: comments tolerated, duplicate keys rejected, an unknown key inside zero_optimization or an offload
// block is an error naming key, file and the nearest valid key, unknown top-level keys are ignored with a
// notice. "auto" values are resolved as Accelerate resolves them, DeepSpeed's defaults fill what the file
// leaves out, and keys that map to nothing here are listed as notices, never silently dropped.
#include "deepspeed_json.hpp"

#include "config/small_file.hpp"
#include "config/text_distance.hpp"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <set>

namespace accel::config_detail {
namespace {

using Json = nlohmann::json;

// DeepSpeed's DeepSpeedZeroConfig fields (with their deprecated aliases) and its offload configs.
const std::vector<std::string>& zero_keys() {
  static const std::vector<std::string> kKeys = {
      "stage", "contiguous_gradients", "reduce_scatter", "reduce_bucket_size",
      "use_multi_rank_bucket_allreduce", "allgather_partitions", "allgather_bucket_size", "overlap_comm",
      "load_from_fp32_weights", "elastic_checkpoint", "offload_param", "offload_optimizer", "sub_group_size",
      "cpu_offload_param", "cpu_offload_use_pin_memory", "cpu_offload", "prefetch_bucket_size",
      "stage3_prefetch_bucket_size", "param_persistence_threshold", "stage3_param_persistence_threshold",
      "model_persistence_threshold", "stage3_model_persistence_threshold", "max_live_parameters",
      "stage3_max_live_parameters", "max_reuse_distance", "stage3_max_reuse_distance",
      "gather_16bit_weights_on_model_save", "stage3_gather_16bit_weights_on_model_save",
      "stage3_gather_fp16_weights_on_model_save", "module_granularity_threshold",
      "use_all_reduce_for_fetch_params", "stage3_use_all_reduce_for_fetch_params", "ignore_unused_parameters",
      "legacy_stage1", "round_robin_gradients", "zero_hpz_partition_size", "zero_quantized_weights",
      "zero_quantized_nontrainable_weights", "zero_quantized_gradients", "zeropp_loco_param",
      "mics_shard_size", "mics_hierarchical_params_gather", "memory_efficient_linear",
      "pipeline_loading_checkpoint", "override_module_apply", "log_trace_cache_warnings",
      // DeepSpeed 0.16-0.19 additions (zero/config.py)
      "stage3_module_granularity_threshold", "allgather_sequential", "stage3_allgather_sequential",
      "enable_sanity_checks", "save_muon_momentum_buffer_in_memory", "leaf_module"};
  return kKeys;
}
const std::vector<std::string>& offload_param_keys() {
  static const std::vector<std::string> kKeys = {"device",      "nvme_path",  "buffer_count",
                                                 "buffer_size", "max_in_cpu", "pin_memory"};
  return kKeys;
}
const std::vector<std::string>& offload_optimizer_keys() {
  static const std::vector<std::string> kKeys = {
      "device",         "nvme_path", "buffer_count", "pin_memory",    "pipeline_read",
      "pipeline_write", "fast_init", "ratio",        "super_offload", "cpuadam_cores_perc"};
  return kKeys;
}
// Top-level keys of DeepSpeed's config that accelerate-cpp reads.
const std::set<std::string>& mapped_top_keys() {
  static const std::set<std::string> kKeys = {"train_batch_size",
                                              "train_micro_batch_size_per_gpu",
                                              "gradient_accumulation_steps",
                                              "gradient_clipping",
                                              "fp16",
                                              "bf16",
                                              "zero_optimization",
                                              "torch_autocast",
                                              "tensor_parallel"};
  return kKeys;
}
std::size_t line_of_key(const std::string& text, const std::string& key) {
  const auto at = text.find("\"" + key + "\"");
  if (at == std::string::npos) return 0;
  return static_cast<std::size_t>(
             std::count(text.begin(), text.begin() + static_cast<std::ptrdiff_t>(at), '\n')) +
         1;
}

class JsonFile {
 public:
  JsonFile(std::string path, std::string text) : path_(std::move(path)), text_(std::move(text)) {}

  [[noreturn]] void fail(const std::string& key_path, const std::string& leaf,
                         const std::string& body) const {
    const auto line = static_cast<int>(line_of_key(text_, leaf));
    fail_at_line(line, key_path, body);
  }
  [[noreturn]] void fail_at_line(int line, const std::string& key_path, const std::string& body) const {
    throw ConfigError(location(path_, line) + body, path_, line, key_path);
  }
  const std::string& path() const { return path_; }
  const std::string& text() const { return text_; }

 private:
  std::string path_, text_;
};

bool is_auto(const Json& v) {
  return v.is_string() && v.get<std::string>() == "auto";
}

// A non-negative integer count (JSON integer or float notation such as 5e8) or "auto" (nullopt).
std::optional<std::uint64_t> count_or_auto(const JsonFile& f, const Json& v, const std::string& path,
                                           const std::string& leaf) {
  if (is_auto(v)) return std::nullopt;
  if (v.is_number_unsigned()) return v.get<std::uint64_t>();
  if (v.is_number_integer() && v.get<std::int64_t>() >= 0)
    return static_cast<std::uint64_t>(v.get<std::int64_t>());
  if (v.is_number_float()) {
    const double d = v.get<double>();
    if (d >= 0 && d < 1.8e19 && std::floor(d) == d) return static_cast<std::uint64_t>(d);
  }
  f.fail(path, leaf, fmt::format("{}: expected a non-negative integer or \"auto\", got {}", path, v.dump()));
}

bool boolean_value(const JsonFile& f, const Json& v, const std::string& path, const std::string& leaf) {
  if (v.is_boolean()) return v.get<bool>();
  f.fail(path, leaf, fmt::format("{}: expected true or false, got {}", path, v.dump()));
}

// A JSON value as a YAML node (JSON is YAML), for the unsupported-keys table's rules.
YAML::Node as_yaml(const Json& value) {
  try {
    return YAML::Load(value.dump());
  } catch (const YAML::Exception&) {
    // JSON that yaml-cpp does not read as YAML (control characters in keys, odd escapes): the rules then see
    // it as one non-empty scalar, which asks for something.
    return YAML::Node(value.dump());
  }
}

// The keys of `object` (at `path`, "" for the top level) that the unsupported-keys table refuses: an error
// naming the key, what it does in DeepSpeed and what to use instead, unless its value asks for nothing.
void refuse_unsupported(const JsonFile& f, const Json& object, const std::string& path) {
  for (const auto& [key, value] : object.items()) {
    const std::string full = path.empty() ? key : path + "." + key;
    const UnsupportedKey* row = find_unsupported(kDeepSpeedJson, full);
    if (row != nullptr && row->refused && !asks_nothing(*row, as_yaml(value)))
      f.fail(full, key, unsupported_message(*row));
  }
}

// Rejects keys of `object` outside `valid`, naming the nearest valid key.
void check_keys(const JsonFile& f, const Json& object, const std::string& path,
                const std::vector<std::string>& valid) {
  for (const auto& [key, value] : object.items()) {
    if (std::find(valid.begin(), valid.end(), key) != valid.end()) continue;
    if (find_unsupported(kDeepSpeedJson, path + "." + key) != nullptr) continue;  // see apply_unsupported
    const auto guess = closest(key, valid);
    f.fail(path + "." + key, key,
           fmt::format("unknown key '{}.{}' in DeepSpeed config {}{}", path, key, f.path(),
                       guess ? fmt::format(" (did you mean '{}'?)", *guess)
                             : fmt::format("; valid keys: {}", join(valid))));
  }
}

OffloadDevice offload_device(const JsonFile& f, const Json& block, const std::string& path, bool nvme_ok) {
  if (!block.is_object())
    f.fail(path, path.substr(path.rfind('.') + 1), fmt::format("{}: expected an object", path));
  if (!block.contains("device")) return OffloadDevice::None;
  const Json& d = block.at("device");
  const std::string text = d.is_string() ? d.get<std::string>() : d.dump();
  if (lower(text) == "cpu") return OffloadDevice::Cpu;
  // "auto" is filled by Accelerate from its DeepSpeed plugin's offload_*_device, "none" unless the YAML sets
  // it (which it refuses next to a JSON file): utils/dataclasses.py, plugin_to_config_mapping and fill_match.
  if (lower(text) == "none" || is_auto(d)) return OffloadDevice::None;
  if (lower(text) == "nvme" && nvme_ok) return OffloadDevice::Nvme;
  f.fail(path + ".device", "device",
         fmt::format("{}.device: invalid value {}; allowed values: none, cpu{}", path, d.dump(),
                     nvme_ok ? ", nvme" : ""));
}

// An offload block's buffer_count (2 to 1024 `what` buffers), into `out` when given (else unchanged).
void read_buffer_count(const JsonFile& f, const Json& v, const std::string& p, const char* what, int& out) {
  if (!v.contains("buffer_count")) return;
  const auto n = count_or_auto(f, v.at("buffer_count"), p + ".buffer_count", "buffer_count");
  if (n && (*n < 2 || *n > 1024)) {
    f.fail(p + ".buffer_count", "buffer_count",
           fmt::format("{}.buffer_count: expected 2 to 1024 {} buffers, got {}", p, what, *n));
  }
  if (n) out = static_cast<int>(*n);
}

// zero_optimization.offload_optimizer: the device, and with nvme its files' directory and buffers
// (DeepSpeed's defaults: buffer_count 4, pipeline_read and pipeline_write false).
void read_offload_optimizer(const JsonFile& f, const Json& v, const std::string& p, ZeroConfig& z,
                            std::vector<std::string>& no_effect) {
  z.offload_optimizer_device = offload_device(f, v, p, /*nvme_ok=*/true);
  if (z.offload_optimizer_device != OffloadDevice::Nvme) return;
  const Json* path = v.contains("nvme_path") ? &v.at("nvme_path") : nullptr;
  if (path == nullptr || !path->is_string() || path->get<std::string>().empty()) {
    f.fail(p + ".nvme_path", "nvme_path",
           fmt::format(
               "{}.nvme_path: device \"nvme\" needs the directory for the optimizer state's files (a fast "
               "local disk), got {}",
               p, path == nullptr ? std::string("nothing") : path->dump()));
  }
  z.offload_optimizer_nvme_path = path->get<std::string>();
  z.offload_optimizer_buffer_count = 4;
  read_buffer_count(f, v, p, "sub-group", z.offload_optimizer_buffer_count);
  z.offload_optimizer_pipeline_read =
      v.contains("pipeline_read") &&
      boolean_value(f, v.at("pipeline_read"), p + ".pipeline_read", "pipeline_read");
  z.offload_optimizer_pipeline_write =
      v.contains("pipeline_write") &&
      boolean_value(f, v.at("pipeline_write"), p + ".pipeline_write", "pipeline_write");
  for (const char* key : {"pin_memory", "fast_init", "ratio", "super_offload", "cpuadam_cores_perc"}) {
    if (v.contains(key)) no_effect.push_back(std::string("offload_optimizer.") + key);
  }
}

// zero_optimization.offload_param: the device, and with nvme its files' directory and buffers (DeepSpeed's
// default buffer_count: 5).
void read_offload_param(const JsonFile& f, const Json& v, const std::string& p, ZeroConfig& z,
                        std::vector<std::string>& no_effect) {
  z.offload_param_device = offload_device(f, v, p, /*nvme_ok=*/true);
  if (z.offload_param_device != OffloadDevice::Nvme) return;
  // Below stage 3 DeepSpeed ignores offload_param (a notice says so, settle_offload_param): a missing path is
  // an error only where the shards would go to the files (validate_zero).
  const Json* path = v.contains("nvme_path") ? &v.at("nvme_path") : nullptr;
  if (path != nullptr && !path->is_string() && !path->is_null()) {
    f.fail(p + ".nvme_path", "nvme_path",
           fmt::format("{}.nvme_path: expected the directory for the parameter shards' files, got {}", p,
                       path->dump()));
  }
  z.offload_param_nvme_path = path != nullptr && path->is_string() ? path->get<std::string>() : std::string();
  z.offload_param_buffer_count = 5;
  read_buffer_count(f, v, p, "shard", z.offload_param_buffer_count);
  // buffer_size: DeepSpeed's swap buffers hold buffer_size elements each; here a buffer holds one unit's
  // shard, whatever its size. max_in_cpu: shards kept in CPU memory besides; here every shard goes to its
  // file between uses. pin_memory: page-locked buffers for a GPU's copies.
  for (const char* key : {"buffer_size", "max_in_cpu", "pin_memory"}) {
    if (v.contains(key)) no_effect.push_back(std::string("offload_param.") + key);
  }
}

// The 1-based line of byte `at` of `text`.
int line_at(const std::string& text, std::size_t at) {
  at = std::min(at, text.size());
  return static_cast<int>(std::count(text.begin(), text.begin() + static_cast<std::ptrdiff_t>(at), '\n')) + 1;
}

// Checked before the JSON reader sees the text: a NUL byte or a UTF-16 mark (the reader stopped at a NUL and
// loaded what came before, silently) and nesting deeper than any DeepSpeed config (a value nested
// 100,000 deep crashed the process in the reader's recursion).
void check_text(const std::string& path, const std::string& text) {
  if (const auto problem = encoding_problem(text))
    throw ConfigError(fmt::format("{}:{}: {}", path, problem->first, problem->second), path, problem->first);
  constexpr int kMaxDepth = 64;  // DeepSpeed's own configs nest 3 or 4 deep
  int depth = 0;
  bool in_string = false, escaped = false;
  for (std::size_t i = 0; i < text.size(); ++i) {
    const char ch = text[i];
    if (in_string) {
      if (escaped)
        escaped = false;
      else if (ch == '\\')
        escaped = true;
      else if (ch == '"')
        in_string = false;
    } else if (ch == '"') {
      in_string = true;
    } else if (ch == '{' || ch == '[') {
      if (++depth > kMaxDepth) {
        const int line = line_at(text, i);
        throw ConfigError(
            fmt::format("{}:{}: values nested more than {} deep; a DeepSpeed config nests a few "
                        "levels (check the file)",
                        path, line, kMaxDepth),
            path, line);
      }
    } else if (ch == '}' || ch == ']') {
      --depth;
    }
  }
}

Json parse(const std::string& path, const std::string& text) {
  check_text(path, text);
  std::vector<std::set<std::string>> open;
  std::vector<std::string> keys;  // the key that opened each object (top: "")
  std::string last_key, duplicate;
  auto on_event = [&](int, Json::parse_event_t event, Json& value) {
    if (event == Json::parse_event_t::object_start) {
      open.emplace_back();
      keys.push_back(last_key);
    } else if (event == Json::parse_event_t::object_end) {
      open.pop_back();
      keys.pop_back();
    } else if (event == Json::parse_event_t::key && !open.empty()) {
      last_key = value.get<std::string>();
      if (!open.back().insert(last_key).second && duplicate.empty()) {
        std::string where;
        for (std::size_t i = 1; i < keys.size(); ++i)
          where += keys[i] + ".";
        duplicate = where + last_key;
      }
    }
    return true;
  };
  Json root;
  try {
    root = Json::parse(text, on_event, /*allow_exceptions=*/true, /*ignore_comments=*/true);
  } catch (const Json::exception& e) {
    // A syntax error has a position; a number too large for a double (1e400) does not.
    const auto* syntax = dynamic_cast<const Json::parse_error*>(&e);
    const auto upto = syntax != nullptr ? std::min<std::size_t>(syntax->byte, text.size()) : 0;
    const int line = syntax == nullptr
                         ? 0
                         : static_cast<int>(std::count(
                               text.begin(), text.begin() + static_cast<std::ptrdiff_t>(upto), '\n')) +
                               1;
    throw ConfigError(
        fmt::format("{}{}: not valid JSON ({}); DeepSpeed configs are JSON objects (comments are "
                    "allowed)",
                    path, line > 0 ? ":" + std::to_string(line) : std::string(), e.what()),
        path, line);
  }
  if (!duplicate.empty()) {
    const auto leaf =
        duplicate.substr(duplicate.rfind('.') == std::string::npos ? 0 : duplicate.rfind('.') + 1);
    JsonFile(path, text)
        .fail(duplicate, leaf,
              fmt::format("duplicate key '{}' in DeepSpeed config {} (DeepSpeed rejects it too); "
                          "keep only one",
                          duplicate, path));
  }
  if (!root.is_object()) {
    throw ConfigError(
        fmt::format("{}: a DeepSpeed config must be a JSON object, got {}", path, root.type_name()), path);
  }
  return root;
}

// The text of the DeepSpeed JSON at `path`; ConfigError at the YAML's deepspeed_config_file line.
std::string read_text(const std::string& path, const DeepSpeedJsonContext& context) {
  // Bounded: a DeepSpeed config is a few kilobytes, and /dev/zero must not be read until memory runs out; a
  // named pipe nobody writes to must not block for ever.
  const auto file = config_detail::read_small_file(path, std::size_t{16} << 20);
  if (file.too_large) {
    throw ConfigError(
        fmt::format("{}the DeepSpeed config '{}' is larger than 16 MiB; a DeepSpeed config is a few "
                    "kilobytes of JSON: check the path",
                    location(context.source, context.line), path),
        context.source, context.line, "deepspeed_config.deepspeed_config_file");
  }
  if (!file.error.empty()) {
    throw ConfigError(fmt::format("{}cannot open the DeepSpeed config '{}': {}",
                                  location(context.source, context.line), path, file.error),
                      context.source, context.line, "deepspeed_config.deepspeed_config_file");
  }
  return file.text;
}

// Every top-level key this reader knows: the ones it reads, and the unsupported table's (refused or noticed).
std::vector<std::string> top_level_names() {
  std::vector<std::string> names(mapped_top_keys().begin(), mapped_top_keys().end());
  names.push_back("bfloat16");
  for (const UnsupportedKey& row : unsupported_keys()) {
    if (row.file == kDeepSpeedJson && row.path.find('.') == std::string::npos) names.push_back(row.path);
  }
  return names;
}

// Top-level keys: read, listed as having no effect, a likely misspelling of a known key (an error naming
// it), or unknown (ignored with a notice, as DeepSpeed does).
void report_top_level_keys(const JsonFile& f, const Json& root, std::vector<std::string>& notices) {
  std::vector<std::string> no_effect, unknown;
  for (const auto& [key, value] : root.items()) {
    if (mapped_top_keys().count(key) != 0) continue;
    if (key == "bfloat16") {  // DeepSpeed's old name of bf16, read when bf16 is absent
      if (root.contains("bf16")) no_effect.push_back("bfloat16 (DeepSpeed reads bf16 when both are given)");
      continue;
    }
    if (const UnsupportedKey* row = find_unsupported(kDeepSpeedJson, key)) {
      if (!row->refused && !asks_nothing(*row, as_yaml(value)))
        no_effect.push_back(fmt::format("{} ({})", key, row->instead));
    } else if (const auto guess = detail::closest(key, top_level_names())) {
      // A misspelled block (zero_optimisation) would leave its settings unread: DeepSpeed ignores unknown
      // keys, and the run would train with the defaults, silently.
      f.fail(key, key,
             fmt::format("unknown top-level key '{}' (did you mean '{}'?): its settings would be ignored and "
                         "the defaults used; correct the name, or remove it",
                         key, *guess));
    } else {
      unknown.push_back(key);
    }
  }
  if (!no_effect.empty()) {
    notices.push_back(fmt::format("{}: these DeepSpeed settings have no effect in accelerate-cpp: {}",
                                  f.path(), join(no_effect, "; ")));
  }
  if (!unknown.empty()) {
    notices.push_back(fmt::format("{}: unknown top-level key(s) ignored: {}", f.path(), join(unknown)));
  }
}

// The mixed precision blocks: "bf16" (or DeepSpeed's old name "bfloat16", read when "bf16" is absent:
// precision_config.py get_bfloat16_config) and "fp16".
struct PrecisionBlock {
  std::string name;  // as the file spells it
  MixedPrecision mode;
};
std::vector<PrecisionBlock> precision_blocks(const Json& root) {
  std::vector<PrecisionBlock> out;
  if (root.contains("fp16")) out.push_back({"fp16", MixedPrecision::Fp16});
  if (root.contains("bf16")) {
    out.push_back({"bf16", MixedPrecision::Bf16});
  } else if (root.contains("bfloat16")) {
    out.push_back({"bfloat16", MixedPrecision::Bf16});
  }
  return out;
}

// The precision the fp16 / bf16 blocks enable ("enabled": true), if any.
std::optional<MixedPrecision> requested_precision(const JsonFile& f, const Json& root) {
  std::optional<MixedPrecision> wanted;
  for (const PrecisionBlock& block : precision_blocks(root)) {
    const Json& b = root.at(block.name);
    if (!b.is_object()) {
      f.fail(block.name, block.name,
             fmt::format("{}: expected an object such as {{\"enabled\": true}}", block.name));
    }
    if (!b.contains("enabled") || is_auto(b.at("enabled"))) continue;
    if (!boolean_value(f, b.at("enabled"), block.name + ".enabled", "enabled")) continue;
    if (wanted)
      f.fail(block.name, block.name, "fp16.enabled and bf16.enabled are both true; enable one of them");
    wanted = block.mode;
  }
  return wanted;
}

// Whether the fp16 / bf16 block `block` is in effect: enabled true, or "auto" resolved to it by
// mixed_precision, as Accelerate's set_mixed_precision fills it (absent: DeepSpeed's default, disabled).
bool block_in_effect(const Json& b, const PrecisionBlock& block, const Config& c) {
  if (!b.contains("enabled")) return false;
  if (is_auto(b.at("enabled"))) return c.mixed_precision == block.mode;
  return b.at("enabled").is_boolean() && b.at("enabled").get<bool>();
}

// One setting of DeepSpeed's fp16 or bf16 block (precision_config.py: DeepSpeedFP16Config,
// DeepSpeedBF16Config) that accelerate-cpp does not take from the file, with DeepSpeed's default and the
// value that behaves as accelerate-cpp does. The loss scaler's settings are not here: they are followed
// (read_loss_scaler).
struct PrecisionSetting {
  const char* block;  // "fp16" or "bf16" (the latter also for "bfloat16")
  const char* key;
  /// Compared when the file leaves the key out (DeepSpeed runs its default); null: not reported then.
  Json deepspeed_default;
  const char* since;  // version note of the default ("" none)
  Json ours;          // null: nothing here behaves like any value (reported whenever in effect)
  const char* ours_text;
};

const std::vector<PrecisionSetting>& precision_settings() {
  static const std::vector<PrecisionSetting> kSettings = {
      {"fp16", "auto_cast", false, "", false,
       "false, inputs are not cast: autocast runs each op in fp16 from fp32 parameters"},
      {"fp16", "fp16_master_weights_and_grads", false, "", false, "false, fp32 master weights"},
      // bf16 is autocast over fp32 parameters here: no loss scaler, nothing skipped.
      {"bf16", "immediate_grad_update", nullptr, "", nullptr,
       "no such setting: gradients are fp32 as backward produces them"},
      {"bf16", "check_grad_overflow", true, "since 0.19.3", false,
       "false, a step whose gradients hold inf or NaN is taken"},
      {"bf16", "bf16_master_weights_and_grads", false, "", false, "false, fp32 master weights and gradients"},
      {"bf16", "bf16_optimizer_states", false, "", false, "false, fp32 optimizer state"},
  };
  return kSettings;
}

// The keys of DeepSpeed's fp16 block that set its loss scaler (DeepSpeedFP16Config), all followed.
const std::vector<std::string>& loss_scaler_keys() {
  static const std::vector<std::string> kKeys = {"loss_scale", "initial_scale_power",    "loss_scale_window",
                                                 "hysteresis", "consecutive_hysteresis", "min_loss_scale"};
  return kKeys;
}

// An integer of the fp16 block, as DeepSpeed's pydantic model takes it (an integral float such as 2.0 too; a
// bool, a fraction or text refused), within [min, max].
std::int64_t fp16_integer(const JsonFile& f, const Json& v, const std::string& key, std::int64_t min,
                          std::int64_t max, const char* expected) {
  const std::string path = "fp16." + key;
  double d = 0;
  const bool number = v.is_number() && !v.is_boolean();
  if (number) d = v.get<double>();
  if (!number || !std::isfinite(d) || std::floor(d) != d || d < static_cast<double>(min) ||
      d > static_cast<double>(max)) {
    f.fail(path, key,
           fmt::format("{}: expected {}, got {} (DeepSpeed refuses it too)", path, expected, v.dump()));
  }
  return static_cast<std::int64_t>(d);
}

// DeepSpeed's fp16 loss scaler settings, followed when the fp16 block is in effect (DeepSpeed's defaults
// fill what it leaves out, as ZeroConfig's defaults are), validated as DeepSpeed validates them.
void read_loss_scaler(const JsonFile& f, const Json& root, Config& c) {
  if (!root.contains("fp16")) return;
  const Json& b = root.at("fp16");
  if (!block_in_effect(b, {"fp16", MixedPrecision::Fp16}, c)) return;
  ZeroConfig& z = c.zero;
  if (b.contains("loss_scale")) {
    const Json& v = b.at("loss_scale");
    const bool number = v.is_number() && !v.is_boolean();
    if (!number || !std::isfinite(v.get<double>()) || v.get<double>() < 0) {
      f.fail(
          "fp16.loss_scale", "loss_scale",
          fmt::format("fp16.loss_scale: expected 0 (dynamic loss scaling) or a positive, finite scale, got "
                      "{} (DeepSpeed refuses it too)",
                      v.dump()));
    }
    z.fp16_loss_scale = v.get<double>();
  }
  const bool dynamic = z.fp16_loss_scale == 0;
  constexpr auto kMax = std::numeric_limits<std::int64_t>::max();
  if (b.contains("initial_scale_power")) {
    z.fp16_initial_scale_power = static_cast<int>(
        fp16_integer(f, b.at("initial_scale_power"), "initial_scale_power", -126, 127,
                     "an integer from -126 to 127 (the first scale 2^power is a float32 here)"));
  }
  // DeepSpeed checks window and minimum only for dynamic scaling; a static scale never reads them.
  if (b.contains("loss_scale_window")) {
    z.fp16_loss_scale_window =
        fp16_integer(f, b.at("loss_scale_window"), "loss_scale_window",
                     dynamic ? 1 : std::numeric_limits<std::int64_t>::min(), kMax,
                     dynamic ? "a positive integer with dynamic loss scaling" : "an integer");
    if (!dynamic) z.fp16_loss_scale_window = std::max<std::int64_t>(z.fp16_loss_scale_window, 1);
  }
  if (b.contains("hysteresis")) {
    z.fp16_hysteresis = fp16_integer(f, b.at("hysteresis"), "hysteresis", 1, kMax, "a positive integer");
  }
  if (b.contains("consecutive_hysteresis")) {
    z.fp16_consecutive_hysteresis = boolean_value(f, b.at("consecutive_hysteresis"),
                                                  "fp16.consecutive_hysteresis", "consecutive_hysteresis");
  }
  if (b.contains("min_loss_scale")) {
    const std::int64_t min = fp16_integer(
        f, b.at("min_loss_scale"), "min_loss_scale", dynamic ? 1 : std::numeric_limits<std::int64_t>::min(),
        kMax, dynamic ? "a positive integer with dynamic loss scaling" : "an integer");
    z.fp16_min_loss_scale = static_cast<double>(std::max<std::int64_t>(min, 1));
  }
}

// For each fp16 / bf16 block in effect, a notice naming every setting whose value (the file's, or
// DeepSpeed's default) differs from what accelerate-cpp does, with the file's value and ours.
void report_precision_settings(const JsonFile& f, const Json& root, Config& c) {
  for (const PrecisionBlock& block : precision_blocks(root)) {
    const Json& b = root.at(block.name);
    if (!block_in_effect(b, block, c)) continue;
    const bool is_auto_enabled = is_auto(b.at("enabled"));
    const std::string kind = block.mode == MixedPrecision::Fp16 ? "fp16" : "bf16";
    std::vector<std::string> items;
    std::vector<std::string> known;
    if (block.mode == MixedPrecision::Fp16) known = loss_scaler_keys();
    for (const PrecisionSetting& s : precision_settings()) {
      if (kind != s.block) continue;
      known.emplace_back(s.key);
      const bool present = b.contains(s.key);
      if (!present && s.deepspeed_default.is_null()) continue;
      const Json& value = present ? b.at(s.key) : s.deepspeed_default;
      if (!s.ours.is_null() && value == s.ours) continue;
      const std::string note =
          present ? std::string()
                  : fmt::format("DeepSpeed's default{}; ", *s.since ? std::string(" ") + s.since : "");
      items.push_back(
          fmt::format("{}.{} {} ({}ours: {})", block.name, s.key, value.dump(), note, s.ours_text));
    }
    for (const auto& [key, value] : b.items()) {
      if (key != "enabled" && std::find(known.begin(), known.end(), key) == known.end())
        items.push_back(fmt::format("{}.{} {} (no effect here)", block.name, key, value.dump()));
    }
    if (items.empty()) continue;
    const std::string why = is_auto_enabled ? fmt::format("{}.enabled \"auto\" follows mixed_precision: {}",
                                                          block.name, to_string(block.mode))
                                            : fmt::format("{}.enabled true", block.name);
    const std::string what =
        block.mode == MixedPrecision::Fp16
            ? "DeepSpeed's fp16 differ from accelerate-cpp's (fp16 autocast over fp32 parameters, with "
              "DeepSpeed's loss scaler as the block sets it)"
            : "DeepSpeed's bf16 differ from accelerate-cpp's (bf16 autocast, parameters, gradients and "
              "optimizer state in fp32)";
    c.notices.push_back(fmt::format("{}: {} is in effect ({}) and these settings of {}: {}", f.path(), kind,
                                    why, what, join(items)));
  }
}

// Mixed precision: "auto" follows the YAML's mixed_precision; true sets it (and must not contradict it).
void apply_mixed_precision(const JsonFile& f, const Json& root, const DeepSpeedJsonContext& context,
                           Config& c) {
  const std::optional<MixedPrecision> wanted = requested_precision(f, root);
  if (wanted) {
    if (context.mixed_precision_set && c.mixed_precision != *wanted) {
      f.fail(
          *wanted == MixedPrecision::Fp16 ? "fp16.enabled" : "bf16.enabled", "enabled",
          fmt::format("{} enables {} but the config's mixed_precision is '{}' ({}); make them agree or set "
                      "\"enabled\": \"auto\"",
                      f.path(), to_string(*wanted), to_string(c.mixed_precision), context.source));
    }
    c.mixed_precision = *wanted;
    c.origins["mixed_precision"] =
        fmt::format("{} ({}.enabled)", f.path(), *wanted == MixedPrecision::Fp16 ? "fp16" : "bf16");
  }
  report_precision_settings(f, root, c);
}

// DeepSpeed 0.17.2+'s torch_autocast block (runtime/config.py get_torch_autocast_*,
// runtime/torch_autocast.py): the engine's forward runs under torch.autocast(dtype) over fp32 parameters,
// which is what accelerate-cpp's mixed precision is. The dtype spellings are DeepSpeed's DtypeEnum's.
struct AutocastDtype {
  std::vector<std::string> spellings;
  const char* torch_name;
};
const std::vector<AutocastDtype>& autocast_dtypes() {
  static const std::vector<AutocastDtype> kDtypes = {
      {{"torch.float16", "fp16", "float16", "half"}, "torch.float16"},
      {{"torch.bfloat16", "bf16", "bfloat16"}, "torch.bfloat16"},
      {{"torch.float32", "fp32", "float32", "float"}, "torch.float32"},
      {{"torch.int8", "int8"}, "torch.int8"},
  };
  return kDtypes;
}

// torch_autocast.dtype as torch names it ("torch.bfloat16"), validated as DeepSpeed's DtypeEnum does.
std::string autocast_dtype(const JsonFile& f, const Json& v) {
  std::vector<std::string> accepted;
  for (const AutocastDtype& d : autocast_dtypes()) {
    for (const std::string& s : d.spellings) {
      if (v.is_string() && v.get<std::string>() == s) return d.torch_name;
      accepted.push_back(fmt::format("\"{}\"", s));
    }
  }
  f.fail("torch_autocast.dtype", "dtype",
         fmt::format(
             "torch_autocast.dtype: {} is not a dtype DeepSpeed knows (it refuses it too); use one of {}",
             v.dump(), join(accepted)));
}

// lower_precision_safe_modules: class names, as DeepSpeed's get_lower_precision_safe_modules requires.
std::vector<std::string> autocast_modules(const JsonFile& f, const Json& b) {
  // DeepSpeed's default (torch_autocast.py LOWER_PRECISION_SAFE_MODULES), as its engine names it.
  std::vector<std::string> modules = {"torch.nn.modules.linear.Linear", "torch.nn.modules.conv.Conv1d",
                                      "torch.nn.modules.conv.Conv2d", "torch.nn.modules.conv.Conv3d"};
  if (!b.contains("lower_precision_safe_modules")) return modules;
  const Json& v = b.at("lower_precision_safe_modules");
  const bool strings =
      v.is_array() && std::all_of(v.begin(), v.end(), [](const Json& item) { return item.is_string(); });
  if (!strings) {
    f.fail("torch_autocast.lower_precision_safe_modules", "lower_precision_safe_modules",
           fmt::format("torch_autocast.lower_precision_safe_modules: expected a list of class names such as "
                       "[\"torch.nn.Linear\"], got {} (DeepSpeed refuses it too)",
                       v.dump()));
  }
  modules.clear();
  for (const Json& item : v)
    modules.push_back(item.get<std::string>());
  return modules;
}

// An fp16 / bf16 block that enables its precision beside torch_autocast: true, or "auto" that the YAML's
// mixed_precision resolves to true (Accelerate fills it so).
std::optional<PrecisionBlock> enabled_block(const Json& root, const DeepSpeedJsonContext& context,
                                            const Config& c) {
  for (const PrecisionBlock& block : precision_blocks(root)) {
    const Json& b = root.at(block.name);
    if (!b.is_object() || !b.contains("enabled")) continue;
    const Json& e = b.at("enabled");
    if ((e.is_boolean() && e.get<bool>()) ||
        (is_auto(e) && context.mixed_precision_set && c.mixed_precision == block.mode))
      return block;
  }
  return std::nullopt;
}

// The notices of an enabled torch_autocast: what DeepSpeed does that accelerate-cpp does another way.
void note_torch_autocast(const JsonFile& f, const std::string& dtype, const std::vector<std::string>& modules,
                         Config& c) {
  if (dtype == "torch.float32") {
    c.notices.push_back(fmt::format(
        "{}: torch_autocast.dtype torch.float32 runs every op in fp32 (CUDA autocast in fp32; CPU autocast "
        "disables itself): mixed_precision is no",
        f.path()));
    return;
  }
  c.notices.push_back(fmt::format(
      "{}: torch_autocast.lower_precision_safe_modules ({}): DeepSpeed reduces (and ZeRO-3 gathers) the "
      "parameters and gradients of these classes in {}; here every gradient is reduced in fp32 (set "
      "ddp_comm_hook: {} in the YAML to compress them all), so results differ only by that rounding",
      f.path(), join(modules), dtype, dtype == "torch.float16" ? "fp16" : "bf16"));
  if (dtype == "torch.float16") {
    c.notices.push_back(fmt::format(
        "{}: torch_autocast.dtype torch.float16: DeepSpeed scales the loss with torch.amp.GradScaler "
        "(65536, x2 after 2000 clean steps in a row, x0.5 on each overflow); here fp16 runs DeepSpeed's fp16 "
        "loss scaler as the fp16 block sets it (its defaults: 65536, x2 after 1000 clean steps, x0.5 after 2 "
        "overflows, minimum 1), so skipped steps and the scale can differ",
        f.path()));
  }
}

// torch_autocast: enabled true sets mixed_precision from its dtype (fp16, bf16; fp32 means no), after
// checking it agrees with the fp16 / bf16 blocks and the YAML; the rest DeepSpeed does differently is
// noticed.
void apply_torch_autocast(const JsonFile& f, const Json& root, const DeepSpeedJsonContext& context,
                          Config& c) {
  if (!root.contains("torch_autocast") || root.at("torch_autocast").is_null()) return;
  const Json& b = root.at("torch_autocast");
  if (!b.is_object()) {
    f.fail("torch_autocast", "torch_autocast",
           fmt::format("torch_autocast: expected an object such as {{\"enabled\": true, \"dtype\": "
                       "\"bfloat16\"}}, got {}",
                       b.dump()));
  }
  // DeepSpeed reads dtype and the module list whether enabled or not, and refuses bad ones either way.
  const std::optional<std::string> dtype =
      b.contains("dtype") ? std::optional<std::string>(autocast_dtype(f, b.at("dtype"))) : std::nullopt;
  const std::vector<std::string> modules = autocast_modules(f, b);
  std::vector<std::string> unknown;
  for (const auto& [key, value] : b.items()) {
    if (key != "enabled" && key != "dtype" && key != "lower_precision_safe_modules")
      unknown.push_back(fmt::format("torch_autocast.{}", key));
  }
  if (!unknown.empty())
    c.notices.push_back(
        fmt::format("{}: unknown key(s) ignored (DeepSpeed ignores them too): {}", f.path(), join(unknown)));
  if (!b.contains("enabled") || !boolean_value(f, b.at("enabled"), "torch_autocast.enabled", "enabled"))
    return;
  if (!dtype) {
    f.fail("torch_autocast.enabled", "enabled",
           "torch_autocast has no dtype: DeepSpeed then autocasts in torch's default for the device (float16 "
           "on CUDA, bfloat16 on CPU), so the file means different precisions on different machines; set "
           "\"dtype\": \"bfloat16\" (or \"float16\")");
  }
  if (*dtype == "torch.int8") {
    f.fail("torch_autocast.dtype", "dtype",
           "torch_autocast.dtype torch.int8: torch.autocast has no int8 mode (CPU autocast disables itself, "
           "CUDA casts matmul inputs to int8); set \"dtype\": \"bfloat16\" or \"float16\"");
  }
  const MixedPrecision mode = *dtype == "torch.float16"    ? MixedPrecision::Fp16
                              : *dtype == "torch.bfloat16" ? MixedPrecision::Bf16
                                                           : MixedPrecision::No;
  std::string origin = fmt::format("{} (torch_autocast.dtype)", f.path());
  if (const std::optional<PrecisionBlock> block = enabled_block(root, context, c)) {
    if (block->mode != mode) {
      f.fail("torch_autocast.dtype", "dtype",
             fmt::format("torch_autocast.dtype {} contradicts {}.enabled: the forward would autocast in one "
                         "precision and the {} engine keep the other; make them agree or disable one",
                         *dtype, block->name, block->name));
    }
    origin = fmt::format("{} (torch_autocast.dtype, {}.enabled)", f.path(), block->name);
  }
  if (context.mixed_precision_set && c.mixed_precision != mode) {
    f.fail("torch_autocast.dtype", "dtype",
           fmt::format("{} autocasts in {} (torch_autocast.dtype) but the config's mixed_precision is '{}' "
                       "({}); make them agree",
                       f.path(), *dtype, to_string(c.mixed_precision), context.source));
  }
  c.mixed_precision = mode;
  c.origins["mixed_precision"] = origin;
  note_torch_autocast(f, *dtype, modules, c);
}

// Gradient accumulation: "auto" (or absent) follows the YAML; a number must agree with it.
void apply_gradient_accumulation(const JsonFile& f, const Json& root, const DeepSpeedJsonContext& context,
                                 Config& c) {
  std::optional<std::uint64_t> gas;
  if (root.contains("gradient_accumulation_steps")) {
    gas = count_or_auto(f, root.at("gradient_accumulation_steps"), "gradient_accumulation_steps",
                        "gradient_accumulation_steps");
  }
  if (!gas) return;
  if (*gas < 1)
    f.fail("gradient_accumulation_steps", "gradient_accumulation_steps",
           "gradient_accumulation_steps must be at least 1");
  // Checked before narrowing: 4294967296 would wrap to 0 and divide by zero later.
  if (*gas > static_cast<std::uint64_t>(std::numeric_limits<int>::max())) {
    f.fail("gradient_accumulation_steps", "gradient_accumulation_steps",
           fmt::format("gradient_accumulation_steps {} is out of range: at most {}", *gas,
                       std::numeric_limits<int>::max()));
  }
  if (context.gradient_accumulation_set &&
      static_cast<std::uint64_t>(c.gradient_accumulation_steps) != *gas) {
    f.fail("gradient_accumulation_steps", "gradient_accumulation_steps",
           fmt::format(
               "gradient_accumulation_steps {} disagrees with the config's gradient_accumulation_steps {} "
               "({}); make them agree or set it to \"auto\"",
               *gas, c.gradient_accumulation_steps, context.source));
  }
  c.gradient_accumulation_steps = static_cast<int>(*gas);
  c.origins["gradient_accumulation_steps"] = fmt::format("{} (gradient_accumulation_steps)", f.path());
}

// Batch sizes: train_batch_size = micro batch x accumulation x world, with DeepSpeed's meaning; one missing
// value is derived from the others, as DeepSpeed does.
void check_batch_sizes(const JsonFile& f, const Json& root, Config& c) {
  std::optional<std::uint64_t> total, micro;
  if (root.contains("train_batch_size"))
    total = count_or_auto(f, root.at("train_batch_size"), "train_batch_size", "train_batch_size");
  if (root.contains("train_micro_batch_size_per_gpu")) {
    micro = count_or_auto(f, root.at("train_micro_batch_size_per_gpu"), "train_micro_batch_size_per_gpu",
                          "train_micro_batch_size_per_gpu");
  }
  // DeepSpeed's _batch_assertion: a batch of 0 samples trains nothing.
  const auto refuse_zero = [&f](const char* key, const std::optional<std::uint64_t>& value,
                                const char* what) {
    if (value && *value == 0) {
      f.fail(key, key,
             fmt::format("{} is 0: it has to be greater than 0, as DeepSpeed requires; set the samples {}, "
                         "or \"auto\"",
                         key, what));
    }
  };
  refuse_zero("train_batch_size", total, "of one optimizer step over all ranks");
  refuse_zero("train_micro_batch_size_per_gpu", micro, "per rank and micro-step");
  // The ranks of a tensor-parallel group (AutoTP) read the same batches: DeepSpeed's world here is the
  // data-parallel size.
  const int tp = std::max(1, c.tensor_parallel_size);
  const auto world =
      static_cast<std::uint64_t>(c.num_processes % tp == 0 ? c.num_processes / tp : c.num_processes);
  const auto steps = static_cast<std::uint64_t>(c.gradient_accumulation_steps);
  // micro x steps x world, refused where it does not fit 64 bits (it would wrap and compare wrongly).
  std::uint64_t product = 0;
  if (micro &&
      (__builtin_mul_overflow(*micro, steps, &product) || __builtin_mul_overflow(product, world, &product))) {
    f.fail(
        "train_micro_batch_size_per_gpu", "train_micro_batch_size_per_gpu",
        fmt::format("train_micro_batch_size_per_gpu {} is out of range: times gradient_accumulation_steps {} "
                    "and world size {} it exceeds 2^64",
                    *micro, steps, world));
  }
  if (total && micro && *total != product) {
    f.fail(
        "train_batch_size", "train_batch_size",
        fmt::format(
            "train_batch_size {} is not train_micro_batch_size_per_gpu {} x gradient_accumulation_steps {} x "
            "world size {} (= {}); fix one of them or set train_batch_size to \"auto\"",
            *total, *micro, steps, world, product));
  }
  if (total && !micro) {
    if (*total % (steps * world) != 0) {
      f.fail("train_batch_size", "train_batch_size",
             fmt::format(
                 "train_batch_size {} is not divisible by gradient_accumulation_steps {} x world size {}; "
                 "the micro batch per rank would not be whole",
                 *total, steps, world));
    }
    micro = *total / (steps * world);
  }
  if (micro) {
    c.notices.push_back(
        fmt::format("{}: train_micro_batch_size_per_gpu is {}: give the prepared data loader that "
                    "batch size (the loop's loader decides the batch here)",
                    f.path(), *micro));
  }
}

// Clipping: "auto" is Accelerate's 1.0; absent is DeepSpeed's 0 (off).
void apply_gradient_clipping(const JsonFile& f, const Json& root, Config& c) {
  c.zero.gradient_clipping = 0.0;
  if (!root.contains("gradient_clipping")) {
    c.origins["gradient_clipping"] =
        fmt::format("DeepSpeed's default (0: off), {} does not set it", f.path());
    return;
  }
  const Json& v = root.at("gradient_clipping");
  c.origins["gradient_clipping"] = fmt::format("{} (gradient_clipping)", f.path());
  if (is_auto(v)) {
    c.zero.gradient_clipping = 1.0;
    c.origins["gradient_clipping"] =
        fmt::format("{} (gradient_clipping: auto, filled with 1.0 as Accelerate does)", f.path());
  } else if (v.is_number() && v.get<double>() >= 0) {
    c.zero.gradient_clipping = v.get<double>();
  } else {
    f.fail("gradient_clipping", "gradient_clipping",
           fmt::format("gradient_clipping: expected a non-negative number or \"auto\", got {}", v.dump()));
  }
}

// What a zero_optimization block reports as notices: keys with no effect, and "auto" values left to
// DeepSpeed's defaults.
struct ZeroNotices {
  std::vector<std::string> no_effect, autos;
};

// DeepSpeed's defaults for what zero_optimization leaves out; clipping and activation checkpointing as read.
ZeroConfig zero_defaults(const Config& c) {
  ZeroConfig z;
  z.stage = 0;
  z.overlap_comm = false;
  z.reduce_bucket_size = 500000000;
  z.allgather_bucket_size = 500000000;
  z.stage3_prefetch_bucket_size = 50000000;
  z.gradient_clipping = c.zero.gradient_clipping;
  z.activation_checkpointing = c.zero.activation_checkpointing;
  return z;
}

// reduce_bucket_size, allgather_bucket_size, (stage3_)prefetch_bucket_size: a byte count or "auto". 0 is
// valid, as in DeepSpeed's schema (ge=0): reduce_bucket_size 0 reduces each parameter on its own
// (stage_1_and_2.py and stage3.py start a new bucket when elements + numel > reduce_bucket_size),
// prefetch_bucket_size 0 prefetches nothing (partitioned_param_coordinator.py: `if prefetch_bucket_sz > 0`).
void read_bucket_size(const JsonFile& f, const std::string& key, const Json& v, const std::string& p,
                      ZeroConfig& z, ZeroNotices& notes) {
  const auto n = count_or_auto(f, v, p, key);
  if (key == "allgather_bucket_size") {
    // Accelerate leaves "auto" here to DeepSpeed, whose default applies.
    if (n)
      z.allgather_bucket_size = *n;
    else
      notes.autos.push_back(key);
  } else {
    // "auto" (nullopt) is resolved from the model at prepare, as Accelerate does (hidden_size²).
    (key == "reduce_bucket_size" ? z.reduce_bucket_size : z.stage3_prefetch_bucket_size) = n;
  }
}

// One key of zero_optimization (already checked against zero_keys()).
void read_zero_key(const JsonFile& f, const std::string& key, const Json& v, ZeroConfig& z,
                   ZeroNotices& notes) {
  const std::string p = "zero_optimization." + key;
  if (key == "stage") {
    // "auto" is Accelerate's plugin zero_stage: 2 unless set (the YAML may not set it next to a JSON file).
    const auto s = is_auto(v) ? std::optional<std::uint64_t>(2) : count_or_auto(f, v, p, key);
    if (!s || *s > 3) f.fail(p, key, fmt::format("{}: expected 0, 1, 2 or 3, got {}", p, v.dump()));
    z.stage = static_cast<int>(*s);
  } else if (key == "offload_optimizer") {
    read_offload_optimizer(f, v, p, z, notes.no_effect);
  } else if (key == "offload_param") {
    read_offload_param(f, v, p, z, notes.no_effect);
  } else if (key == "overlap_comm") {
    z.overlap_comm = boolean_value(f, v, p, key);
  } else if (key == "sub_group_size") {
    // 0 is valid (ge=0): every parameter closes its own sub-group (stage3.py _create_fp16_sub_groups), as
    // it does in our stages 1-2.
    const auto n = count_or_auto(f, v, p, key);
    if (n) z.sub_group_size = *n;
  } else if (key == "reduce_bucket_size" || key == "allgather_bucket_size" ||
             key == "stage3_prefetch_bucket_size" || key == "prefetch_bucket_size") {
    read_bucket_size(f, key, v, p, z, notes);
  } else if (key == "stage3_gather_16bit_weights_on_model_save" ||
             key == "gather_16bit_weights_on_model_save" ||
             key == "stage3_gather_fp16_weights_on_model_save") {
    // "auto" (Accelerate's ZeRO-3 templates) is filled from the plugin's zero3_save_16bit_model, false unless
    // set, and Accelerate refuses that key in the YAML next to a JSON file; accelerator.py's config_kwargs
    // fill it with False at prepare too.
    z.zero3_save_16bit_model = is_auto(v) ? false : boolean_value(f, v, p, key);
  } else if (key == "zero_hpz_partition_size") {
    // ZeRO++ hpZ (DeepSpeed: ge=0, default 1; 0 and 1 both mean off). Stage 3 only: DeepSpeed ignores it
    // below (a notice says so here).
    const auto n = count_or_auto(f, v, p, key);
    if (n && *n > static_cast<std::uint64_t>(std::numeric_limits<int>::max()))
      f.fail(p, key, fmt::format("{}: {} is not a number of ranks", p, v.dump()));
    z.hpz_partition_size = n ? std::max(1, static_cast<int>(*n)) : 1;
  } else if (key == "contiguous_gradients" || key == "reduce_scatter" || key == "allgather_partitions") {
    // What accelerate-cpp always does (flat contiguous buffers, reduce-scatter, all-gather): no notice.
  } else {
    notes.no_effect.push_back(key);
  }
}

// The zero_optimization block: its keys and those of its offload blocks are checked first, then read.
void read_zero_optimization(const JsonFile& f, const Json& zo, ZeroConfig& z, ZeroNotices& notes) {
  if (!zo.is_object())
    f.fail("zero_optimization", "zero_optimization", "zero_optimization: expected an object");
  refuse_unsupported(f, zo, "zero_optimization");
  check_keys(f, zo, "zero_optimization", zero_keys());
  if (zo.contains("offload_param"))
    check_keys(f, zo.at("offload_param"), "zero_optimization.offload_param", offload_param_keys());
  if (zo.contains("offload_optimizer")) {
    check_keys(f, zo.at("offload_optimizer"), "zero_optimization.offload_optimizer",
               offload_optimizer_keys());
  }
  for (const auto& [key, v] : zo.items()) {
    if (find_unsupported(kDeepSpeedJson, "zero_optimization." + key) == nullptr)
      read_zero_key(f, key, v, z, notes);
  }
  if (!zo.contains("overlap_comm"))
    z.overlap_comm = z.stage == 3;  // DeepSpeed: on for stage 3, off otherwise
  // Stages 1-2 step the optimizer in sub-groups; stage 3 here steps each unit's own slice.
  if (zo.contains("sub_group_size") && z.stage == 3) notes.no_effect.push_back("sub_group_size (stage 3)");
  if (z.hpz_partition_size > 1 && z.stage != 3) {
    notes.no_effect.push_back(fmt::format("zero_hpz_partition_size (stage {}; hpZ is stage 3's)", z.stage));
    z.hpz_partition_size = 1;
  }
}

// zero_optimization with DeepSpeed's defaults for what the file leaves out; replaces c.zero.
void apply_zero_optimization(const JsonFile& f, const Json& root, Config& c) {
  ZeroConfig z = zero_defaults(c);
  ZeroNotices notes;
  if (root.contains("zero_optimization")) read_zero_optimization(f, root.at("zero_optimization"), z, notes);
  if (!notes.autos.empty()) {
    c.notices.push_back(
        fmt::format("{}: zero_optimization.{} \"auto\": DeepSpeed's default is used (set a number to choose)",
                    f.path(), join(notes.autos, ", zero_optimization.")));
  }
  if (!notes.no_effect.empty()) {
    c.notices.push_back(fmt::format("{}: zero_optimization settings with no effect in accelerate-cpp: {}",
                                    f.path(), join(notes.no_effect)));
  }
  z.config_file = f.path();
  z.zero3_init_flag = c.zero.zero3_init_flag;
  c.zero = z;
  settle_stage1_reduce_bucket(c, f.path() + ": zero_optimization.reduce_bucket_size");
  note_sub_group_size_zero(c, f.path() + ": zero_optimization.sub_group_size");
}

}  // namespace

void settle_stage1_reduce_bucket(Config& c, const std::string& key) {
  if (c.zero.stage != 1 || c.zero.reduce_bucket_size != std::optional<std::uint64_t>(0)) return;
  c.zero.reduce_bucket_size = std::nullopt;
  c.notices.push_back(fmt::format(
      "{} is 0: DeepSpeed reduces each parameter's gradient on its own; accelerate-cpp's stage 1 "
      "reduce-scatters the flat gradients after backward in chunks, here of about one weight matrix "
      "(hidden_size² elements, as \"auto\"); results are the same",
      key));
}

void note_sub_group_size_zero(Config& c, const std::string& key) {
  if (c.zero.sub_group_size != 0 || c.zero.stage < 1 || c.zero.stage > 2) return;
  c.notices.push_back(fmt::format(
      "{} is 0: every parameter is an optimizer sub-group of its own (DeepSpeed accepts 0 too), so the "
      "optimizer steps one parameter at a time, each with its own master slice: slow with many small "
      "parameters; the default is {} elements",
      key, ZeroConfig{}.sub_group_size));
}

std::vector<UnsupportedKey> deepspeed_json_unsupported() {
  std::vector<UnsupportedKey> rows;
  // Refused unless their value asks for nothing: each changes what DeepSpeed computes (precision, the
  // gradient's scale, the data, the batch sizes, the model) in a way accelerate-cpp would not follow.
  auto refused = [&rows](const char* path, AsksNothingWhen when, const char* neutral, const char* what,
                         const char* instead) {
    rows.push_back({kDeepSpeedJson, path, true, when, neutral, what, instead});
  };
  // Ignored with a notice (listed in one line per file): logging, profiling, launcher and checkpoint-engine
  // settings, and settings whose job is done here another way (the loop's own optimizer and scheduler).
  auto noticed = [&rows](const char* path, const char* what, const char* instead) {
    rows.push_back({kDeepSpeedJson, path, false, AsksNothingWhen::Never, "", what, instead});
  };
  refused("zero_optimization.zenflow", AsksNothingWhen::Null, "",
          "ZenFlow (DeepSpeed 0.17.5+) updates the most important gradient columns on the GPU every step and "
          "applies the rest later from the CPU optimizer, asynchronously (topk_ratio, update_interval, ...)",
          "remove it: zero_optimization.offload_optimizer with device cpu offloads the whole optimizer step, "
          "synchronously");
  refused("gradient_allreduce_op", AsksNothingWhen::Value, "mean",
          "\"sum\" keeps the sum of the ranks' gradients instead of their mean (DeepSpeed after 0.19.5)",
          "remove it (or set \"mean\"): gradients are averaged over the ranks here");
  refused("amp", AsksNothingWhen::Disabled, "", "NVIDIA Apex AMP mixed precision (opt_level, ...)",
          "remove it and set mixed_precision: fp16 or bf16 in the YAML");
  refused("elasticity", AsksNothingWhen::Disabled, "",
          "elastic training: DeepSpeed picks train_batch_size, the micro batch and accumulation from the GPU "
          "count",
          "remove it: batch sizes come from the YAML and your data loader");
  refused("data_efficiency", AsksNothingWhen::Disabled, "",
          "curriculum data sampling and random layer-token drop change which data each step sees",
          "remove it (or set enabled: false)");
  refused("curriculum_learning", AsksNothingWhen::Disabled, "",
          "legacy curriculum learning shortens sequences early in training",
          "remove it (or set enabled: false)");
  refused("progressive_layer_drop", AsksNothingWhen::Disabled, "",
          "progressive layer dropping skips transformer layers on a schedule (theta, gamma)",
          "remove it (or set enabled: false)");
  refused("quantize_training", AsksNothingWhen::Disabled, "", "MoQ quantizes the weights during training",
          "remove it (or set enabled: false)");
  refused("compression_training", AsksNothingWhen::Empty, "",
          "DeepSpeed Compression prunes, quantizes or distils the model during training",
          "remove it (or leave it empty)");
  noticed("optimizer", "DeepSpeed builds the optimizer named here (type, params)",
          "the optimizer is the LibTorch one your loop creates and prepares");
  noticed("scheduler", "DeepSpeed builds the learning-rate scheduler named here",
          "schedulers are the LibTorch ones your loop creates");
  noticed("zero_allow_untested_optimizer", "lets ZeRO wrap an optimizer DeepSpeed has not tested",
          "every LibTorch optimizer can be sharded");
  noticed("zero_force_ds_cpu_optimizer", "requires DeepSpeed's CPU Adam with optimizer offload",
          "CPU offload steps your own optimizer on the CPU shard");
  noticed("aio", "asynchronous I/O settings of NVMe offload (block size, queue depth, threads)",
          "NVMe offload runs one I/O thread per rank with O_DIRECT reads and writes of whole sub-groups; "
          "offload_optimizer.buffer_count, pipeline_read and pipeline_write are read");
  noticed("activation_checkpointing",
          "how deepspeed.checkpointing partitions, offloads and checks the activations of a model that "
          "checkpoints through it",
          "use deepspeed_config.activation_checkpointing in the YAML");
  noticed("wall_clock_breakdown", "times forward, backward and step",
          "use accelerator.profile / the benchmarks");
  noticed("steps_per_print", "how often DeepSpeed logs progress", "the loop prints what it wants");
  for (const char* monitor : {"tensorboard", "wandb", "csv_monitor"})
    noticed(monitor, "DeepSpeed's monitor writes its metrics there",
            "experiment trackers are log_with in the YAML");
  noticed("comms_logger", "logs every collective", "the Communicator counts bytes per collective");
  noticed("flops_profiler", "profiles the FLOPs of one step", "no FLOPs profiler");
  noticed("communication_data_type", "the dtype gradients are reduced in",
          "gradients are communicated in their own dtype (ddp_comm_hook: fp16 or bf16 compresses them)");
  noticed("prescale_gradients", "divides gradients before the reduction",
          "gradients are averaged after the reduction");
  noticed("gradient_predivide_factor", "divides gradients by this factor before the reduction",
          "gradients are averaged after the reduction");
  noticed("sparse_gradients", "reduces embedding gradients as sparse tensors",
          "sparse gradients are not supported");
  noticed("dump_state", "prints the engine's state at start", "no state dump");
  noticed("checkpoint", "checkpoint tag validation, universal and parallel checkpoint writing",
          "checkpoints are save_state / load_state");
  noticed("data_types", "grad_accum_dtype: the dtype gradients accumulate in",
          "gradient accumulation dtype follows the parameters");
  noticed("pipeline", "settings of DeepSpeed's PipelineModule engine",
          "pipeline parallelism is configured in the YAML (pipeline_config)");
  noticed("memory_breakdown", "logs memory use", "use accelerator.memory_report()");
  noticed("disable_allgather", "legacy ZeRO-1: broadcast parameters instead of all-gathering them",
          "not applicable");
  noticed("seq_parallel_communication_data_type", "the dtype of Ulysses sequence parallelism's all-to-alls",
          "sequence parallelism is not supported");
  noticed("dataloader_drop_last", "DeepSpeed's own data loader drops the last incomplete batch",
          "the data loader is yours (even_batches decides the last round)");
  noticed("autotuning",
          "DeepSpeed's autotuner searches batch and ZeRO settings before training, from its launcher",
          "no autotuner: the config says what runs");
  noticed("compile", "DeepSpeed's torch.compile integration (DeepCompile)", "LibTorch has no torch.compile");
  noticed("nebula", "the Azure Nebula checkpoint engine", "checkpoints are save_state / load_state");
  noticed("sparse_attention", "configures the sparse attention modules a DeepSpeed model builds",
          "no sparse attention modules here");
  noticed("hybrid_engine", "DeepSpeed-Chat's inference engine for RLHF generation", "not applicable");
  return rows;
}

// DeepSpeed AutoTP training (`tensor_parallel: {autotp_size: N}`, deepspeed/runtime/tensor_parallel/config.py
// TPTrainingConfig; 0 or 1 is off): the tensor-parallel size, as parallelism_config_tp_size (the program
// splits its model over accelerator.tensor_parallel_group(): examples/llm/finetune does for the accel::llm
// family, as DeepSpeed's tp_model_init does for transformers' models). Keys that only tune DeepSpeed's own
// kernels are listed as having no effect; a custom partition plan is refused.
void apply_autotp(const JsonFile& f, const Json& root, Config& c) {
  if (!root.contains("tensor_parallel")) return;
  const Json& block = root.at("tensor_parallel");
  if (block.is_null()) return;
  if (!block.is_object()) f.fail("tensor_parallel", "tensor_parallel", "tensor_parallel: expected an object");
  std::vector<std::string> no_effect;
  bool enabled = true;
  for (const auto& [key, v] : block.items()) {
    const std::string p = "tensor_parallel." + key;
    if (key == "enabled") {
      enabled = boolean_value(f, v, p, key);
    } else if (key == "vocab_parallel_lm_head") {
      // DeepSpeed's default (false) keeps lm_head whole, as here.
      if (boolean_value(f, v, p, key))
        f.fail(p, key,
               fmt::format(
                   "{}: true is not supported by accelerate-cpp: lm_head and the embedding stay whole on "
                   "every rank of a tensor-parallel group; set it to false or remove it",
                   p));
    } else if (key == "vocab_parallel_ce_backend") {
      no_effect.push_back(key);
    } else if (key == "autotp_size") {
      const auto n = count_or_auto(f, v, p, key);
      if (!n || *n > static_cast<std::uint64_t>(std::numeric_limits<int>::max()))
        f.fail(p, key, fmt::format("{}: expected a number of ranks, got {}", p, v.dump()));
      c.tensor_parallel_size = std::max(1, static_cast<int>(*n));
      c.origins["tensor_parallel_size"] = fmt::format("{} (tensor_parallel.autotp_size)", f.path());
    } else if (key == "tp_overlap_comm" || key == "keep_module_on_host" || key == "tp_grain_size" ||
               key == "dtype" || key == "preset_model") {
      no_effect.push_back(key);
    } else {
      f.fail(p, key,
             fmt::format("{} is not supported by accelerate-cpp: its AutoTP splits the accel::llm models' "
                         "projections by one fixed plan (q/k/v/gate/up by output rows, o/down by input "
                         "columns; embedding, norms and lm_head whole); remove it",
                         p));
    }
  }
  if (!enabled) c.tensor_parallel_size = 1;
  if (!no_effect.empty()) {
    c.notices.push_back(fmt::format("{}: tensor_parallel settings with no effect in accelerate-cpp: {}",
                                    f.path(), join(no_effect)));
  }
}

// AutoTP composes with ZeRO stages 0-2 over the data-parallel replicas, as in DeepSpeed (whose AutoTP
// training refuses stage 3 too).
void check_autotp_stage(const JsonFile& f, const Config& c) {
  if (c.tensor_parallel_size <= 1 || c.zero.stage != 3) return;
  f.fail("tensor_parallel.autotp_size", "autotp_size",
         fmt::format("tensor_parallel.autotp_size {} with zero_optimization.stage 3: AutoTP trains with ZeRO "
                     "stages 0, 1 and 2 (DeepSpeed's AutoTP training does not support stage 3 either); set "
                     "stage 2, or remove tensor_parallel",
                     c.tensor_parallel_size));
}

void apply_deepspeed_json(const std::string& path, const DeepSpeedJsonContext& context, Config& c) {
  const JsonFile f(path, read_text(path, context));
  const Json root = parse(path, f.text());
  refuse_unsupported(f, root, "");
  report_top_level_keys(f, root, c.notices);
  apply_mixed_precision(f, root, context, c);
  apply_torch_autocast(f, root, context, c);
  apply_gradient_accumulation(f, root, context, c);
  apply_autotp(f, root, c);
  check_batch_sizes(f, root, c);
  apply_gradient_clipping(f, root, c);
  apply_zero_optimization(f, root, c);
  check_autotp_stage(f, c);
  read_loss_scaler(f, root, c);  // into the zero settings apply_zero_optimization made
}

}  // namespace accel::config_detail
