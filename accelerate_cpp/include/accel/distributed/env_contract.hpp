#pragma once
/// \file env_contract.hpp
/// The environment contract between `accel-launch` and the library: the variables the launcher sets for
/// every rank and `ProcessState::from_environment` / `Accelerator` read. Spelled once, here; both sides use
/// these names (torchrun's variables plus accelerate-cpp's own). Torch-free.

#include <array>
#include <string_view>

namespace accel::env {

inline constexpr const char* kRank = "RANK";                        ///< global rank, 0..WORLD_SIZE-1
inline constexpr const char* kLocalRank = "LOCAL_RANK";             ///< rank on this machine
inline constexpr const char* kWorldSize = "WORLD_SIZE";             ///< ranks in all
inline constexpr const char* kLocalWorldSize = "LOCAL_WORLD_SIZE";  ///< ranks on this machine
inline constexpr const char* kGroupRank = "GROUP_RANK";             ///< machine (node) index
inline constexpr const char* kMasterAddr = "MASTER_ADDR";           ///< rendezvous host (rank 0's machine)
inline constexpr const char* kMasterPort = "MASTER_PORT";           ///< rendezvous port (TCPStore)
inline constexpr const char* kConfigFile = "ACCEL_CONFIG_FILE";     ///< the resolved YAML config
inline constexpr const char* kConfigSource =
    "ACCEL_CONFIG_SOURCE";  ///< the user's YAML that ACCEL_CONFIG_FILE was resolved from (named in messages)
inline constexpr const char* kLaunched = "ACCEL_LAUNCHED";  ///< "1" under accel-launch
inline constexpr const char* kRestartCount =
    "TORCHELASTIC_RESTART_COUNT";  ///< restarts so far (--max_restarts)
inline constexpr const char* kMaxRestarts = "TORCHELASTIC_MAX_RESTARTS";  ///< --max_restarts
inline constexpr const char* kConsoleTty = "ACCEL_CONSOLE_TTY";  ///< "1": the launcher's console is a
                                                                 ///< terminal (progress bars print lines)
/// The job's identity in its rendezvous (torchrun's name: its --rdzv_id): a random id per launch from
/// accel-launch, or its --run_id (the same on every machine of a multi-machine job). Rank 0 publishes it in
/// its store and every other rank checks it before anything else, so a rank of another job that uses the
/// same port is refused instead of joining.
inline constexpr const char* kRunId = "TORCHELASTIC_RUN_ID";
inline constexpr const char* kCollectiveTimeout = "ACCEL_COLLECTIVE_TIMEOUT";  ///< seconds (overrides YAML)
inline constexpr const char* kDebug = "ACCEL_DEBUG";  ///< shape checks before collectives (also Accelerate's
                                                      ///< ACCELERATE_DEBUG_MODE)
inline constexpr const char* kCpuCollectives = "ACCEL_CPU_COLLECTIVES";  ///< auto | builtin | p2p
inline constexpr const char* kCudaCollectives =
    "ACCEL_CUDA_COLLECTIVES";  ///< nccl | gloo (host copies; ranks may share a GPU)

/// Every variable accel-launch sets for each rank (and removes from its own environment first), in order.
inline constexpr std::array<const char*, 14> kLaunchVariables = {
    kRank,       kLocalRank,    kWorldSize, kLocalWorldSize, kGroupRank,   kMasterAddr, kMasterPort,
    kConfigFile, kConfigSource, kLaunched,  kRestartCount,   kMaxRestarts, kConsoleTty, kRunId};

/// Whether `name` is one of kLaunchVariables.
constexpr bool set_by_launcher(std::string_view name) {
  for (const char* v : kLaunchVariables) {
    if (name == v) return true;
  }
  return false;
}

// The variables the library needs to join a multi-process run are all set by the launcher.
static_assert(set_by_launcher("RANK") && set_by_launcher("WORLD_SIZE") && set_by_launcher("MASTER_ADDR") &&
              set_by_launcher("MASTER_PORT") && set_by_launcher("LOCAL_RANK") &&
              set_by_launcher("LOCAL_WORLD_SIZE"));

}  // namespace accel::env
