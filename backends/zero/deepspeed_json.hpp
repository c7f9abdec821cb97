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

}  // namespace accel::config_detail
