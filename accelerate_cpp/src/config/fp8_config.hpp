#pragma once
// Accelerate's `fp8_config:` section (and `mixed_precision: fp8`), read and checked as Accelerate's launcher
// and recipe classes check them (commands/launch.py's --fp8_* arguments, utils/dataclasses.py's
// TERecipeKwargs, MSAMPRecipeKwargs, AORecipeKwargs), then refused: accelerate-cpp does not train in fp8 yet.
#include "config/config_detail.hpp"

namespace accel::config_detail {

/// The top-level `fp8_config` row: a mapping of Accelerate's fp8 keys, each validated (unknown keys and bad
/// values named); the recipe itself is not kept.
KeyRow fp8_config_row();

/// After the whole file is read: `mixed_precision: fp8` is refused with the recipe the file asks for (from
/// `fp8_config`, Accelerate's defaults filling the rest) and what to use instead; an `fp8_config` without it
/// gets a notice (Accelerate ignores it then too).
void resolve_fp8(const Reader& r, Config& c, const Pending& p);

}  // namespace accel::config_detail
