// DeepSpeed JSON's zero_optimization block and its offload_param / offload_optimizer blocks
// (deepspeed_json_parts.hpp): DeepSpeed's defaults for what the file leaves out, "auto" values, keys with no
// effect here as notices, unknown keys as errors naming the nearest valid key.
#include "deepspeed_json_parts.hpp"

#include "config/text_distance.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <set>

namespace accel::config_detail::ds_json {
namespace {

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

// What a zero_optimization block reports as notices: keys with no effect, and "auto" values left to
// DeepSpeed's defaults.
struct ZeroNotices {
  std::vector<std::string> no_effect, autos;
};

// DeepSpeed's defaults for what zero_optimization leaves out; clipping, activation checkpointing and
// tensor_parallel.vocab_parallel_lm_head as read.
ZeroConfig zero_defaults(const Config& c) {
  ZeroConfig z;
  z.stage = 0;
  z.overlap_comm = false;
  z.reduce_bucket_size = 500000000;
  z.allgather_bucket_size = 500000000;
  z.stage3_prefetch_bucket_size = 50000000;
  z.gradient_clipping = c.zero.gradient_clipping;
  z.gradient_clipping_auto = c.zero.gradient_clipping_auto;
  z.activation_checkpointing = c.zero.activation_checkpointing;
  z.vocab_parallel_lm_head = c.zero.vocab_parallel_lm_head;  // tensor_parallel's, read before
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
}  // namespace

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

}  // namespace accel::config_detail::ds_json
