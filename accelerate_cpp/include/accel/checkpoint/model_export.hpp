#pragma once
/// \file model_export.hpp
/// What `Accelerator::get_state_dict(model, where)` and `Accelerator::save_model` take and return: where the
/// state goes, and what an export wrote. Plain values, usable without the facade.

#include <cstdint>
#include <string>
#include <vector>

namespace accel {

/// Where `get_state_dict(model, where)` returns the state.
enum class StateDictOn {
  AllProcesses,  ///< every rank gets the whole state (as get_state_dict(model))
  MainProcess    ///< the main process gets it on the CPU; the others get an empty list
};

/// What `Accelerator::save_model` wrote.
struct ModelExport {
  /// The weight files inside the directory: `model.safetensors`, or the shards in order then the index. Empty
  /// on ranks other than the main process. Beside them, `model.safetensors.manifest.json` lists each file's
  /// size and XXH64; load_model verifies it before reading (transformers ignores it).
  std::vector<std::string> files;
  /// Sum of the tensors' sizes in bytes (the index's `metadata.total_size`).
  std::uint64_t total_bytes = 0;
  /// The most tensor bytes this process held at once for the export: the shard being filled plus the piece
  /// (one unit of a sharded model) being handed over. Measured, not computed from the plan.
  std::uint64_t peak_held_bytes = 0;
};

}  // namespace accel
