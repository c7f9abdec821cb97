// The zero backend's side of the config (torch-free; compiled into accel_config): the `deepspeed_config:`
// section (Accelerate's DeepSpeed plugin keys), a DeepSpeed JSON file named by deepspeed_config_file
// (deepspeed_json.cpp), its checks and its questions.
#include "deepspeed_json.hpp"
#include "megatron_lm.hpp"

#include <cmath>
#include <filesystem>
#include <map>
#include <string>

namespace accel {
namespace config_detail {
namespace {

const Section kZeroSection = "deepspeed_config";

const ChoiceSet<OffloadDevice>& offload_choices() {
  static const ChoiceSet<OffloadDevice> kSet{{{"none", OffloadDevice::None, true},
                                              {"cpu", OffloadDevice::Cpu, true},
                                              {"nvme", OffloadDevice::Nvme, true}},
                                             {}};
  return kSet;
}
// Parameters (stage 3): CPU memory, or files on a fast local disk (ZeRO-Infinity).
const ChoiceSet<OffloadDevice>& param_offload_choices() {
  static const ChoiceSet<OffloadDevice> kSet{{{"none", OffloadDevice::None, true},
                                              {"cpu", OffloadDevice::Cpu, true},
                                              {"nvme", OffloadDevice::Nvme, true}},
                                             {}};
  return kSet;
}

// An NVMe directory: Accelerate writes `none` when there is no path (its default).
std::string read_nvme_path(const Reader& r, const Entry& e) {
  const std::string v = r.string(e);
  return lower(v) == "none" ? std::string() : v;
}
std::string write_nvme_path(const std::string& v) {
  return v.empty() ? std::string("none") : yaml_string(v);
}

std::vector<KeyRow> zero_rows() {
  std::vector<KeyRow> rows;
  rows.push_back(section_row(kZeroSection, "DeepSpeed", "settings of the zero backend (keys below)"));
  rows.push_back(setting(
      "zero_stage", kZeroSection, "0 (DDP), 1 (optimizer state sharded), 2 (+ gradients), 3 (+ parameters)",
      [](auto& c) -> auto& { return c.zero.stage; }, int_in(0, 3, "0, 1, 2 or 3"), write_int, "3"));
  rows.push_back(setting(
      "offload_optimizer_device", kZeroSection,
      "none | cpu | nvme (needs stage >= 1; nvme: each sub-group's optimizer state in a file under "
      "offload_optimizer_nvme_path between steps)",
      [](auto& c) -> auto& { return c.zero.offload_optimizer_device; }, choice(offload_choices),
      write_enum<OffloadDevice>, "cpu"));
  rows.push_back(setting(
      "offload_optimizer_nvme_path", kZeroSection,
      "directory for NVMe offload's files (offload_optimizer_device: nvme)",
      [](auto& c) -> auto& { return c.zero.offload_optimizer_nvme_path; }, read_nvme_path, write_nvme_path,
      "/local_nvme"));
  rows.push_back(setting(
      "offload_param_device", kZeroSection,
      "none | cpu | nvme (needs stage 3; nvme: each parameter shard in a file under offload_param_nvme_path, "
      "read for each gather and step)",
      [](auto& c) -> auto& { return c.zero.offload_param_device; }, choice(param_offload_choices),
      write_enum<OffloadDevice>, "cpu"));
  rows.push_back(setting(
      "offload_param_nvme_path", kZeroSection,
      "directory for the parameter shards' files (offload_param_device: nvme)",
      [](auto& c) -> auto& { return c.zero.offload_param_nvme_path; }, read_nvme_path, write_nvme_path,
      "/local_nvme"));
  {
    KeyRow r;
    r.name = "gradient_accumulation_steps";
    r.section = kZeroSection;
    r.doc =
        "must agree with the top-level gradient_accumulation_steps; auto: follows it (as Accelerate fills "
        "it)";
    r.read = [](Reader& rd, const Entry& e, Config&, Pending&) {
      if (rd.scalar(e, "a positive integer or auto") == "auto") return;  // see resolve
      rd.integer(e, 1, std::numeric_limits<int>::max(), "a positive integer or auto");
    };
    rows.push_back(r);
  }
  {
    KeyRow r = setting(
        "gradient_clipping", kZeroSection,
        "max global gradient norm: backward clips each model to it on sync steps, as DeepSpeed's engine "
        "does; "
        "0 disables; absent or auto in a YAML deepspeed_config: 1.0 (what Accelerate fills in)",
        [](auto& c) -> auto& { return c.zero.gradient_clipping; },
        [](const Reader& r, const Entry& e) {
          return r.number(e, 0, true, "a non-negative number (0 disables) or auto");
        },
        write_number, "0.5");
    auto read_number = r.read;
    r.read = [read_number](Reader& rd, const Entry& e, Config& c, Pending& p) {
      if (e.value.IsScalar() && e.value.Scalar() == "auto") return;  // filled in resolve, as when absent
      read_number(rd, e, c, p);
    };
    // A value filled in for "auto" (or an absent key) is written back as auto: accel-launch hands the ranks
    // a written copy, and accel::Trainer fills an auto with max_grad_norm, as HF's Trainer does.
    r.write = [write = r.write](const Config& c) {
      return c.zero.gradient_clipping_auto && c.zero.gradient_clipping == 1.0 ? std::string("auto")
                                                                              : write(c);
    };
    rows.push_back(r);
  }
  rows.push_back(setting(
      "zero3_init_flag", kZeroSection,
      "stage 3: a model built empty is loaded by each rank's slices (load_model)",
      [](auto& c) -> auto& { return c.zero.zero3_init_flag; }, boolean(), write_bool, "true"));
  rows.push_back(setting(
      "zero3_save_16bit_model", kZeroSection, "save_state also writes a consolidated 16-bit model",
      [](auto& c) -> auto& { return c.zero.zero3_save_16bit_model; }, boolean(), write_bool, "true"));
  rows.push_back(setting(
      "reduce_bucket_size", kZeroSection,
      "gradient reduce-scatter bucket, in elements as DeepSpeed counts it (5e8 accepted); auto: from the "
      "model; 0: one parameter per bucket, as DeepSpeed (stage 1: auto)",
      [](auto& c) -> auto& { return c.zero.reduce_bucket_size; }, bytes_or_auto(), write_bytes_or_auto,
      "123"));
  rows.push_back(setting(
      "overlap_comm", kZeroSection, "stage 2 reduces a bucket while backward fills the next",
      [](auto& c) -> auto& { return c.zero.overlap_comm; }, boolean(), write_bool, "false"));
  rows.push_back(setting(
      "allgather_bucket_size", kZeroSection,
      "accepted (0 too), no effect: stages 1-2 gather each sub-group straight into the parameters",
      [](auto& c) -> auto& { return c.zero.allgather_bucket_size; }, bytes(), write_u64, "456"));
  rows.push_back(setting(
      "sub_group_size", kZeroSection,
      "stages 1-2: elements per optimizer sub-group (each its own master slice; 4e6 accepted; 0: one "
      "parameter each)",
      [](auto& c) -> auto& { return c.zero.sub_group_size; },
      [](const Reader& r, const Entry& e) {
        return r.count(e, 0,
                       "a non-negative number of elements (such as 4000000 or 4e6; 0: one parameter each)");
      },
      write_u64, "1000"));
  rows.push_back(setting(
      "zero_hpz_partition_size", kZeroSection,
      "stage 3, ZeRO++ hpZ: groups of this many consecutive ranks (a machine) keep a secondary copy of each "
      "unit after its forward, and backward gathers inside the group; 1: off",
      [](auto& c) -> auto& { return c.zero.hpz_partition_size; }, positive_int(), write_int, "2"));
  rows.push_back(setting(
      "stage3_prefetch_bucket_size", kZeroSection,
      "parameter elements prefetched ahead in stage 3; auto: from the model; 0: no prefetch (as DeepSpeed)",
      [](auto& c) -> auto& { return c.zero.stage3_prefetch_bucket_size; }, bytes_or_auto(),
      write_bytes_or_auto, "auto"));
  rows.push_back(setting(
      "activation_checkpointing", kZeroSection, "(accelerate-cpp) recompute activations in backward",
      [](auto& c) -> auto& { return c.zero.activation_checkpointing; }, boolean(), write_bool, "true"));
  rows.push_back(setting(
      "vocab_parallel_lm_head", kZeroSection,
      "(accelerate-cpp) DeepSpeed's tensor_parallel.vocab_parallel_lm_head: under AutoTP the accel::llm "
      "models' head is split over the vocabulary (untied: lm_head alone; tied: with embed_tokens) and the "
      "loss "
      "computed vocabulary-parallel",
      [](auto& c) -> auto& { return c.zero.vocab_parallel_lm_head; }, boolean(), write_bool, "true"));
  // DeepSpeed's fp16 loss scaler (a DeepSpeed JSON's fp16 block, which DeepSpeed's defaults fill).
  rows.push_back(setting(
      "fp16_loss_scale", kZeroSection,
      "(accelerate-cpp) DeepSpeed's fp16.loss_scale: 0 dynamic loss scaling, > 0 a static scale",
      [](auto& c) -> auto& { return c.zero.fp16_loss_scale; },
      [](const Reader& r, const Entry& e) { return r.number(e, 0, true, "0 (dynamic) or a positive scale"); },
      write_number, "128"));
  rows.push_back(setting(
      "fp16_initial_scale_power", kZeroSection,
      "(accelerate-cpp) DeepSpeed's fp16.initial_scale_power: the first dynamic scale is 2^this",
      [](auto& c) -> auto& { return c.zero.fp16_initial_scale_power; },
      int_in(-126, 127, "an integer from -126 to 127 (the scale is a float32)"), write_int, "12"));
  rows.push_back(setting(
      "fp16_loss_scale_window", kZeroSection,
      "(accelerate-cpp) DeepSpeed's fp16.loss_scale_window: clean steps between growths of the scale",
      [](auto& c) -> auto& { return c.zero.fp16_loss_scale_window; },
      [](const Reader& r, const Entry& e) {
        return r.integer(e, 1, std::numeric_limits<std::int64_t>::max(), kPositiveInt);
      },
      write_int, "500"));
  rows.push_back(setting(
      "fp16_hysteresis", kZeroSection,
      "(accelerate-cpp) DeepSpeed's fp16.hysteresis: overflows (skipped steps) before the scale halves",
      [](auto& c) -> auto& { return c.zero.fp16_hysteresis; },
      [](const Reader& r, const Entry& e) {
        return r.integer(e, 1, std::numeric_limits<std::int64_t>::max(), kPositiveInt);
      },
      write_int, "4"));
  rows.push_back(setting(
      "fp16_consecutive_hysteresis", kZeroSection,
      "(accelerate-cpp) DeepSpeed's fp16.consecutive_hysteresis: refill the hysteresis at every clean step",
      [](auto& c) -> auto& { return c.zero.fp16_consecutive_hysteresis; }, boolean(), write_bool, "true"));
  rows.push_back(setting(
      "fp16_min_loss_scale", kZeroSection,
      "(accelerate-cpp) DeepSpeed's fp16.min_loss_scale: the floor of the dynamic scale; an overflow at it "
      "stops the run",
      [](auto& c) -> auto& { return c.zero.fp16_min_loss_scale; },
      [](const Reader& r, const Entry& e) { return r.number(e, 0, false, "a positive number"); },
      write_number, "0.25"));
  rows.push_back(setting(
      "deepspeed_trainer_keys", kZeroSection,
      "(accelerate-cpp, written by accel-launch for the ranks) the keys of the deepspeed_config_file that "
      "accel::Trainer fills from TrainingArguments or checks against them, as Hugging Face's Trainer does "
      "(batch "
      "sizes, accumulation, clipping, fp16/bf16 enabled, the optimizer and scheduler blocks), as one JSON "
      "object",
      [](auto& c) -> auto& { return c.zero.trainer_keys; },
      [](const Reader& r, const Entry& e) { return r.string(e); },
      [](const std::string& v) { return yaml_string(v); }, "'{\"gradient_clipping\": \"auto\"}'"));
  rows.push_back(ignored("deepspeed_multinode_launcher", kZeroSection,
                         "accepted, ignored (accel-launch starts every rank)"));
  {
    KeyRow r = ignored(
        "deepspeed_config_file", kZeroSection,
        "a DeepSpeed JSON config (ds_config.json) read by DeepSpeed's rules instead of the keys above");
    r.read = [](Reader& rd, const Entry& e, Config&, Pending&) { rd.string(e); };  // see resolve
    rows.push_back(r);
  }

  return rows;
}

// DeepSpeed offloads parameters in stage 3 only: stages 0-2 build their optimizer without the offload_param
// config (engine.py), so a file's offload_param there has no effect, in DeepSpeed and here.
void settle_offload_param(Config& c, const std::string& key) {
  if (c.zero.stage == 3 || c.zero.offload_param_device == OffloadDevice::None) return;
  c.notices.push_back(
      fmt::format("{} {} has no effect at zero_stage {}: DeepSpeed offloads parameters in stage "
                  "3 only and ignores it too; set zero_stage: 3 to offload them",
                  key, to_string(c.zero.offload_param_device), c.zero.stage));
  c.zero.offload_param_device = OffloadDevice::None;
}

void resolve_zero(const Reader& r, Config& c, const Pending& p) {
  // distributed_type: MEGATRON_LM runs on this backend (stage 0 or 1) with its own section's settings.
  resolve_megatron_lm(r, c, p);
  if (is_megatron_lm(r, p)) return;
  const Entry* gas = p.find("gradient_accumulation_steps");
  const Entry* ds_gas = p.find(kZeroSection + ".gradient_accumulation_steps");
  if (ds_gas != nullptr && ds_gas->value.IsScalar() && ds_gas->value.Scalar() == "auto") ds_gas = nullptr;
  if (const Entry* ds = ds_gas) {
    const int ds_value = static_cast<int>(r.integer(*ds, 1, std::numeric_limits<int>::max(), kPositiveInt));
    if (gas && ds_value != c.gradient_accumulation_steps) {
      r.fail_at(*ds, fmt::format("{}: {} disagrees with gradient_accumulation_steps {} (line {}); make them "
                                 "agree or remove one of them",
                                 ds->path, ds_value, c.gradient_accumulation_steps, gas->line));
    }
    c.gradient_accumulation_steps = ds_value;
  }

  const Entry* file = p.find(kZeroSection + ".deepspeed_config_file");
  if (file == nullptr) {
    // Accelerate's DeepSpeedPlugin leaves an absent gradient_clipping "auto" and fills it with 1.0 at
    // prepare: a YAML DeepSpeed section clips at 1.0 unless it says otherwise (a JSON file keeps DeepSpeed's
    // own default, 0). Said once, since the file does not say it.
    const Entry* clipping = p.find(kZeroSection + ".gradient_clipping");
    const bool clipping_auto =
        clipping != nullptr && clipping->value.IsScalar() && clipping->value.Scalar() == "auto";
    if (c.backend == "zero" && clipping != nullptr && !clipping_auto) {
      c.origins["gradient_clipping"] =
          fmt::format("{}{}", location(r.source(), clipping->line), clipping->path);
    }
    if (c.backend == "zero" && (clipping == nullptr || clipping_auto)) {
      c.zero.gradient_clipping = 1.0;
      c.zero.gradient_clipping_auto = true;
      c.origins["gradient_clipping"] =
          fmt::format("Accelerate's default for a deepspeed_config section ({}: filled with 1.0)",
                      clipping_auto ? "auto" : "absent");
      c.notices.push_back(fmt::format(
          "deepspeed_config.gradient_clipping is {}: gradients are clipped to a global norm of 1.0 "
          "on sync steps, as Accelerate fills it in (under accel::Trainer: to max_grad_norm, as HF's Trainer "
          "fills it); set gradient_clipping: 0 to turn clipping off",
          clipping_auto ? "auto" : "not set"));
    }
    if (c.backend == "zero") {
      settle_stage1_reduce_bucket(c, kZeroSection + ".reduce_bucket_size");
      note_sub_group_size_zero(c, kZeroSection + ".sub_group_size");
      settle_offload_param(c, kZeroSection + ".offload_param_device");
    }
    return;
  }
  if (c.backend != "zero") {
    // Accelerate reads deepspeed_config only for DEEPSPEED; its launcher ignores the section otherwise.
    c.notices.push_back(
        fmt::format("{}{}: ignored, as Accelerate ignores it: the backend is {}, not zero "
                    "(distributed_type: DEEPSPEED)",
                    location(r.source(), file->line), file->path, c.backend));
    return;
  }
  // Settings of the section besides the file (which decides them).
  std::vector<std::string> yaml_keys;
  for (const auto& [path, entry] : p.seen) {
    if (path.rfind(kZeroSection + ".", 0) == 0 && entry.name != "deepspeed_config_file" &&
        entry.name != "deepspeed_multinode_launcher" && entry.name != "zero3_init_flag") {
      yaml_keys.push_back(path);
    }
  }
  std::sort(yaml_keys.begin(), yaml_keys.end(), [&p](const std::string& a, const std::string& b) {
    return p.seen.at(a).line < p.seen.at(b).line;
  });
  if (!yaml_keys.empty()) {
    r.fail_at(*file, fmt::format("{}: with a DeepSpeed config file, {} must not be set here: the JSON file "
                                 "decides them; remove them from deepspeed_config: (Accelerate refuses this "
                                 "too)",
                                 file->path, join(yaml_keys)));
  }
  // As given (relative to the working directory, as Accelerate reads it), else next to the YAML file.
  std::string path = file->value.Scalar();
  const std::filesystem::path yaml_dir = std::filesystem::path(r.source()).parent_path();
  std::error_code ec;
  if (!std::filesystem::exists(path, ec) && std::filesystem::path(path).is_relative() && !yaml_dir.empty() &&
      std::filesystem::exists(yaml_dir / path, ec)) {
    path = (yaml_dir / path).string();
  }
  DeepSpeedJsonContext context;
  context.source = r.source();
  context.line = file->line;
  context.mixed_precision_set = p.find("mixed_precision") != nullptr;
  context.gradient_accumulation_set = gas != nullptr;
  apply_deepspeed_json(path, context, c);
  settle_offload_param(c, path + ": zero_optimization.offload_param.device");
}

namespace {

// Where a deepspeed_config setting came from when a DeepSpeed JSON file decides them: the file and its key,
// so a message about a mapped setting names what the user wrote.
std::string json_key_of(const std::string& key) {
  static const std::map<std::string, std::string> keys = {
      {"deepspeed_config.zero_stage", "zero_optimization.stage"},
      {"deepspeed_config.offload_param_device", "zero_optimization.offload_param.device"},
      {"deepspeed_config.offload_optimizer_device", "zero_optimization.offload_optimizer.device"},
      {"deepspeed_config.gradient_clipping", "gradient_clipping"},
      {"deepspeed_config.fp16_initial_scale_power", "fp16.initial_scale_power"},
      {"deepspeed_config.fp16_min_loss_scale", "fp16.min_loss_scale"},
      {"deepspeed_config.zero_hpz_partition_size", "zero_optimization.zero_hpz_partition_size"}};
  const auto it = keys.find(key);
  return it == keys.end() ? "" : it->second;
}

}  // namespace

void validate_zero(const Config& c, const FailKey& yaml_fail_key) {
  const FailKey fail_key = [&](const std::string& key, const std::string& body) {
    const std::string json_key = c.zero.config_file.empty() ? "" : json_key_of(key);
    yaml_fail_key(key, json_key.empty() ? body
                                        : fmt::format("{} (read from the DeepSpeed config file {}: {})", body,
                                                      c.zero.config_file, json_key));
  };
  const ZeroConfig& z = c.zero;
  if (z.stage < 0 || z.stage > 3) {
    fail_key("deepspeed_config.zero_stage",
             fmt::format("deepspeed_config.zero_stage ({}) must be 0, 1, 2 or 3", z.stage));
  }
  if (z.offload_param_device != OffloadDevice::None && z.stage != 3 && c.backend == "zero") {
    fail_key(
        "deepspeed_config.offload_param_device",
        fmt::format("deepspeed_config.offload_param_device: {} needs zero_stage 3, but zero_stage is {}; set "
                    "zero_stage: 3 or offload_param_device: none",
                    to_string(z.offload_param_device), z.stage));
  }
  if (z.offload_param_device == OffloadDevice::Nvme && z.offload_param_nvme_path.empty()) {
    fail_key("deepspeed_config.offload_param_device",
             "deepspeed_config.offload_param_device: nvme needs offload_param_nvme_path (in a DeepSpeed JSON "
             "file: offload_param.nvme_path), a directory on a fast local disk for the parameter shards' "
             "files");
  }
  if (z.offload_param_buffer_count < 2) {
    fail_key(
        "deepspeed_config.offload_param_device",
        fmt::format("offload_param.buffer_count ({}) must be at least 2: the shard being used and the one "
                    "read ahead",
                    z.offload_param_buffer_count));
  }
  if (z.hpz_partition_size > 1 && z.stage != 3 && c.backend == "zero") {
    fail_key("deepspeed_config.zero_hpz_partition_size",
             fmt::format("deepspeed_config.zero_hpz_partition_size {} (ZeRO++ hpZ) keeps secondary copies of "
                         "stage 3's sharded parameters, but zero_stage is {}; set zero_stage: 3 or "
                         "zero_hpz_partition_size: 1",
                         z.hpz_partition_size, z.stage));
  }
  if (z.offload_optimizer_device != OffloadDevice::None && z.stage == 0) {
    fail_key("deepspeed_config.offload_optimizer_device",
             fmt::format(
                 "deepspeed_config.offload_optimizer_device: {} needs zero_stage 1, 2 or 3, but zero_stage "
                 "is 0; set zero_stage or offload_optimizer_device: none",
                 to_string(z.offload_optimizer_device)));
  }
  if (z.offload_optimizer_device == OffloadDevice::Nvme && z.offload_optimizer_nvme_path.empty()) {
    fail_key(
        "deepspeed_config.offload_optimizer_device",
        "deepspeed_config.offload_optimizer_device: nvme needs offload_optimizer_nvme_path (in a DeepSpeed "
        "JSON file: offload_optimizer.nvme_path), a directory on a fast local disk for the optimizer "
        "state's files");
  }
  if (z.offload_optimizer_buffer_count < 2) {
    fail_key(
        "deepspeed_config.offload_optimizer_device",
        fmt::format("offload_optimizer.buffer_count ({}) must be at least 2: the sub-group being stepped and "
                    "the one read ahead",
                    z.offload_optimizer_buffer_count));
  }
  if (!(z.gradient_clipping >= 0) || !std::isfinite(z.gradient_clipping)) {
    fail_key("deepspeed_config.gradient_clipping",
             fmt::format("deepspeed_config.gradient_clipping ({}) must be 0 (off) or a positive number",
                         z.gradient_clipping));
  }
  // Bucket sizes and sub_group_size may be 0, as DeepSpeed's schema allows (ge=0); ZeroConfig says what 0
  // means for each.
  // The loss scaler, as DeepSpeed's DeepSpeedFP16Config and loss_scaler.py validate it.
  if (!(z.fp16_loss_scale >= 0) || !std::isfinite(z.fp16_loss_scale)) {
    fail_key(
        "deepspeed_config.fp16_loss_scale",
        fmt::format("deepspeed_config.fp16_loss_scale ({}) must be 0 (dynamic) or a positive, finite scale",
                    z.fp16_loss_scale));
  }
  if (z.fp16_initial_scale_power < -126 || z.fp16_initial_scale_power > 127) {
    fail_key("deepspeed_config.fp16_initial_scale_power",
             fmt::format("deepspeed_config.fp16_initial_scale_power ({}) must be from -126 to 127: the scale "
                         "2^power is a float32",
                         z.fp16_initial_scale_power));
  }
  if (z.fp16_loss_scale_window < 1 || z.fp16_hysteresis < 1) {
    const bool window = z.fp16_loss_scale_window < 1;
    fail_key(window ? "deepspeed_config.fp16_loss_scale_window" : "deepspeed_config.fp16_hysteresis",
             fmt::format("deepspeed_config.{} ({}) must be a positive integer",
                         window ? "fp16_loss_scale_window" : "fp16_hysteresis",
                         window ? z.fp16_loss_scale_window : z.fp16_hysteresis));
  }
  if (!(z.fp16_min_loss_scale > 0) || !std::isfinite(z.fp16_min_loss_scale)) {
    fail_key("deepspeed_config.fp16_min_loss_scale",
             fmt::format("deepspeed_config.fp16_min_loss_scale ({}) must be a positive number",
                         z.fp16_min_loss_scale));
  }
}

// DeepSpeed's fp16 loss scaler (CreateLossScaler in fp16/loss_scaler.py) from the zero settings.
LossScaling deepspeed_loss_scaling(const Config& c) {
  const ZeroConfig& z = c.zero;
  LossScaling s;
  if (z.fp16_loss_scale > 0) {  // LossScaler: static
    s.dynamic = false;
    s.init_scale = z.fp16_loss_scale;
    return s;
  }
  s.init_scale = std::ldexp(1.0, z.fp16_initial_scale_power);
  s.growth_factor = 2.0;  // DynamicLossScaler's scale_factor, fixed
  s.backoff_factor = 0.5;
  s.growth_interval = z.fp16_loss_scale_window;
  s.deepspeed_schedule = true;
  s.hysteresis = z.fp16_hysteresis;
  s.consecutive_hysteresis = z.fp16_consecutive_hysteresis;
  s.min_scale = z.fp16_min_loss_scale;
  return s;
}

void ask_zero(Questions& q, Config& config) {
  ZeroConfig& zero = config.zero;
  zero.stage = static_cast<int>(q.ask_choice("What ZeRO optimization stage do you want?",
                                             {{"0", "no sharding (like DDP)"},
                                              {"1", "shard optimizer state"},
                                              {"2", "shard optimizer state and gradients"},
                                              {"3", "shard optimizer state, gradients and parameters"}},
                                             2));
  if (zero.stage >= 1) {
    const std::vector<QuestionChoice> optimizer_devices = {
        {"none", "keep it on the training device"},
        {"cpu", "CPU memory"},
        {"nvme", "files on a fast local disk (ZeRO-Infinity), for state larger than memory"}};
    const std::vector<OffloadDevice> optimizer_kinds = {OffloadDevice::None, OffloadDevice::Cpu,
                                                        OffloadDevice::Nvme};
    zero.offload_optimizer_device =
        optimizer_kinds[q.ask_choice("Where should the optimizer state be offloaded?", optimizer_devices, 0)];
    if (zero.offload_optimizer_device == OffloadDevice::Nvme) {
      zero.offload_optimizer_nvme_path = q.ask_text(
          "Which directory should hold the optimizer state's files (a fast local disk)?", "/local_nvme");
    }
  }
  if (zero.stage == 3) {
    const std::vector<QuestionChoice> param_devices = {
        {"none", "keep them on the training device"},
        {"cpu", "CPU memory"},
        {"nvme", "files on a fast local disk (ZeRO-Infinity), for a model larger than memory"}};
    const std::vector<OffloadDevice> param_kinds = {OffloadDevice::None, OffloadDevice::Cpu,
                                                    OffloadDevice::Nvme};
    zero.offload_param_device =
        param_kinds[q.ask_choice("Where should the parameters be offloaded?", param_devices, 0)];
    if (zero.offload_param_device == OffloadDevice::Nvme) {
      zero.offload_param_nvme_path = q.ask_text(
          "Which directory should hold the parameter shards' files (a fast local disk)?", "/local_nvme");
    }
  }
  zero.activation_checkpointing = q.ask_bool("Do you want to use activation checkpointing?", false);
}

}  // namespace

BackendPart zero_config_part() {
  BackendPart part;
  part.info.name = "zero";
  part.info.summary = "ZeRO stages 0-3 with optional CPU offload (DeepSpeed-style)";
  part.info.aliases = {"deepspeed"};
  part.info.distributed_types = {"DEEPSPEED"};
  // Accelerate's Megatron-LM files, mapped onto stage 0 or 1 (megatron_lm.cpp).
  part.mapped_distributed_types = {"MEGATRON_LM"};
  part.info.section = kZeroSection;
  part.info.ask_settings = ask_zero;
  // The fact sheet: what each stage shards (DeepSpeed's ZeroStageEnum), written once.
  part.info.sharding = [](const Config& c) {
    BackendCapabilities s;
    s.shards_optimizer_state = c.zero.stage >= 1;
    s.shards_gradients = c.zero.stage >= 2;
    s.shards_parameters = c.zero.stage == 3;
    s.communicates_on_micro_steps = c.zero.stage == 3;  // stage 3 reduce-scatters every micro-step
    return s;
  };
  part.info.layout_setting = [](const Config& c) { return fmt::format("zero_stage {}", c.zero.stage); };
  for (int stage = 0; stage <= 3; ++stage) {
    part.info.layouts.push_back(
        {"zero_stage", std::to_string(stage), [stage](Config& c) { c.zero.stage = stage; }});
  }
  part.rows = zero_rows();
  for (KeyRow& row : megatron_lm_rows())
    part.rows.push_back(std::move(row));
  // Keys of Accelerate's deepspeed_config: section it does not support. All are ignored with a notice:
  // launcher-side (which hosts DeepSpeed's own launcher starts ranks on), NVMe paths (used only with an nvme
  // offload device, which is refused), how ZeRO-3 gathers MoE blocks (not what is computed), or a DeepSpeed
  // JSON key that Accelerate's launcher does not read from the YAML either.
  const Section yaml = kZeroSection + ".";
  auto noticed = [&part, &yaml](const char* key, AsksNothingWhen when, const char* neutral, const char* what,
                                const char* instead) {
    part.unsupported.push_back({kAccelerateYaml, yaml + key, false, when, neutral, what, instead});
  };
  for (const char* filter :
       {"deepspeed_hostfile", "deepspeed_inclusion_filter", "deepspeed_exclusion_filter"}) {
    noticed(
        filter, AsksNothingWhen::Empty, "",
        "which hosts DeepSpeed's multi-node launcher (pdsh, openmpi, ...) starts ranks on",
        "ignored: accel-launch starts this machine's ranks; give each machine num_machines, machine_rank and "
        "main_process_ip");
  }
  noticed("deepspeed_moe_layer_cls_names", AsksNothingWhen::Empty, "",
          "ZeRO-3 gathers the named MoE blocks whole (DeepSpeed's set_z3_leaf_modules)",
          "ignored: it decides how ZeRO-3 gathers those blocks, not what is computed");
  noticed("seq_parallel_communication_data_type", AsksNothingWhen::Empty, "",
          "a DeepSpeed JSON key (the dtype of Ulysses sequence parallelism's all-to-alls) that Accelerate's "
          "launcher does not read from the YAML either",
          "ignored: accelerate-cpp has no sequence parallelism");
  for (UnsupportedKey& row : deepspeed_json_unsupported())
    part.unsupported.push_back(std::move(row));
  for (UnsupportedKey& row : megatron_lm_unsupported())
    part.unsupported.push_back(std::move(row));
  part.section_in_use = [](const Config& c) { return c.backend == "zero" || c.zero != ZeroConfig{}; };
  part.info.gradient_clipping = [](const Config& c) { return c.zero.gradient_clipping; };
  part.info.loss_scaling = deepspeed_loss_scaling;
  part.resolve = resolve_zero;
  part.validate = validate_zero;
  part.estimate_config = [](const MemoryEstimateInput& in, Config& c) {
    if (in.zero_stage < 0 || in.zero_stage > 3) {
      throw ConfigError(
          fmt::format("estimate-memory: zero_stage {} is not available (0, 1, 2 or 3)", in.zero_stage), {}, 0,
          "zero_stage");
    }
    c.zero.stage = in.zero_stage;
  };
  return part;
}

}  // namespace config_detail

std::string to_string(OffloadDevice device) {
  return config_detail::canonical_text(config_detail::offload_choices(), device);
}

bool operator==(const ZeroConfig& a, const ZeroConfig& b) {
  Config x, y;
  x.zero = a;
  y.zero = b;
  return config_detail::agree(x, y, config_detail::kZeroSection);
}

}  // namespace accel
