// Cross-field validation of accel::Config, shared by Config::validate (no line numbers) and loading (the
// line of the offending key).
#include "config/config_detail.hpp"

#include <accel/monitor/tracking.hpp>

namespace accel {
namespace config_detail {

std::string compute_environment_message(const std::string& value) {
  return fmt::format(
      "compute_environment: '{}' is not supported by accelerate-cpp (it starts the ranks on this machine and "
      "its peers, not on a cloud service such as SageMaker); allowed values: LOCAL_MACHINE",
      value);
}

namespace {

// config_version, compute_environment and log_with.
void check_version_environment_and_trackers(const Config& c, const FailKey& fail_key) {
  if (c.config_version != 1) {
    fail_key("config_version",
             fmt::format("config_version: this build of accelerate-cpp reads config_version 1 only, got {}; "
                         "upgrade accelerate-cpp or write a new file with 'accel-launch config'",
                         c.config_version));
  }
  if (c.compute_environment != "LOCAL_MACHINE") {
    fail_key("compute_environment", compute_environment_message(c.compute_environment));
  }
  try {
    parse_log_with(c.log_with);
  } catch (const ConfigError& e) {
    fail_key("log_with", e.what());
  }
}

// num_machines, num_processes and machine_rank, each on its own, then num_processes over the machines.
void check_process_layout(const Config& c, const FailKey& fail_key) {
  if (c.num_machines < 1) {
    fail_key("num_machines", fmt::format("num_machines ({}) must be at least 1", c.num_machines));
  }
  if (c.num_processes < 1) {
    fail_key("num_processes", fmt::format("num_processes ({}) must be at least 1", c.num_processes));
  }
  if (c.machine_rank < 0 || c.machine_rank >= c.num_machines) {
    fail_key("machine_rank",
             fmt::format("machine_rank ({}) must be {} num_machines ({}); set machine_rank to 0..{}",
                         c.machine_rank, c.machine_rank < 0 ? "0 or more and less than" : "less than",
                         c.num_machines, c.num_machines - 1));
  }
  if (c.num_processes % c.num_machines != 0) {
    const int below = c.num_processes / c.num_machines * c.num_machines;
    const int above = below + c.num_machines;
    fail_key(
        "num_processes",
        fmt::format("num_processes ({}) must be a multiple of num_machines ({}), as it counts the processes "
                    "of all machines; set num_processes to {}",
                    c.num_processes, c.num_machines,
                    below > 0 ? fmt::format("{} or {}", below, above) : std::to_string(above)));
  }
}

// num_processes within the backend's max_processes (1 for the single-process backends).
void check_backend_process_limit(const Config& c, const FailKey& fail_key) {
  const BackendPart* part = find_part(c.backend);
  if (!part || part->info.max_processes <= 0 || c.num_processes <= part->info.max_processes) return;
  std::vector<std::string> types, names;
  for (const BackendPart& other : backend_parts()) {
    if (other.info.max_processes == 0) {
      names.push_back(other.info.name);
      for (const std::string& type : other.info.distributed_types)
        types.push_back(type);
    }
  }
  fail_key("num_processes",
           fmt::format("num_processes ({}) needs a distributed backend, but the backend is {}; set "
                       "distributed_type: {} (or backend: one of {}), or num_processes: {}",
                       c.num_processes, c.backend, join(types, " | "), join(names, ", "),
                       part->info.max_processes));
}

// The port, accumulation steps, timeouts, bucket sizes and pipeline stages.
void check_numeric_settings(const Config& c, const FailKey& fail_key) {
  if (c.main_process_port < 0 || c.main_process_port > 65535) {
    fail_key(
        "main_process_port",
        fmt::format("main_process_port ({}) must be in 0..65535 (0 picks a free port)", c.main_process_port));
  }
  if (c.gradient_accumulation_steps < 1) {
    fail_key("gradient_accumulation_steps", fmt::format("gradient_accumulation_steps ({}) must be at least 1",
                                                        c.gradient_accumulation_steps));
  }
  if (!(c.collective_timeout_seconds > 0) || !std::isfinite(c.collective_timeout_seconds)) {
    fail_key("collective_timeout_seconds",
             fmt::format("collective_timeout_seconds ({}) must be a positive number",
                         c.collective_timeout_seconds));
  }
  // A timeout is how long a rank stuck in a collective (a crashed or diverged peer) hangs the job before it
  // is reported: past a week it no longer bounds anything (PyTorch's default is 30 minutes, NCCL's 10).
  constexpr double kMaxTimeoutSeconds = 7 * 24 * 3600.0;
  if (c.collective_timeout_seconds > kMaxTimeoutSeconds) {
    fail_key(
        "collective_timeout_seconds",
        fmt::format("collective_timeout_seconds ({}) is more than 7 days ({} s): a rank stuck in a "
                    "collective would hang the job that long before anything is reported; use at most {} "
                    "(the default, {}, is PyTorch's 30 minutes)",
                    c.collective_timeout_seconds, kMaxTimeoutSeconds, kMaxTimeoutSeconds,
                    Config{}.collective_timeout_seconds));
  }
  // At most 1 TiB: the engines convert MiB to bytes in 64 bits.
  constexpr double kMaxBucketMib = 1024.0 * 1024.0;
  if (!(c.ddp_bucket_cap_mb > 0) || !(c.ddp_bucket_cap_mb <= kMaxBucketMib)) {
    fail_key("ddp_bucket_cap_mb",
             fmt::format("ddp_bucket_cap_mb ({}) must be a positive number of MiB, at most "
                         "1048576 (1 TiB)",
                         c.ddp_bucket_cap_mb));
  }
  if (!(c.ddp_first_bucket_cap_mb > 0) || !(c.ddp_first_bucket_cap_mb <= kMaxBucketMib)) {
    fail_key(
        "ddp_first_bucket_cap_mb",
        fmt::format("ddp_first_bucket_cap_mb ({}) must be a positive number of MiB, at most 1048576 (1 TiB)",
                    c.ddp_first_bucket_cap_mb));
  }
  if (c.tensor_parallel_size < 1) {
    fail_key("parallelism_config.parallelism_config_tp_size",
             fmt::format("parallelism_config_tp_size ({}) must be at least 1 (1: no tensor parallelism)",
                         c.tensor_parallel_size));
  }
  if (c.pipeline.stages > 1 && c.num_processes % c.pipeline.stages != 0) {
    fail_key(
        "pipeline_config.stages",
        fmt::format("pipeline_config.stages ({}) must divide num_processes ({}): each stage runs in "
                    "num_processes / stages processes, one per data-parallel replica of the pipeline; set "
                    "num_processes to a multiple of {}",
                    c.pipeline.stages, c.num_processes, c.pipeline.stages));
  }
}

}  // namespace

void validate_config(const Config& c, const LineMap& lines) {
  const FailKey fail_key = [&](const std::string& key, const std::string& body) {
    const auto it = lines.find(key);
    fail(c.source, it == lines.end() ? 0 : it->second, key, body);
  };
  check_version_environment_and_trackers(c, fail_key);
  check_process_layout(c, fail_key);
  check_backend_process_limit(c, fail_key);
  check_numeric_settings(c, fail_key);
  for (const BackendPart& part : backend_parts()) {
    if (part.validate) part.validate(c, fail_key);
  }
}

}  // namespace config_detail

void Config::validate() const {
  config_detail::validate_config(*this, config_detail::LineMap{});
}

}  // namespace accel
