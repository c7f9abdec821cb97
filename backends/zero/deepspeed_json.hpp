#pragma once
// DeepSpeed JSON configs for the zero backend's config part (torch-free; compiled into accel_config).

#include "config/config_detail.hpp"

namespace accel::config_detail {

/// What the YAML said that a DeepSpeed JSON file must agree with.
struct DeepSpeedJsonContext {
  std::string source;  // the YAML file
  int line = 0;        // of deepspeed_config_file
  bool mixed_precision_set = false;
  bool gradient_accumulation_set = false;
};

/// Reads the DeepSpeed JSON at `path` into `c` (zero section, clipping, accumulation, mixed precision) by
/// DeepSpeed's and Accelerate's rules; adds notices for what maps to nothing. ConfigError naming the file.
void apply_deepspeed_json(const std::string& path, const DeepSpeedJsonContext& context, Config& c);

/// The unsupported-keys rows of a DeepSpeed JSON (file kDeepSpeedJson): refused, or ignored with a notice.
std::vector<UnsupportedKey> deepspeed_json_unsupported();

/// reduce_bucket_size 0 means, in DeepSpeed, that each parameter's gradient is reduced on its own; stage 2's
/// buckets do that with 0 (one parameter per bucket) and stage 3 reduces whole units whatever the size, but
/// stage 1 reduce-scatters the flat gradients in chunks and has no per-parameter mode: there 0 becomes
/// "auto" (chunks of about one weight matrix), with a notice naming `key` (as the file spells it).
void settle_stage1_reduce_bucket(Config& c, const std::string& key);

/// sub_group_size 0 is accepted, as DeepSpeed's schema accepts it (ge=0), but in stages 1-2 it makes every
/// parameter an optimizer sub-group of its own (many small steps, a master slice each): said in a notice
/// naming `key` (as the file spells it). Stage 3 notes the key's lack of effect elsewhere.
void note_sub_group_size_zero(Config& c, const std::string& key);

}  // namespace accel::config_detail
