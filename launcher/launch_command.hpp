#pragma once
/// \file launch_command.hpp
/// `accel-launch launch [options] PROGRAM [ARGS...]`: resolves the config (file, then flags), checks it, the
/// program and the rendezvous port before anything starts, then runs this machine's ranks under the
/// supervisor.

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "accel/config/config.hpp"
#include "accel/errors.hpp"

namespace CLI {
class App;
}

namespace accel::launcher {

/// Options of `launch`. An unset optional keeps the value of the config file (or its default).
struct LaunchOptions {
  /// `--config_file`; empty means `default_config_path()` if that file exists, else all defaults.
  std::string config_file;
  /// `--num_processes`: ranks over all machines.
  std::optional<int> num_processes;
  /// `--num_machines`.
  std::optional<int> num_machines;
  /// `--machine_rank`: index of this machine, 0..num_machines-1.
  std::optional<int> machine_rank;
  /// `--main_process_ip`: address of machine 0 (default 127.0.0.1 on a single machine).
  std::optional<std::string> main_process_ip;
  /// `--main_process_port`: rendezvous port on machine 0; 0 picks a free one (single machine only).
  std::optional<int> main_process_port;
  /// `--mixed_precision`: `no|fp16|bf16`.
  std::optional<std::string> mixed_precision;
  /// --log_with: the config's log_with (experiment trackers).
  std::optional<std::string> log_with;
  /// `--gradient_accumulation_steps`.
  std::optional<int> gradient_accumulation_steps;
  /// `--backend`: `local|ddp|fsdp|zero`.
  std::optional<std::string> backend;
  /// `--cpu`: sets `use_cpu`.
  bool cpu = false;
  /// `--debug`: sets `debug` (shape checks before every collective).
  bool debug = false;
  /// `--oversubscribe`: start more than 8 ranks per core (and more than 16) on this machine; refused
  /// otherwise.
  bool oversubscribe = false;
  /// `--grace_period`: seconds between SIGTERM and SIGKILL when stopping the ranks.
  double grace_period_seconds = 3.0;
  /// Seconds a rank that exited 0 may leave the others running before the launcher names it.
  double early_exit_report_seconds = 5.0;
  /// `--max_restarts`: after a rank fails, start all ranks again up to this many times (one machine only, as
  /// torchrun's `--max-restarts` without elastic rendezvous). Ranks see TORCHELASTIC_RESTART_COUNT.
  int max_restarts = 0;
  /// `--log_dir`: each rank's output also goes to `<log_dir>/rank_<N>.log` (appended across restarts).
  std::string log_dir;
  /// `--tee`: with `--log_dir`, also show the ranks' output on the console (without it, files only).
  bool tee = false;
  /// `--num_cpu_threads_per_process`: OMP_NUM_THREADS of every rank (default: cores / local ranks).
  std::optional<int> num_cpu_threads_per_process;
  /// `--run_id`: the job's identity in the rendezvous (torchrun's `--rdzv_id`), given to every rank as
  /// TORCHELASTIC_RUN_ID. Unset: a random id per launch on one machine; "none" (torchrun's default) with
  /// several machines, whose launchers must all be given the same id to agree on one.
  std::optional<std::string> run_id;
  /// `--enable_tcmalloc`, `--enable_jemalloc`, `--use_default_allocator` (torch.backends.xeon.run_cpu's
  /// flags): "tcmalloc" or "jemalloc" is preloaded into every rank (LD_PRELOAD, prepended to an inherited
  /// one; found as run_cpu finds it, plus the multiarch directory and `ldconfig -p`; a warning naming what
  /// was searched when it is missing, and the ranks run with glibc's malloc); "default" leaves LD_PRELOAD as
  /// it is. Empty: the launcher's default (`default_allocator()`).
  std::string allocator;
  /// Set by `accel-launch train` when no allocator flag was given: `allocator` ("tcmalloc") is preloaded
  /// where it is found, and where it is not the ranks run with glibc's malloc after a one-line note (not a
  /// warning: nothing was asked for).
  bool allocator_by_default = false;
  /// PROGRAM followed by its arguments (everything after PROGRAM belongs to it).
  std::vector<std::string> command;
};

/// The ranks did not all succeed: one failed, or the launcher was stopped by a signal. `what()` is the full
/// root-cause report (it already starts with "accel-launch: "); `main` prints it and exits with
/// `exit_code()` (the failing rank's exit code, or 128 + signal).
class RanksFailed : public LaunchError {
 public:
  /// `report` as produced by the supervisor; `exit_code` in 1..255.
  RanksFailed(const std::string& report, int exit_code) : LaunchError(report), exit_code_(exit_code) {}
  /// What the launcher process should exit with.
  int exit_code() const noexcept { return exit_code_; }

 private:
  int exit_code_;
};

/// The configuration the ranks will see: the config file (`--config_file`, else the default file if it
/// exists, else defaults) with the flags of `options` applied, validated. With `--num_processes` > 1 and
/// neither `--backend` nor a distributed backend in the file, the backend becomes `ddp` (as `accelerate
/// launch` does); a line saying so is appended to `notices` when given. Throws accel::ConfigError naming the
/// file/flag, value and fix.
Config resolve_launch_config(const LaunchOptions& options, std::vector<std::string>* notices = nullptr);

/// The allocator of `accel-launch launch` given no allocator flag: "default" (glibc's malloc, LD_PRELOAD
/// untouched), as torchrun and `accelerate launch` preload nothing. `accel-launch train` (the fine-tuning
/// recipe's command) preloads tcmalloc where it is installed, as PyTorch's run_cpu does by default: it
/// measured better memory at the same CPU a step on the LoRA/QLoRA rows (BENCHMARKS.md, eleventh update), and
/// the suite passes under it.
const char* default_allocator();

/// Checks the config, the program and the port, then runs this machine's ranks until they all exit.
/// Throws ConfigError/UsageError (nothing started), LaunchError (nothing started, or the supervisor failed),
/// or RanksFailed (the ranks ran and did not all exit 0).
void run_launch(const LaunchOptions& options);
/// Registers launch's options and its PROGRAM [ARGS...] positional on `sub` (launch and train share them).
void add_launch_options(CLI::App* sub, const std::shared_ptr<LaunchOptions>& options);

}  // namespace accel::launcher
