#pragma once
/// \file process_state.hpp
/// Where this process sits in the job: rank, world size, local rank, node, rendezvous address. Read from the
/// environment that accel-launch, torchrun, Slurm (srun) or Open MPI (mpirun) set up.

#include <functional>
#include <string>

namespace accel {

/// Rank layout of the job this process belongs to.
struct ProcessState {
  int rank = 0;                           ///< global rank, 0..world_size-1
  int world_size = 1;                     ///< processes in the job
  int local_rank = 0;                     ///< rank on this machine
  int local_world_size = 1;               ///< processes on this machine
  int node_rank = 0;                      ///< index of this machine
  std::string master_addr = "127.0.0.1";  ///< host of rank 0's rendezvous store
  int master_port = 29500;                ///< port of that store
  std::string launcher = "none";          ///< "accel-launch", "torchrun", "slurm", "openmpi" or "none"

  /// Detects the launcher from the environment (torchrun/accel-launch variables first, then Slurm, then Open
  /// MPI; none of them: one process). Partial or inconsistent variables throw ConfigError listing what was
  /// found and what is missing. `getenv` is injectable for tests.
  static ProcessState from_environment(const std::function<const char*(const char*)>& getenv = nullptr);
};

/// First host of a Slurm node list: "node[07-09,12],gpu3" -> "node07".
std::string slurm_first_host(const std::string& nodelist);

}  // namespace accel
