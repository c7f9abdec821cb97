// DeepSpeed JSON's precision blocks (deepspeed_json_parts.hpp): fp16 / bf16 (and the old "bfloat16"), their
// loss scaler settings, and torch_autocast, each agreeing with the Accelerate YAML's mixed_precision or
// naming both.
#include "deepspeed_json_parts.hpp"

#include "config/text_distance.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <set>

namespace accel::config_detail::ds_json {

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

}  // namespace accel::config_detail::ds_json
