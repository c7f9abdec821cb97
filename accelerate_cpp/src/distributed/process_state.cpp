#include <accel/distributed/cuda_device.hpp>
#include <accel/distributed/env_contract.hpp>
#include <accel/distributed/process_state.hpp>
#include <accel/errors.hpp>

#include "distributed/run_id.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <optional>
#include <vector>

namespace accel {
namespace {

using Getenv = std::function<const char*(const char*)>;

struct EnvReader {
  const Getenv& get;
  std::vector<std::string> found;  // "NAME=value" of every variable read, for error messages

  std::optional<std::string> str(const char* name) {
    const char* v = get(name);
    if (v == nullptr || *v == '\0') return std::nullopt;
    found.push_back(fmt::format("{}={}", name, v));
    return std::string(v);
  }
  std::optional<int> integer(const char* name) {
    auto v = str(name);
    if (!v) return std::nullopt;
    char* end = nullptr;
    const long x = std::strtol(v->c_str(), &end, 10);
    if (*end != '\0' || x < 0 || x > 1'000'000'000) {
      throw ConfigError(fmt::format("environment variable {}='{}' is not a non-negative integer", name, *v),
                        {}, 0, name);
    }
    return static_cast<int>(x);
  }
  [[noreturn]] void fail(const std::string& launcher, const std::string& problem) const {
    throw ConfigError(
        fmt::format("{} environment is incomplete or inconsistent: {} (found: {})", launcher, problem,
                    found.empty() ? std::string("nothing") : fmt::format("{}", fmt::join(found, ", "))));
  }
};

void check_layout(const EnvReader& env, const std::string& who, const ProcessState& s) {
  if (s.world_size < 1) env.fail(who, "the world size must be at least 1");
  if (s.rank >= s.world_size)
    env.fail(who, fmt::format("rank {} is not below the world size {}", s.rank, s.world_size));
  if (s.local_world_size < 1 || s.local_world_size > s.world_size) {
    env.fail(who, fmt::format("local world size {} must be in 1..{}", s.local_world_size, s.world_size));
  }
  if (s.local_rank >= s.local_world_size) {
    env.fail(who, fmt::format("local rank {} is not below the local world size {}", s.local_rank,
                              s.local_world_size));
  }
  if (s.master_port < 1 || s.master_port > 65535)
    env.fail(who, fmt::format("port {} is not in 1..65535", s.master_port));
}

}  // namespace

std::string slurm_first_host(const std::string& nodelist) {
  // Grammar: host[,host...] where host = prefix or prefix[ranges]; ranges = a or a-b, comma separated.
  const auto bracket = nodelist.find('[');
  const auto comma = nodelist.find(',');
  if (bracket == std::string::npos || (comma != std::string::npos && comma < bracket)) {
    return nodelist.substr(0, comma);
  }
  const auto prefix = nodelist.substr(0, bracket);
  const auto end = nodelist.find_first_of(",-]", bracket + 1);
  if (end == std::string::npos)
    throw ConfigError(fmt::format("cannot parse SLURM_JOB_NODELIST '{}'", nodelist));
  return prefix + nodelist.substr(bracket + 1, end - bracket - 1);
}

namespace {

// torchrun and accel-launch: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT.
// False (and `s` untouched) when neither RANK nor WORLD_SIZE is set.
bool read_torchrun(EnvReader& env, ProcessState& s) {
  const auto rank = env.integer(env::kRank);
  const auto world = env.integer(env::kWorldSize);
  if (!rank && !world) return false;
  s.launcher = env.str(env::kLaunched) ? "accel-launch" : "torchrun";
  const auto local_rank = env.integer(env::kLocalRank);
  const auto local_world = env.integer(env::kLocalWorldSize);
  const auto addr = env.str(env::kMasterAddr);
  const auto port = env.integer(env::kMasterPort);
  std::vector<std::string> missing;
  if (!rank) missing.push_back("RANK");
  if (!world) missing.push_back("WORLD_SIZE");
  if (world && *world > 1) {
    if (!addr) missing.push_back("MASTER_ADDR");
    if (!port) missing.push_back("MASTER_PORT");
  }
  if (!missing.empty()) {
    env.fail(s.launcher,
             fmt::format("missing {}; set all of RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (torchrun "
                         "and accel-launch do)",
                         fmt::join(missing, ", ")));
  }
  s.rank = *rank;
  s.world_size = *world;
  s.local_rank = local_rank.value_or(s.rank);
  s.local_world_size = local_world.value_or(s.world_size);
  if (const auto group = env.integer(env::kGroupRank)) s.node_rank = *group;
  if (addr) s.master_addr = *addr;
  if (port) s.master_port = *port;
  check_layout(env, s.launcher, s);
  return true;
}

// Slurm (srun): SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, first host of SLURM_JOB_NODELIST.
// False (and `s` untouched) when neither SLURM_PROCID nor SLURM_NTASKS is set.
bool read_slurm(EnvReader& env, ProcessState& s) {
  const auto procid = env.integer("SLURM_PROCID");
  const auto ntasks = env.integer("SLURM_NTASKS");
  if (!procid && !ntasks) return false;
  s.launcher = "slurm";
  if (!procid || !ntasks) env.fail("Slurm", "both SLURM_PROCID and SLURM_NTASKS are needed (run under srun)");
  s.rank = *procid;
  s.world_size = *ntasks;
  s.local_rank = env.integer("SLURM_LOCALID").value_or(0);
  s.local_world_size = s.world_size;
  if (const auto per_node = env.str("SLURM_TASKS_PER_NODE")) {
    s.local_world_size = std::atoi(per_node->c_str());  // "4(x2)" -> 4
  }
  if (const auto node = env.integer("SLURM_NODEID")) s.node_rank = *node;
  if (const auto addr = env.str(env::kMasterAddr)) {
    s.master_addr = *addr;
  } else if (const auto nodes = env.str("SLURM_JOB_NODELIST")) {
    s.master_addr = slurm_first_host(*nodes);
  } else if (s.world_size > 1) {
    env.fail("Slurm", "SLURM_JOB_NODELIST (or MASTER_ADDR) is needed to find rank 0's host");
  }
  if (const auto port = env.integer(env::kMasterPort)) s.master_port = *port;
  check_layout(env, "Slurm", s);
  return true;
}

// Open MPI (mpirun): OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK, _LOCAL_SIZE.
// False (and `s` untouched) when neither OMPI_COMM_WORLD_RANK nor OMPI_COMM_WORLD_SIZE is set.
bool read_open_mpi(EnvReader& env, ProcessState& s) {
  const auto orank = env.integer("OMPI_COMM_WORLD_RANK");
  const auto osize = env.integer("OMPI_COMM_WORLD_SIZE");
  if (!orank && !osize) return false;
  s.launcher = "openmpi";
  if (!orank || !osize) env.fail("Open MPI", "both OMPI_COMM_WORLD_RANK and OMPI_COMM_WORLD_SIZE are needed");
  s.rank = *orank;
  s.world_size = *osize;
  s.local_rank = env.integer("OMPI_COMM_WORLD_LOCAL_RANK").value_or(0);
  s.local_world_size = env.integer("OMPI_COMM_WORLD_LOCAL_SIZE").value_or(s.world_size);
  if (const auto node = env.integer("OMPI_COMM_WORLD_NODE_RANK")) s.node_rank = *node;
  const auto addr = env.str(env::kMasterAddr);
  if (addr) {
    s.master_addr = *addr;
  } else if (s.local_world_size != s.world_size) {
    env.fail(
        "Open MPI",
        "ranks span several machines, so MASTER_ADDR must name rank 0's host (mpirun -x MASTER_ADDR=...)");
  }
  if (const auto port = env.integer(env::kMasterPort)) s.master_port = *port;
  check_layout(env, "Open MPI", s);
  return true;
}

}  // namespace

ProcessState ProcessState::from_environment(const Getenv& getenv_in) {
  const Getenv getenv = getenv_in ? getenv_in : Getenv([](const char* n) { return std::getenv(n); });
  EnvReader env{getenv, {}};
  ProcessState s;
  // The first launcher whose variables are set wins; none set: one process on its own.
  if (read_torchrun(env, s) || read_slurm(env, s)) return s;
  read_open_mpi(env, s);
  return s;
}

std::string detail::run_id_from_environment(const Getenv& getenv_in) {
  const Getenv getenv = getenv_in ? getenv_in : Getenv([](const char* n) { return std::getenv(n); });
  auto value = [&getenv](const char* name) {
    const char* v = getenv(name);
    return std::string(v != nullptr ? v : "");
  };
  if (const std::string id = value(env::kRunId); !id.empty()) return id;
  if (const std::string job = value("SLURM_JOB_ID"); !job.empty()) {
    const std::string step = value("SLURM_STEP_ID");
    return "slurm-" + job + "." + (step.empty() ? "0" : step);
  }
  return "none";
}

}  // namespace accel

namespace accel {

int cuda_device_for(const ProcessState& state, int device_count, bool ranks_may_share) {
  const bool shared_devices = state.launcher == "accel-launch" || state.launcher == "torchrun";
  if (ranks_may_share) return state.local_rank % device_count;
  // Every local rank refuses, not only those past the device count: a rank left running would wait for the
  // others at the first collective until the timeout (seen with torchrun-style variables set by hand).
  if (shared_devices && std::max(state.local_world_size, state.local_rank + 1) > device_count) {
    const int nodes = state.world_size / std::max(state.local_world_size, 1);
    const int device = state.local_rank % device_count;
    const int other = state.local_rank < device_count ? state.local_rank + device_count : state.local_rank;
    const int first = state.local_rank < device_count ? state.local_rank : device;
    throw UsageError(fmt::format(
        "rank {}: {} starts {} processes on this machine, but it has {} CUDA device(s), so local ranks {} "
        "and {} "
        "would share cuda:{} (NCCL refuses that); set num_processes to at most {} (--num_processes {}{}), or "
        "use_cpu: true (--cpu) to train on CPU ranks, or ACCEL_CUDA_COLLECTIVES=gloo to let the ranks share "
        "the GPU (collectives through Gloo on host copies: slower, for running multi-rank code on one GPU)",
        state.rank, state.launcher, state.local_world_size, device_count, first, other, device,
        device_count * std::max(nodes, 1), device_count * std::max(nodes, 1),
        nodes > 1 ? fmt::format(", {} per machine", device_count) : ""));
  }
  return state.local_rank % device_count;
}

}  // namespace accel
