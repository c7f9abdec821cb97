#pragma once
/// \file project_configuration.hpp
/// Where checkpoints go, how they are named and how many are kept (Accelerate's `ProjectConfiguration`).

#include <string>

namespace accel {

/// Where checkpoints go and how many are kept, as Accelerate's `ProjectConfiguration`.
/// \code
///   accel::ProjectConfiguration project;
///   project.project_dir = "runs/exp1";
///   project.automatic_checkpoint_naming = true;  // save_state() -> runs/exp1/checkpoints/checkpoint_<i>
///   project.total_limit = 3;                     // keep the three newest
///   accel::Accelerator acc(accel::AcceleratorOptions().project_config(project));
/// \endcode
struct ProjectConfiguration {
  /// Base directory; automatic checkpoints go to `<project_dir>/checkpoints/checkpoint_<iteration>`.
  std::string project_dir;
  /// `save_state()` / `load_state()` without a directory use the automatic names.
  bool automatic_checkpoint_naming = false;
  /// Keep at most this many automatic checkpoints; the oldest is deleted only after a new one is complete.
  /// 0 keeps all.
  int total_limit = 0;
  /// The number of the next automatic checkpoint; `load_state()` sets it to the loaded one's plus one.
  int iteration = 0;
};

}  // namespace accel
