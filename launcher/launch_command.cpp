/// \file launch_command.cpp
/// The `launch` subcommand: options struct, `setup_launch_command`, `run_launch`.

#include "launch_command.hpp"

#include <fmt/format.h>

#include <pwd.h>
#include <sched.h>
#include <sys/utsname.h>
#include <unistd.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <thread>

#include "commands.hpp"

#include <accel/distributed/env_contract.hpp>
#include "free_port.hpp"
#include "supervisor.hpp"

extern char** environ;

namespace accel::launcher {
namespace {

constexpr const char* kDefaultAddress = "127.0.0.1";

std::string get_env(const char* name) {
  const char* value = std::getenv(name);
  return value != nullptr ? value : "";
}

// The resolved config as a private file (mode 0600 from mkstemps) that exists as long as this object.
class TempConfigFile {
 public:
  explicit TempConfigFile(const std::string& text) {
    std::string dir = get_env("TMPDIR");
    if (dir.empty()) dir = "/tmp";
    std::string name = dir + "/accel-launch-config-XXXXXX.yaml";
    const int fd = ::mkstemps(name.data(), 5);
    if (fd < 0) {
      throw LaunchError("cannot create the resolved config file in '" + dir + "': " + std::strerror(errno) +
                        "; set TMPDIR to a writable directory");
    }
    path_ = name;
    std::size_t done = 0;
    while (done < text.size()) {
      const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        const int error = errno;
        ::close(fd);
        ::unlink(path_.c_str());
        throw LaunchError("cannot write the resolved config file '" + path_ + "': " + std::strerror(error));
      }
      done += static_cast<std::size_t>(n);
    }
    ::close(fd);
  }
  TempConfigFile(const TempConfigFile&) = delete;
  TempConfigFile& operator=(const TempConfigFile&) = delete;
  ~TempConfigFile() { ::unlink(path_.c_str()); }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// CPUs this process may run on (respects taskset/cgroup cpusets), at least 1.
int available_cores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  return std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
}

// "--name_with_underscores,--name-with-dashes": `accelerate launch` accepts both spellings.
std::string both_spellings(const std::string& name) {
  std::string dashed = name;
  std::replace(dashed.begin(), dashed.end(), '_', '-');
  return dashed == name ? "--" + name : "--" + name + ",--" + dashed;
}

std::string home_directory() {
  std::string home = get_env("HOME");
  if (home.empty()) {
    const passwd* entry = ::getpwuid(::getuid());
    if (entry != nullptr && entry->pw_dir != nullptr) home = entry->pw_dir;
  }
  return home;
}

}  // namespace

const char* default_allocator() {
  return "default";
}

std::string default_config_path() {
  const std::string explicit_path = get_env(env::kConfigFile);
  if (!explicit_path.empty()) return explicit_path;
  const std::string xdg = get_env("XDG_CONFIG_HOME");
  if (!xdg.empty()) return xdg + "/accelerate-cpp/default_config.yaml";
  return home_directory() + "/.config/accelerate-cpp/default_config.yaml";
}

std::string backend_names_help(const std::string& separator) {
  std::string out;
  for (const BackendInfo& info : config_backends())
    out += (out.empty() ? "" : separator) + info.name;
  return out;
}

Config resolve_launch_config(const LaunchOptions& options, std::vector<std::string>* notices) {
  std::string file = options.config_file;
  if (file.empty()) {
    const std::string candidate = default_config_path();
    std::error_code ec;
    if (std::filesystem::is_regular_file(candidate, ec)) file = candidate;
  }
  Config config = file.empty() ? Config{} : Config::load_file(file);
  // Printed here, once: the ranks read the resolved YAML (a DeepSpeed JSON's settings included), not the
  // file.
  if (notices != nullptr) {
    for (const auto& n : config.notices)
      notices->push_back("accel-launch: note: " + n);
  }

  bool overridden = false;
  auto set = [&overridden](auto& field, const auto& value) {
    if (value) {
      field = *value;
      overridden = true;
    }
  };
  set(config.num_processes, options.num_processes);
  set(config.num_machines, options.num_machines);
  set(config.machine_rank, options.machine_rank);
  set(config.main_process_ip, options.main_process_ip);
  set(config.main_process_port, options.main_process_port);
  set(config.gradient_accumulation_steps, options.gradient_accumulation_steps);
  set(config.log_with, options.log_with);
  if (options.mixed_precision) {
    config.mixed_precision = parse_mixed_precision(*options.mixed_precision);
    overridden = true;
  }
  if (options.backend) {
    config.backend = parse_backend(*options.backend);
    overridden = true;
  } else if (options.num_processes &&
             backend_for_processes(config.backend, *options.num_processes) != config.backend) {
    const std::string before = config.backend;
    config.backend = backend_for_processes(config.backend, *options.num_processes);
    overridden = true;
    if (notices != nullptr) {
      notices->push_back("accel-launch: --num_processes " + std::to_string(*options.num_processes) +
                         " needs a distributed backend (" + before + " runs one process); using " +
                         config.backend + " (choose another with --backend)");
    }
  }
  if (options.cpu) config.use_cpu = overridden = true;
  if (options.debug) config.debug = overridden = true;

  // The file alone was validated by load_file; what fails now comes from the flags, so the message must not
  // point at a line of the file.
  config.source.clear();
  try {
    config.validate();
  } catch (const ConfigError& e) {
    if (file.empty() || !overridden) throw;
    throw ConfigError(
        std::string(e.what()) + " (config file '" + file + "' with the command-line options applied)", file,
        0, e.key());
  }
  if (config.num_machines > 1 && config.main_process_ip.empty()) {
    throw ConfigError(
        "main_process_ip is required with num_machines " + std::to_string(config.num_machines) +
            ": pass the address of machine 0 with --main_process_ip to every machine's launcher",
        file, 0, "main_process_ip");
  }
  if (config.num_machines > 1 && config.main_process_port == 0) {
    throw ConfigError(
        "main_process_port 0 (pick a free port) only works on a single machine: with num_machines " +
            std::to_string(config.num_machines) +
            " every machine must use the same explicit port; pass e.g. --main_process_port 29500 to all of "
            "them",
        file, 0, "main_process_port");
  }
  config.source = file;  // for the ranks' messages (ACCEL_CONFIG_SOURCE); not part of the resolved YAML
  return config;
}

namespace {

// The checks that need no config, in the order their errors are reported.
void check_launch_options(const LaunchOptions& options) {
  if (options.command.empty()) {
    throw UsageError(
        "launch: missing PROGRAM; usage: accel-launch launch [options] PROGRAM [ARGS...] (see accel-launch "
        "launch --help)");
  }
  if (!(options.grace_period_seconds >= 0)) {
    throw UsageError("--grace_period must be 0 or more seconds, got " +
                     std::to_string(options.grace_period_seconds));
  }
  if (!(options.early_exit_report_seconds >= 0)) {
    throw UsageError("--early_exit_report must be 0 or more seconds, got " +
                     std::to_string(options.early_exit_report_seconds));
  }
  if (options.max_restarts < 0) {
    throw UsageError("--max_restarts must be 0 or more, got " + std::to_string(options.max_restarts));
  }
  if (options.num_cpu_threads_per_process && *options.num_cpu_threads_per_process < 1) {
    throw UsageError("--num_cpu_threads_per_process must be at least 1, got " +
                     std::to_string(*options.num_cpu_threads_per_process));
  }
  if (options.tee && options.log_dir.empty()) {
    throw UsageError("--tee copies the ranks' output to the console and to --log_dir files; give --log_dir");
  }
  if (options.run_id) {
    const std::string& id = *options.run_id;
    const bool plain = std::all_of(id.begin(), id.end(), [](char ch) {
      return std::isalnum(static_cast<unsigned char>(ch)) || ch == '-' || ch == '_' || ch == '.' || ch == ':';
    });
    if (id.empty() || id.size() > 128 || !plain) {
      throw UsageError(
          "--run_id '" + id +
          "' must be 1 to 128 letters, digits, '-', '_', '.' or ':' (the same on every machine of "
          "the job, e.g. the scheduler's job id)");
    }
  }
}

// The job's identity in the rendezvous: the user's --run_id, else a random one on a single machine (no other
// launcher has to agree), else torchrun's default "none" (the machines' launchers could not agree on a random
// one; a notice asks for --run_id).
std::string choose_run_id(const LaunchOptions& options, const Config& config,
                          std::vector<std::string>& notices) {
  if (options.run_id) return *options.run_id;
  if (config.num_machines > 1) {
    notices.push_back(
        "accel-launch: note: no --run_id: the job's rendezvous id is \"none\"; pass the same --run_id (e.g. "
        "the scheduler's job id) to the launcher of every machine, so that a rank of another job on port " +
        std::to_string(config.main_process_port) + " is refused instead of joining this one");
    return "none";
  }
  std::random_device random;
  const std::uint64_t bits =
      (static_cast<std::uint64_t>(random()) << 32) ^ random() ^ static_cast<std::uint64_t>(::getpid());
  char text[17];
  std::snprintf(text, sizeof(text), "%016llx", static_cast<unsigned long long>(bits));
  return text;
}

// Ports below 1024 are privileged: binding one needs root (or CAP_NET_BIND_SERVICE) and system services own
// many of them. Neither Accelerate nor torchrun checks; a mistyped port (80 for 8080) is then found late.
void warn_privileged_port(const Config& config) {
  if (config.main_process_port <= 0 || config.main_process_port >= 1024) return;
  std::cerr
      << "accel-launch: warning: main_process_port " << config.main_process_port
      << " is a privileged port (below 1024): binding it needs root (or CAP_NET_BIND_SERVICE) and system "
         "services use these ports; choose one from 1024 to 65535 (torchrun's default is 29500) or 0 "
         "to pick a free one"
      << std::endl;
}

// The checks and preparations that need the resolved config: restarts on one machine only, the log dir.
void check_restarts_and_log_dir(const LaunchOptions& options, const Config& config) {
  if (options.max_restarts > 0 && config.num_machines > 1) {
    throw UsageError("--max_restarts restarts the ranks of one machine; with num_machines " +
                     std::to_string(config.num_machines) +
                     " every launcher would have to agree on the restart (torchrun's elastic rendezvous, not "
                     "implemented); restart the launchers yourself, resuming with load_state()");
  }
  if (!options.log_dir.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(options.log_dir, ec);
    if (ec) throw UsageError("cannot create --log_dir '" + options.log_dir + "': " + ec.message());
  }
}

// Fills in the default address and, for port 0, a free port; returns whether the port was picked (a restart
// picks a new one).
bool resolve_rendezvous(Config& config) {
  if (config.main_process_ip.empty()) config.main_process_ip = kDefaultAddress;
  const bool pick_port = config.main_process_port == 0;
  if (pick_port) {
    config.main_process_port = pick_free_port(config.main_process_ip);
  } else if (config.machine_rank == 0 && !is_port_free(config.main_process_ip, config.main_process_port)) {
    throw LaunchError(
        "port " + std::to_string(config.main_process_port) + " on " + config.main_process_ip +
        " is already in use (another training run?); choose another with --main_process_port or "
        "use 0 to pick a free one");
  }
  return pick_port;
}

struct OmpThreads {
  bool set = false;  // whether the ranks get OMP_NUM_THREADS
  int threads = 1;
};

OmpThreads choose_omp_threads(const LaunchOptions& options, int local_ranks,
                              std::vector<std::string>& notices) {
  OmpThreads omp;
  omp.set = options.num_cpu_threads_per_process || std::getenv("OMP_NUM_THREADS") == nullptr;
  omp.threads = options.num_cpu_threads_per_process ? *options.num_cpu_threads_per_process
                                                    : std::max(1, available_cores() / local_ranks);
  if (omp.set && local_ranks > 1 && !options.num_cpu_threads_per_process) {
    notices.push_back("accel-launch: setting OMP_NUM_THREADS=" + std::to_string(omp.threads) +
                      " for each rank (" + std::to_string(available_cores()) + " cores / " +
                      std::to_string(local_ranks) +
                      " local ranks) to avoid oversubscribing the CPU; set OMP_NUM_THREADS to override");
  }
  return omp;
}

// This process's environment without the variables the launcher sets for each rank.
std::vector<std::string> inherited_environment() {
  std::vector<std::string> base;
  for (char** entry = environ; entry != nullptr && *entry != nullptr; ++entry) {
    const std::string text = *entry;
    if (!env::set_by_launcher(text.substr(0, text.find('=')))) base.push_back(text);
  }
  return base;
}

// ---- The ranks' memory allocator: torch.backends.xeon.run_cpu's --enable_tcmalloc / --enable_jemalloc ----

// Replaces the directories searched for an allocator's library (':'-separated), ldconfig's cache included.
constexpr const char* kAllocatorSearchPath = "ACCEL_ALLOCATOR_SEARCH_PATH";
// What run_cpu sets in MALLOC_CONF when it preloads jemalloc (unless the user set MALLOC_CONF).
constexpr const char* kRunCpuJemallocConf = "oversize_threshold:1,background_thread:true,metadata_thp:auto";

struct AllocatorChoice {
  std::string preload;      // the ranks' LD_PRELOAD; empty: the inherited one, unchanged
  std::string malloc_conf;  // the ranks' MALLOC_CONF; empty: the inherited one, unchanged
};

// The unversioned name run_cpu looks for (a -dev package's link), then the runtime packages' versioned names
// (Debian/Ubuntu: libtcmalloc-minimal4, libgoogle-perftools4, libjemalloc2).
std::vector<std::string> allocator_library_names(const std::string& allocator) {
  if (allocator == "jemalloc") return {"libjemalloc.so", "libjemalloc.so.2"};
  return {"libtcmalloc.so", "libtcmalloc.so.4", "libtcmalloc_minimal.so", "libtcmalloc_minimal.so.4"};
}

std::vector<std::string> split_list(const std::string& text, const std::string& separators) {
  std::vector<std::string> items;
  std::string item;
  for (const char ch : text + separators.substr(0, 1)) {
    if (separators.find(ch) == std::string::npos) {
      item += ch;
    } else if (!item.empty()) {
      items.push_back(item);
      item.clear();
    }
  }
  return items;
}

// run_cpu's directories ($CONDA_PREFIX/lib, $VIRTUAL_ENV/lib, ~/.local/lib, /usr/local/lib, /usr/local/lib64,
// /usr/lib, /usr/lib64), then the multiarch one (/usr/lib/x86_64-linux-gnu); ACCEL_ALLOCATOR_SEARCH_PATH
// replaces them all and turns off the `ldconfig -p` lookup.
std::vector<std::string> allocator_search_dirs(bool* use_ldconfig) {
  const std::string given = get_env(kAllocatorSearchPath);
  *use_ldconfig = given.empty();
  if (!given.empty()) return split_list(given, ":");
  std::vector<std::string> dirs;
  for (const char* prefix : {"CONDA_PREFIX", "VIRTUAL_ENV"}) {
    if (!get_env(prefix).empty()) dirs.push_back(get_env(prefix) + "/lib");
  }
  for (const std::string& dir :
       {home_directory() + "/.local/lib", std::string("/usr/local/lib"), std::string("/usr/local/lib64"),
        std::string("/usr/lib"), std::string("/usr/lib64")})
    dirs.push_back(dir);
  utsname machine{};
  if (::uname(&machine) == 0) dirs.push_back(std::string("/usr/lib/") + machine.machine + "-linux-gnu");
  return dirs;
}

// The first of `names` in the dynamic linker's cache (`ldconfig -p` lines "\tNAME (FLAGS) => PATH"), or "".
std::string find_in_ldconfig_cache(const std::vector<std::string>& names) {
  for (const char* command : {"/sbin/ldconfig -p 2>/dev/null", "ldconfig -p 2>/dev/null"}) {
    FILE* pipe = ::popen(command, "r");
    if (pipe == nullptr) continue;
    std::map<std::string, std::string> cache;
    char line[4096];
    while (std::fgets(line, sizeof(line), pipe) != nullptr) {
      const std::vector<std::string> words = split_list(line, " \t\n");
      if (words.size() >= 3 && words[words.size() - 2] == "=>") cache.emplace(words[0], words.back());
    }
    ::pclose(pipe);
    if (cache.empty()) continue;  // no ldconfig at this path
    for (const std::string& name : names) {
      std::error_code ec;
      const auto found = cache.find(name);
      if (found != cache.end() && std::filesystem::is_regular_file(found->second, ec)) return found->second;
    }
    return "";
  }
  return "";
}

// What the ranks preload; the line saying so (or the warning that the library is missing) goes to `notices`.
AllocatorChoice choose_allocator(const LaunchOptions& options, std::vector<std::string>& notices) {
  AllocatorChoice choice;
  const std::string allocator = options.allocator.empty() ? default_allocator() : options.allocator;
  if (allocator == "default") return choice;
  const bool set_conf = allocator == "jemalloc" && std::getenv("MALLOC_CONF") == nullptr;
  const std::string inherited = get_env("LD_PRELOAD");
  if (options.allocator_by_default) {
    // The user preloads an allocator of their own (jemalloc, tcmalloc, mimalloc ...): no second one.
    for (const std::string& item : split_list(inherited, ": "))
      if (std::filesystem::path(item).filename().string().find("malloc") != std::string::npos) return choice;
  }
  for (const std::string& item : split_list(inherited, ": ")) {
    if (std::filesystem::path(item).filename().string().rfind("lib" + allocator, 0) == 0) {
      notices.push_back("accel-launch: " + allocator + " is already in LD_PRELOAD (" + item +
                        "): the ranks keep it");
      if (set_conf) choice.malloc_conf = kRunCpuJemallocConf;
      return choice;
    }
  }
  bool use_ldconfig = true;
  const std::vector<std::string> dirs = allocator_search_dirs(&use_ldconfig);
  const std::vector<std::string> names = allocator_library_names(allocator);
  std::string library;
  for (const std::string& dir : dirs) {
    for (const std::string& name : names) {
      std::error_code ec;
      if (library.empty() && std::filesystem::is_regular_file(dir + "/" + name, ec))
        library = dir + "/" + name;
    }
  }
  if (library.empty() && use_ldconfig) library = find_in_ldconfig_cache(names);
  if (library.empty() && options.allocator_by_default) {
    notices.push_back(
        "accel-launch: note: train preloads tcmalloc where it is installed (as PyTorch's run_cpu); "
        "it is not (apt-get install libtcmalloc-minimal4): the ranks run with glibc's malloc");
    return choice;
  }
  if (library.empty()) {
    std::string searched;
    for (const std::string& dir : dirs)
      searched += (searched.empty() ? "" : ", ") + dir;
    std::string tried;
    for (const std::string& name : names)
      tried += (tried.empty() ? "" : ", ") + name;
    notices.push_back(fmt::format(
        "accel-launch: warning: --enable_{0}: none of {1} found in {2}{3}; the ranks run with glibc's malloc "
        "(install it, e.g. apt-get install {4}, or name its directory in {5})",
        allocator, tried, searched, use_ldconfig ? " or in `ldconfig -p`" : "",
        allocator == "jemalloc" ? "libjemalloc2" : "libtcmalloc-minimal4", kAllocatorSearchPath));
    return choice;
  }
  choice.preload = inherited.empty() ? library : library + ":" + inherited;
  if (set_conf) choice.malloc_conf = kRunCpuJemallocConf;
  notices.push_back("accel-launch: preloading " + allocator +
                    " into every rank: LD_PRELOAD=" + choice.preload +
                    (set_conf ? std::string(", MALLOC_CONF=") + kRunCpuJemallocConf : std::string()));
  return choice;
}

// Sets NAME=value in an environment list, replacing an inherited NAME.
void set_variable(std::vector<std::string>& environment, const std::string& name, const std::string& value) {
  environment.erase(std::remove_if(environment.begin(), environment.end(),
                                   [&name](const std::string& v) { return v.rfind(name + "=", 0) == 0; }),
                    environment.end());
  environment.push_back(name + "=" + value);
}

SupervisorOptions make_supervisor_options(const LaunchOptions& options, const Config& config,
                                          const std::string& executable, int local_ranks,
                                          const OmpThreads& omp, const std::string& config_path,
                                          const std::string& run_id, const AllocatorChoice& allocator) {
  std::vector<std::string> base = inherited_environment();
  if (!allocator.preload.empty()) set_variable(base, "LD_PRELOAD", allocator.preload);
  if (!allocator.malloc_conf.empty()) set_variable(base, "MALLOC_CONF", allocator.malloc_conf);
  SupervisorOptions supervisor;
  supervisor.executable = executable;
  supervisor.argv = options.command;
  supervisor.grace_period_seconds = options.grace_period_seconds;
  supervisor.early_exit_report_seconds = options.early_exit_report_seconds;
  supervisor.log_dir = options.log_dir;
  supervisor.console = options.log_dir.empty() || options.tee;
  supervisor.remove_if_launcher_dies = {config_path};
  for (int local = 0; local < local_ranks; ++local) {
    RankSpec rank;
    rank.local_rank = local;
    rank.global_rank = config.machine_rank * local_ranks + local;
    rank.environment = base;
    auto add = [&rank](const std::string& name, const std::string& value) {
      rank.environment.push_back(name + "=" + value);
    };
    add(env::kRank, std::to_string(rank.global_rank));
    add(env::kLocalRank, std::to_string(local));
    add(env::kWorldSize, std::to_string(config.num_processes));
    add(env::kLocalWorldSize, std::to_string(local_ranks));
    add(env::kGroupRank, std::to_string(config.machine_rank));
    add(env::kMasterAddr, config.main_process_ip);
    add(env::kMasterPort, std::to_string(config.main_process_port));
    add(env::kConfigFile, config_path);
    if (!config.source.empty()) {
      std::error_code ec;
      const auto absolute = std::filesystem::absolute(config.source, ec);
      add(env::kConfigSource, ec ? config.source : absolute.string());
    }
    add(env::kLaunched, "1");
    add(env::kRestartCount, "0");
    add(env::kMaxRestarts, std::to_string(options.max_restarts));
    add(env::kConsoleTty, supervisor.console && ::isatty(STDERR_FILENO) ? "1" : "0");
    add(env::kRunId, run_id);
    if (omp.set) add("OMP_NUM_THREADS", std::to_string(omp.threads));
    // Accelerate's gpu_ids: the GPUs this machine's ranks see (rank k uses the k-th of them).
    if (config.gpu_ids != "all" && !config.use_cpu) {
      auto& e = rank.environment;
      e.erase(std::remove_if(e.begin(), e.end(),
                             [](const std::string& v) { return v.rfind("CUDA_VISIBLE_DEVICES=", 0) == 0; }),
              e.end());
      add("CUDA_VISIBLE_DEVICES", config.gpu_ids);
    }
    supervisor.ranks.push_back(std::move(rank));
  }
  return supervisor;
}

// More ranks on this machine than 8 per core (and more than 16) is a typo or a config written for another
// machine far more often than a plan: every rank is a process with its own memory and threads. Refused before
// anything starts unless --oversubscribe says it is meant (mpirun's flag for the same thing).
void check_oversubscription(const LaunchOptions& options, int local_ranks) {
  const int cores = available_cores();
  const int limit = std::max(16, 8 * cores);
  if (local_ranks <= limit || options.oversubscribe) return;
  throw UsageError("num_processes asks for " + std::to_string(local_ranks) +
                   " ranks on this machine, which has " + std::to_string(cores) +
                   " core(s) (more than 8 per core and more than 16); use fewer, or " +
                   "pass --oversubscribe to start them anyway");
}

// After a failure (not after the launcher itself was stopped) every rank starts again, up to
// --max_restarts times; a program that calls load_state() at start continues from its last checkpoint.
void supervise_with_restarts(SupervisorOptions& supervisor, Config& config, const LaunchOptions& options,
                             int local_ranks, bool pick_port) {
  const auto set_port = [&](int port) {
    config.main_process_port = port;
    for (RankSpec& rank : supervisor.ranks) {
      for (std::string& entry : rank.environment) {
        if (entry.rfind(std::string(env::kMasterPort) + "=", 0) == 0)
          entry = std::string(env::kMasterPort) + "=" + std::to_string(port);
      }
    }
  };
  int port_retries = 0;
  for (int restart = 0;; ++restart) {
    const SupervisorResult result = supervise(supervisor);
    if (result.exit_code == 0) return;
    // A port the launcher picked itself is free when picked, but another program can take it before rank 0
    // listens on it (seen with many launches at once): pick another and start again, not counted as a
    // restart. Two launchers can also pick the same port at once: then one job's rank 0 listens and a rank
    // of the other job, refused by that store before it touched the job (Communicator's run identity), is
    // the first to fail, while its own rank 0 fails with EADDRINUSE (seen in a CI run).
    const bool port_taken = result.report.find("EADDRINUSE") != std::string::npos ||
                            result.report.find("ddress already in use") != std::string::npos ||
                            result.report.find(" of another job: run '") != std::string::npos;
    if (pick_port && port_taken && !result.interrupted && port_retries < 3) {
      ++port_retries;
      --restart;
      std::cerr << "accel-launch: port " << config.main_process_port
                << " was taken by another program before rank 0 listened on it; starting the ranks again on "
                   "another free port"
                << std::endl;
      set_port(pick_free_port(config.main_process_ip));
      continue;
    }
    if (result.interrupted || restart >= options.max_restarts) {
      throw RanksFailed(restart == 0 ? result.report
                                     : result.report + "accel-launch: gave up after " +
                                           std::to_string(restart) + " restart(s) (--max_restarts " +
                                           std::to_string(options.max_restarts) + ")\n",
                        result.exit_code);
    }
    std::cerr << result.report << "accel-launch: restarting all " << local_ranks << " rank(s) (restart "
              << restart + 1 << " of " << options.max_restarts << ")" << std::endl;
    if (pick_port) set_port(pick_free_port(config.main_process_ip));
    for (RankSpec& rank : supervisor.ranks) {
      for (std::string& entry : rank.environment) {
        const std::string name = entry.substr(0, entry.find('='));
        if (name == env::kRestartCount) entry = name + "=" + std::to_string(restart + 1);
      }
    }
  }
}

}  // namespace

void run_launch(const LaunchOptions& options) {
  check_launch_options(options);
  std::vector<std::string> notices;
  Config config = resolve_launch_config(options, &notices);
  check_restarts_and_log_dir(options, config);
  const std::string executable = find_executable(options.command.front());
  warn_privileged_port(config);
  const bool pick_port = resolve_rendezvous(config);

  const int local_ranks = config.num_processes / config.num_machines;
  check_oversubscription(options, local_ranks);
  const OmpThreads omp = choose_omp_threads(options, local_ranks, notices);
  const std::string run_id = choose_run_id(options, config, notices);
  const AllocatorChoice allocator = choose_allocator(options, notices);
  for (const std::string& notice : notices)
    std::cerr << notice << "\n";
  std::cerr.flush();

  // From the config file's creation to its removal a stop signal waits for the supervisor instead of ending
  // the launcher by its default action, which would leave the file behind.
  const StopSignalsDeferred deferred;
  const TempConfigFile config_file(config.to_yaml());
  SupervisorOptions supervisor = make_supervisor_options(options, config, executable, local_ranks, omp,
                                                         config_file.path(), run_id, allocator);
  supervise_with_restarts(supervisor, config, options, local_ranks, pick_port);
}

namespace {

// Where this machine is in the job: shared by launch (and train) and test.
void add_machine_options(CLI::App* sub, const std::shared_ptr<LaunchOptions>& options) {
  sub->add_option_function<int>(
      both_spellings("num_machines"), [options](const int& v) { options->num_machines = v; },
      "Number of machines");
  sub->add_option_function<int>(
      both_spellings("machine_rank"), [options](const int& v) { options->machine_rank = v; },
      "Index of this machine, 0..num_machines-1");
  sub->add_option_function<std::string>(
      both_spellings("main_process_ip"), [options](const std::string& v) { options->main_process_ip = v; },
      "Address of machine 0 (default 127.0.0.1)");
  sub->add_option_function<int>(
      both_spellings("main_process_port"), [options](const int& v) { options->main_process_port = v; },
      "Rendezvous port on machine 0 (default 29500; 0 picks a free port, single machine only)");
}

// torch.backends.xeon.run_cpu's allocator flags (both spellings, as run_cpu accepts them); at most one.
void add_allocator_options(CLI::App* sub, const std::shared_ptr<LaunchOptions>& options) {
  CLI::Option* tcmalloc = sub->add_flag_callback(
      both_spellings("enable_tcmalloc"), [options] { options->allocator = "tcmalloc"; },
      "Preload tcmalloc into every rank (LD_PRELOAD; run_cpu's flag): found in run_cpu's directories, the "
      "multiarch one or `ldconfig -p` (or ACCEL_ALLOCATOR_SEARCH_PATH), else a warning and glibc's malloc");
  CLI::Option* jemalloc = sub->add_flag_callback(
      both_spellings("enable_jemalloc"), [options] { options->allocator = "jemalloc"; },
      std::string("Preload jemalloc into every rank, found as for --enable_tcmalloc; MALLOC_CONF=") +
          kRunCpuJemallocConf + " as run_cpu sets it, unless MALLOC_CONF is set");
  CLI::Option* glibc = sub->add_flag_callback(
      both_spellings("use_default_allocator"), [options] { options->allocator = "default"; },
      "glibc's malloc: LD_PRELOAD left as it is (the default)");
  tcmalloc->excludes(jemalloc)->excludes(glibc);
  jemalloc->excludes(glibc);
}

}  // namespace

void add_launch_options(CLI::App* sub, const std::shared_ptr<LaunchOptions>& options) {
  sub->add_option(both_spellings("config_file"), options->config_file,
                  "YAML config (default: " + default_config_path() + " if it exists)");
  sub->add_option_function<int>(
      both_spellings("num_processes"), [options](const int& v) { options->num_processes = v; },
      "Total number of ranks over all machines");
  add_machine_options(sub, options);
  sub->add_option_function<std::string>(
         both_spellings("mixed_precision"), [options](const std::string& v) { options->mixed_precision = v; },
         "Mixed precision")
      ->type_name("no|fp16|bf16");
  sub->add_option_function<std::string>(
         both_spellings("log_with"), [options](const std::string& v) { options->log_with = v; },
         "Experiment trackers the main process writes (the config's log_with)")
      ->type_name("tensorboard|csv|jsonl|all|LIST");
  sub->add_option_function<int>(
      both_spellings("gradient_accumulation_steps"),
      [options](const int& v) { options->gradient_accumulation_steps = v; }, "Gradient accumulation steps");
  sub->add_option_function<std::string>(
         both_spellings("backend"), [options](const std::string& v) { options->backend = v; },
         "Training backend (default: from the config; ddp when --num_processes > 1)")
      ->type_name(backend_names_help("|"));
  sub->add_flag("--cpu", options->cpu, "Run on CPU even if a GPU is present (use_cpu)");
  sub->add_flag("--debug", options->debug, "Check tensor shapes on every rank before each collective");
  sub->add_flag("--oversubscribe", options->oversubscribe,
                "Start more than 8 ranks per core (and more than 16) on this machine anyway");
  sub->add_option(both_spellings("grace_period"), options->grace_period_seconds,
                  "Seconds between SIGTERM and SIGKILL when stopping the ranks; a second Ctrl-C, or a second "
                  "signal 1 s or more after the first, kills them at once (sooner copies, as `timeout` "
                  "sends, are absorbed)")
      ->capture_default_str();
  sub->add_option(both_spellings("early_exit_report"), options->early_exit_report_seconds,
                  "Name a rank that exited 0 when the others still run this many seconds later")
      ->capture_default_str();
  sub->add_option(both_spellings("max_restarts"), options->max_restarts,
                  "Start all ranks again after a failure, up to this many times (one machine)")
      ->capture_default_str();
  sub->add_option(both_spellings("log_dir"), options->log_dir,
                  "Also write each rank's output to <log_dir>/rank_<N>.log (console output only with --tee)");
  sub->add_flag("--tee", options->tee, "With --log_dir, show the ranks' output on the console too");
  sub->add_option_function<std::string>(
         both_spellings("run_id") + "," + both_spellings("rdzv_id"),
         [options](const std::string& v) { options->run_id = v; },
         "The job's rendezvous id, given to the ranks as TORCHELASTIC_RUN_ID (default: random per launch; "
         "\"none\" with num_machines > 1): a rank of another job on the same port is refused. Give every "
         "machine's launcher the same id")
      ->type_name("ID");
  sub->add_option_function<int>(
      both_spellings("num_cpu_threads_per_process"),
      [options](const int& v) { options->num_cpu_threads_per_process = v; },
      "OMP_NUM_THREADS of every rank (default: cores / ranks on this machine)");
  add_allocator_options(sub, options);
  // Everything from PROGRAM on is the program's, passed exactly as given: even arguments that look like our
  // options, and arguments CLI11 would otherwise split ("[q_proj, v_proj]" is a vector's syntax to it).
  sub->prefix_command();
  sub->footer(
      "PROGRAM [ARGS...]: the program to run and its arguments, passed to every rank exactly as given "
      "(everything after PROGRAM is the program's, even what looks like an option here)");
  sub->parse_complete_callback([sub, options] {
    auto args = sub->remaining();
    if (!args.empty() && args.front() == "--") args.erase(args.begin());
    if (!args.empty() && args.front().size() > 1 && args.front()[0] == '-') {
      throw UsageError(
          fmt::format("{}: unknown option '{}': options of accel-launch {} come before PROGRAM "
                      "(accel-launch {} --help lists them)",
                      sub->get_name(), args.front(), sub->get_name(), sub->get_name()));
    }
    options->command = std::move(args);
  });
}

void setup_launch_command(CLI::App& app) {
  auto options = std::make_shared<LaunchOptions>();
  CLI::App* sub = app.add_subcommand("launch",
                                     "Run PROGRAM as num_processes / num_machines ranks on this machine, "
                                     "with RANK, WORLD_SIZE, MASTER_ADDR, "
                                     "MASTER_PORT, ... set; stops all ranks when one fails");
  add_launch_options(sub, options);
  sub->callback([options] { run_launch(*options); });
}

namespace {

// accel-test-check, installed and built next to accel-launch.
std::string check_program() {
  std::error_code ec;
  const auto self = std::filesystem::read_symlink("/proc/self/exe", ec);
  const auto path =
      (ec ? std::filesystem::path("accel-test-check") : self.parent_path() / "accel-test-check");
  if (!std::filesystem::exists(path)) {
    throw UsageError(
        "test: the check program '" + path.string() +
        "' is missing; it is built (target accel-test-check) and installed next to accel-launch");
  }
  return path.string();
}

}  // namespace

void setup_test_command(CLI::App& app) {
  auto options = std::make_shared<LaunchOptions>();
  CLI::App* sub = app.add_subcommand(
      "test",
      "Run a built-in check on the configured ranks (process layout, collectives, data sharding, a few "
      "training steps against one process), as `accelerate test`");
  sub->add_option(both_spellings("config_file"), options->config_file,
                  "Config to test (default: the default config file, if any)");
  sub->add_option_function<int>(
      both_spellings("num_processes"), [options](const int& v) { options->num_processes = v; },
      "Total number of ranks");
  sub->add_option_function<std::string>(
      both_spellings("backend"), [options](const std::string& v) { options->backend = v; },
      "Training backend");
  // A config for several machines is tested as `accelerate test` tests it: on every machine, each launcher
  // given its machine_rank (and machine 0's address and an explicit port).
  add_machine_options(sub, options);
  sub->add_flag("--cpu", options->cpu, "Run on CPU even if a GPU is present");
  sub->callback([options] {
    LaunchOptions launch = *options;
    launch.command = {check_program()};
    const Config config = resolve_launch_config(launch);
    try {
      run_launch(launch);
    } catch (const RanksFailed& e) {
      throw RanksFailed(std::string(e.what()) + "accel-launch test: FAILED (the check's message is above)\n",
                        e.exit_code());
    }
    std::cout << "accel-launch test: passed on " << config.num_processes << " process(es) with backend "
              << config.backend << " (mixed_precision " << to_string(config.mixed_precision) << ")"
              << std::endl;
  });
}

}  // namespace accel::launcher
