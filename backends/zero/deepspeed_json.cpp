// DeepSpeed JSON configs (`deepspeed_config_file:` in an Accelerate DEEPSPEED config), read by DeepSpeed's
// rules: comments tolerated, duplicate keys rejected, an unknown key inside zero_optimization or an offload
// block is an error naming key, file and the nearest valid key, unknown top-level keys are ignored with a
// notice. "auto" values are resolved as Accelerate resolves them, DeepSpeed's defaults fill what the file
// leaves out, and keys that map to nothing here are listed as notices, never silently dropped.
#include "deepspeed_json.hpp"

#include "config/small_file.hpp"
#include "config/text_distance.hpp"
#include "deepspeed_json_parts.hpp"

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
namespace ds_json {

std::size_t line_of_key(const std::string& text, const std::string& key) {
  const auto at = text.find("\"" + key + "\"");
  if (at == std::string::npos) return 0;
  return static_cast<std::size_t>(
             std::count(text.begin(), text.begin() + static_cast<std::ptrdiff_t>(at), '\n')) +
         1;
}

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

}  // namespace ds_json

using namespace ds_json;

namespace {

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
                                              "tensor_parallel",
                                              "optimizer",
                                              "scheduler"};
  return kKeys;
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
  c.zero.gradient_clipping_auto = false;
  if (!root.contains("gradient_clipping")) {
    c.origins["gradient_clipping"] =
        fmt::format("DeepSpeed's default (0: off), {} does not set it", f.path());
    return;
  }
  const Json& v = root.at("gradient_clipping");
  c.origins["gradient_clipping"] = fmt::format("{} (gradient_clipping)", f.path());
  if (is_auto(v)) {
    c.zero.gradient_clipping = 1.0;
    c.zero.gradient_clipping_auto = true;
    c.origins["gradient_clipping"] =
        fmt::format("{} (gradient_clipping: auto, filled with 1.0 as Accelerate does)", f.path());
  } else if (v.is_number() && v.get<double>() >= 0) {
    c.zero.gradient_clipping = v.get<double>();
  } else {
    f.fail("gradient_clipping", "gradient_clipping",
           fmt::format("gradient_clipping: expected a non-negative number or \"auto\", got {}", v.dump()));
  }
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

// tensor_parallel.vocab_parallel_ce_backend (DeepSpeed's "torch", default, or "liger": Liger's fused
// vocabulary-parallel cross entropy on CUDA, else DeepSpeed's torch loss; the same loss either way). "liger"
// needs a vocabulary-parallel head, as DeepSpeed's engine refuses it without one; here the loss is always
// accelerate-cpp's own vocabulary-parallel one (chunked and fused with the recipe's
// --fused_linear_cross_entropy). Without tensor parallelism (autotp_size or the YAML's tp_size, read later)
// vocab_parallel_lm_head splits nothing, as in DeepSpeed.
void apply_autotp_loss_backend(const JsonFile& f, const std::string& ce_backend, Config& c,
                               std::vector<std::string>& no_effect) {
  if (ce_backend == "liger" && !c.zero.vocab_parallel_lm_head)
    f.fail(
        "tensor_parallel.vocab_parallel_ce_backend", "vocab_parallel_ce_backend",
        "tensor_parallel.vocab_parallel_ce_backend: \"liger\" needs tensor_parallel.vocab_parallel_lm_head: "
        "true (DeepSpeed refuses it too: a vocabulary-parallel loss needs a vocabulary-parallel head); set "
        "vocab_parallel_lm_head: true or remove vocab_parallel_ce_backend");
  if (ce_backend == "liger")
    no_effect.push_back(
        "vocab_parallel_ce_backend \"liger\" (no Liger kernel: the loss is accelerate-cpp's "
        "vocabulary-parallel one, the same value)");
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
  std::string ce_backend = "torch";
  for (const auto& [key, v] : block.items()) {
    const std::string p = "tensor_parallel." + key;
    if (key == "enabled") {
      enabled = boolean_value(f, v, p, key);
    } else if (key == "vocab_parallel_lm_head") {
      // null: DeepSpeed decides from the model's transformers tp_plan (an `embedding_rowwise` entry turns it
      // on); the Qwen2 / Llama / Qwen3 plans have none, so null is its default, false.
      c.zero.vocab_parallel_lm_head = !v.is_null() && boolean_value(f, v, p, key);
    } else if (key == "vocab_parallel_ce_backend") {
      if (!v.is_string() || (v.get<std::string>() != "torch" && v.get<std::string>() != "liger"))
        f.fail(p, key,
               fmt::format("{}: expected \"torch\" or \"liger\" (DeepSpeed's choices), got {}", p, v.dump()));
      ce_backend = v.get<std::string>();
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
                         "columns; norms whole; embedding and lm_head whole unless vocab_parallel_lm_head); "
                         "remove it",
                         p));
    }
  }
  if (!enabled) c.tensor_parallel_size = 1;
  apply_autotp_loss_backend(f, ce_backend, c, no_effect);
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
  read_loss_scaler(f, root, c);   // into the zero settings apply_zero_optimization made
  read_trainer_keys(f, root, c);  // last: the checks above keep their precedence
}

}  // namespace accel::config_detail
