#pragma once
/// \file resolved_config.hpp
/// The config an Accelerator built from `options` would use, without building one (no process group): the
/// options' config, else its config file, else the launcher's ACCEL_CONFIG_FILE, with the options' overrides
/// applied and validated. The Trainer merges its TrainingArguments into it before making its Accelerator.

#include <accel/accelerator/accelerator.hpp>

namespace accel {

/// Throws ConfigError as the Accelerator's constructor would.
Config resolved_config(const AcceleratorOptions& options);

}  // namespace accel
