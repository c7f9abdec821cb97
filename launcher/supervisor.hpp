#pragma once
/// \file supervisor.hpp
/// Runs the ranks of one machine: spawns each in its own process group, streams its output line by line with
/// a `[rank N] ` prefix, and stops all of them as soon as one fails or the launcher is interrupted ("first
/// failure wins"). Torch-free; POSIX only.

#include <signal.h>
#include <sys/types.h>

#include <cstddef>
#include <string>
#include <vector>

namespace accel::launcher {

/// One rank to start on this machine.
struct RankSpec {
  /// Rank in the whole world (`RANK`); shown in the `[rank N] ` prefix and in reports.
  int global_rank = 0;
  /// Rank on this machine (`LOCAL_RANK`).
  int local_rank = 0;
  /// The complete environment of the process, as `NAME=value` strings.
  std::vector<std::string> environment;
};

/// What to run and how to stop it.
struct SupervisorOptions {
  /// Path of the executable, already checked to exist and be executable (see `find_executable`).
  std::string executable;
  /// Its argv; argv[0] is the program as the user typed it.
  std::vector<std::string> argv;
  /// The ranks of this machine.
  std::vector<RankSpec> ranks;
  /// Seconds between the stop signal (SIGTERM, or the signal the launcher received) and SIGKILL. A second
  /// signal cuts it short (see `supervise`).
  double grace_period_seconds = 3.0;
  /// A rank that exited 0 while others still run this many seconds later is named on stderr (the others are
  /// likely waiting for it in a collective); ranks that finish a few moments apart stay quiet.
  double early_exit_report_seconds = 5.0;
  /// Lines of each rank's output (stdout and stderr together) kept for the failure report.
  std::size_t tail_lines = 20;
  /// File descriptors that receive the prefixed stdout and stderr lines of the ranks.
  int stdout_fd = 1;
  /// See `stdout_fd`.
  int stderr_fd = 2;
  /// When set, each rank's lines (without the prefix) are also appended to `<log_dir>/rank_<N>.log`.
  std::string log_dir;
  /// Whether the ranks' lines go to `stdout_fd` / `stderr_fd` (false: log files only; the failure report
  /// still quotes the last lines).
  bool console = true;
  /// Files the launcher's watchdog deletes if the launcher dies before its ranks are reaped (SIGKILL, a
  /// crash): the resolved config file, which the launcher itself deletes when it exits normally. (A kill in
  /// the moment between the file's creation and the watchdog's start still leaves it.)
  std::vector<std::string> remove_if_launcher_dies;
};

/// How a supervised run ended.
struct SupervisorResult {
  /// 0 when every rank exited 0; otherwise the first failing rank's exit code, 128 + the signal that killed
  /// it, or 128 + the signal (SIGINT, SIGTERM, SIGHUP) that stopped the launcher.
  int exit_code = 0;
  /// Empty on success; otherwise the root-cause report, e.g.
  /// "accel-launch: rank 1 (local rank 1, pid 1234) failed with exit code 3\n---- last 2 lines of rank 1 ----
  /// \n...\n----\n".
  std::string report;
  /// The launcher itself received SIGINT, SIGTERM or SIGHUP (a run to stop, not to restart).
  bool interrupted = false;
};

/// Runs `options.ranks` to completion. The ranks' stdin is /dev/null (they run in background process groups
/// so that Ctrl-C reaches only the launcher, which forwards it). The first SIGINT, SIGTERM or SIGHUP sent to
/// the launcher while this runs is forwarded to every rank's process group and starts the grace period, after
/// which SIGKILL follows. A later signal sends SIGKILL at once when it is a Ctrl-C (SIGINT)
/// `kRepeatedInterruptSeconds` or more after the first signal, or any signal `kDuplicateSignalSeconds` or
/// more after it; sooner ones are copies of the first and absorbed (`timeout` sends its signal to the
/// launcher and to its process group, microseconds apart). A signal that arrives while the ranks are being
/// started stops the starting: no further rank is forked, and those already started are stopped as above.
/// Throws accel::LaunchError when the ranks cannot be started (ranks already running are killed first).
SupervisorResult supervise(const SupervisorOptions& options);

/// A second signal sooner than this after the first is taken for a copy of it (see `supervise`).
inline constexpr double kDuplicateSignalSeconds = 1.0;
/// A SIGINT this much later than the first signal or more is a second Ctrl-C (see `supervise`).
inline constexpr double kRepeatedInterruptSeconds = 0.2;

/// The escalation rule of `supervise`: whether a `second` signal, `seconds_later` after the first stop
/// signal, kills the ranks at once (true) or is absorbed as a copy of the first (false).
bool escalates_to_kill(int second, double seconds_later);

/// Blocks SIGINT, SIGTERM and SIGHUP while it lives, so that one arriving meanwhile waits, pending, instead
/// of ending the launcher by its default action (which would leave the resolved config file behind):
/// `supervise` unblocks them with its handlers installed and acts on a pending one before it forks a rank.
/// Its destructor discards those still pending (the ranks are gone by then: nothing is left to stop) and
/// restores the previous signal mask.
class StopSignalsDeferred {
 public:
  StopSignalsDeferred();
  ~StopSignalsDeferred();
  StopSignalsDeferred(const StopSignalsDeferred&) = delete;
  StopSignalsDeferred& operator=(const StopSignalsDeferred&) = delete;

 private:
  sigset_t previous_{};
};

/// The path to execute for `program`: `program` itself when it contains a '/', else the first match in
/// `$PATH`. Throws accel::LaunchError naming the program when it does not exist, is a directory or is not
/// executable.
std::string find_executable(const std::string& program);

/// "SIGTERM" for SIGTERM etc.; "signal N" when the number has no common name.
std::string signal_name(int signal_number);

/// Keeps, in order, the process groups of `groups[0, count)` that still have a process, and returns how many:
/// a group whose processes have all exited is dropped, since the kernel may give its number to an unrelated
/// group later, which a kill of the rank groups must then not reach. (The launcher and its watchdog check
/// every second; a number is reused only after the kernel's PID counter has wrapped past it.)
std::size_t prune_empty_groups(pid_t* groups, std::size_t count);

}  // namespace accel::launcher
