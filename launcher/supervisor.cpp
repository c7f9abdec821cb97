/// \file supervisor.cpp
/// fork/exec of the ranks and one poll() loop over their pipes plus a self-pipe that carries signals
/// (SIGCHLD, and SIGINT/SIGTERM/SIGHUP to forward), so no thread per rank and no work in signal handlers.

#include "supervisor.hpp"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <deque>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "accel/errors.hpp"

namespace accel::launcher {
namespace {

using Clock = std::chrono::steady_clock;

// Signals the launcher forwards to the ranks.
constexpr int kForwardedSignals[] = {SIGINT, SIGTERM, SIGHUP};
// Longest partial line kept before it is emitted anyway, so a rank that never prints '\n' cannot exhaust
// memory.
constexpr std::size_t kMaxLineBytes = 64 * 1024;
// After SIGKILL, how long to wait for the kernel to reap before giving up on a rank (stuck in D state).
constexpr auto kReapTimeout = std::chrono::seconds(2);
// How long output is still read after every rank has exited while a grandchild keeps a pipe open.
constexpr auto kDrainAfterStop = std::chrono::milliseconds(500);

// Write end of the self-pipe; the handlers only write(2) the signal number into it.
volatile sig_atomic_t g_signal_pipe = -1;

extern "C" void on_signal(int signal_number) {
  const int saved = errno;
  const unsigned char byte = static_cast<unsigned char>(signal_number);
  if (g_signal_pipe >= 0) {
    [[maybe_unused]] const ssize_t ignored = ::write(g_signal_pipe, &byte, 1);
  }
  errno = saved;
}

void close_fd(int& fd) {
  if (fd >= 0) ::close(fd);
  fd = -1;
}

// A rank makes itself the leader of a new session (and so of its own process group) as the first thing
// after fork; the launcher waits for that, so that kill(-pid) reaches it from then on. torchrun does the
// same (start_new_session): under the kernel's autogroup scheduling (sched_autogroup_enabled) CPU time is
// shared between sessions first, so ranks left in the launcher's session would share one session's share of
// a loaded machine between them, where torchrun's ranks get one each. Bounded: a child that never gets there
// (killed before it ran) is put in its own process group from here, as before.
void wait_for_own_session(pid_t pid) {
  for (int i = 0; i < 20000; ++i) {  // 2 s in steps of 100 us
    if (::getsid(pid) == pid) return;
    struct timespec pause {
      0, 100000
    };
    ::nanosleep(&pause, nullptr);
  }
  ::setpgid(pid, pid);
}

// Writes everything, retrying on EINTR/EAGAIN; gives up silently when the reader is gone (EPIPE), because the
// ranks must still be supervised when nobody reads the launcher's output any more.
void write_all(int fd, const std::string& text) {
  std::size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n > 0) {
      done += static_cast<std::size_t>(n);
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else if (n < 0 && errno == EAGAIN) {
      pollfd p{fd, POLLOUT, 0};
      ::poll(&p, 1, 100);
    } else {
      return;
    }
  }
}

// Installs the forwarding/SIGCHLD handlers and the self-pipe; restores everything on destruction.
class SignalGuard {
 public:
  SignalGuard() {
    int fds[2];
    if (::pipe2(fds, O_CLOEXEC | O_NONBLOCK) != 0) {
      throw LaunchError(std::string("cannot create the signal pipe: ") + std::strerror(errno));
    }
    read_fd_ = fds[0];
    write_fd_ = fds[1];
    g_signal_pipe = write_fd_;
    struct sigaction action {};
    action.sa_handler = on_signal;
    sigemptyset(&action.sa_mask);
    action.sa_flags = SA_RESTART;
    for (std::size_t i = 0; i < std::size(kForwardedSignals); ++i) {
      sigaction(kForwardedSignals[i], nullptr, &saved_[i]);
      // A signal ignored on entry (nohup, background job of a non-interactive shell) stays ignored, by us and
      // by the ranks: a training run started with nohup must survive the end of the session.
      if (saved_[i].sa_handler != SIG_IGN) sigaction(kForwardedSignals[i], &action, nullptr);
    }
    action.sa_flags = SA_RESTART | SA_NOCLDSTOP;
    sigaction(SIGCHLD, &action, &saved_chld_);
    // A closed stdout of the launcher must not kill it while ranks still run.
    struct sigaction ignore {};
    ignore.sa_handler = SIG_IGN;
    sigemptyset(&ignore.sa_mask);
    sigaction(SIGPIPE, &ignore, &saved_pipe_);
    // Blocked by a StopSignalsDeferred of the caller: one that waited, pending, reaches the handler now.
    sigset_t forwarded;
    sigemptyset(&forwarded);
    for (int s : kForwardedSignals)
      sigaddset(&forwarded, s);
    sigprocmask(SIG_UNBLOCK, &forwarded, &saved_mask_);
  }
  SignalGuard(const SignalGuard&) = delete;
  SignalGuard& operator=(const SignalGuard&) = delete;
  ~SignalGuard() {
    // The mask first: a signal that arrives from here on waits again if it waited before.
    sigprocmask(SIG_SETMASK, &saved_mask_, nullptr);
    for (std::size_t i = 0; i < std::size(kForwardedSignals); ++i) {
      sigaction(kForwardedSignals[i], &saved_[i], nullptr);
    }
    sigaction(SIGCHLD, &saved_chld_, nullptr);
    sigaction(SIGPIPE, &saved_pipe_, nullptr);
    g_signal_pipe = -1;
    close_fd(read_fd_);
    close_fd(write_fd_);
  }
  int read_fd() const { return read_fd_; }
  /// Puts the signal dispositions the launcher was started with back, for a child between fork and exec
  /// (async-signal-safe: sigaction only).
  void restore_for_child() const {
    for (std::size_t i = 0; i < std::size(kForwardedSignals); ++i) {
      sigaction(kForwardedSignals[i], &saved_[i], nullptr);
    }
    sigaction(SIGCHLD, &saved_chld_, nullptr);
    sigaction(SIGPIPE, &saved_pipe_, nullptr);
  }

 private:
  int read_fd_ = -1;
  int write_fd_ = -1;
  struct sigaction saved_[std::size(kForwardedSignals)]{};
  struct sigaction saved_chld_ {};
  struct sigaction saved_pipe_ {};
  sigset_t saved_mask_{};
};

// Most rank process groups one watchdog keeps (a launcher starts at most this many ranks on its machine).
constexpr std::size_t kMaxWatchedGroups = 65536;
pid_t g_watched_groups[kMaxWatchedGroups];  // the watchdog's copy (written in the child only)

// The watchdog process, after fork: only async-signal-safe calls. Reads the ranks' process groups from `fd`
// until the launcher writes 0 (it finished and reaped its ranks: nothing to do) or the pipe ends without it
// (the launcher died, killed with SIGKILL: every group is killed and the `files` are deleted).
[[noreturn]] void watchdog_main(int fd, const std::vector<const char*>& files) {
  std::size_t count = 0;
  unsigned char bytes[sizeof(pid_t)];
  std::size_t have = 0;
  for (;;) {
    // Every second without news, the groups that emptied are forgotten (their numbers may be reused).
    pollfd p{fd, POLLIN, 0};
    const int ready = ::poll(&p, 1, 1000);
    if (ready < 0 && errno == EINTR) continue;
    if (ready == 0) {
      count = prune_empty_groups(g_watched_groups, count);
      continue;
    }
    const ssize_t n = ::read(fd, bytes + have, sizeof(bytes) - have);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    have += static_cast<std::size_t>(n);
    if (have < sizeof(bytes)) continue;
    have = 0;
    pid_t group = 0;
    std::memcpy(&group, bytes, sizeof(group));
    if (group == 0) ::_exit(0);
    if (count < kMaxWatchedGroups) g_watched_groups[count++] = group;
  }
  for (std::size_t i = 0; i < count; ++i)
    ::kill(-g_watched_groups[i], SIGKILL);
  for (const char* file : files)
    ::unlink(file);
  ::_exit(0);
}

// PR_SET_PDEATHSIG ends each rank when the launcher dies, but not what a rank started (the program of a
// wrapper script, a helper): a small process forked before the ranks holds the read end of a pipe to which
// the launcher writes each rank's process group, and kills those groups when the pipe ends without the
// launcher's "finished" mark; it then also deletes the files the launcher would have deleted on its way out.
// It sits in a process group of its own (Ctrl-C in a terminal does not reach it) and ignores the signals the
// launcher forwards.
class GroupWatchdog {
 public:
  explicit GroupWatchdog(const std::vector<std::string>& remove_if_launcher_dies) {
    std::vector<const char*> files;  // built before fork: the child only reads it
    for (const std::string& file : remove_if_launcher_dies)
      files.push_back(file.c_str());
    int fds[2];
    if (::pipe2(fds, O_CLOEXEC) != 0)
      throw LaunchError(std::string("cannot create the watchdog's pipe: ") + std::strerror(errno));
    // Signals stay blocked across fork, as for the ranks: the launcher's handlers never run in the child.
    sigset_t all;
    sigset_t previous;
    sigfillset(&all);
    sigprocmask(SIG_BLOCK, &all, &previous);
    const pid_t pid = ::fork();
    if (pid == 0) {
      ::setpgid(0, 0);
      struct sigaction ignore {};
      ignore.sa_handler = SIG_IGN;
      sigemptyset(&ignore.sa_mask);
      for (int s : {SIGINT, SIGTERM, SIGHUP, SIGPIPE, SIGQUIT})
        sigaction(s, &ignore, nullptr);
      struct sigaction fallback {};
      fallback.sa_handler = SIG_DFL;
      sigemptyset(&fallback.sa_mask);
      sigaction(SIGCHLD, &fallback, nullptr);
      sigset_t none;
      sigemptyset(&none);
      sigprocmask(SIG_SETMASK, &none, nullptr);
      // Holds none of the launcher's files: its output pipes end when the launcher's do.
      const int null_fd = ::open("/dev/null", O_RDWR);
      for (int target = 0; target < 3 && null_fd >= 0; ++target)
        ::dup2(null_fd, target);
      for (int fd = 3; fd < 1024; ++fd)
        if (fd != fds[0]) ::close(fd);
      watchdog_main(fds[0], files);
    }
    const int fork_error = errno;
    sigprocmask(SIG_SETMASK, &previous, nullptr);
    ::close(fds[0]);
    if (pid < 0) {
      ::close(fds[1]);
      throw LaunchError(std::string("cannot start the watchdog process: ") + std::strerror(fork_error));
    }
    ::setpgid(pid, pid);
    pid_ = pid;
    fd_ = fds[1];
  }
  GroupWatchdog(const GroupWatchdog&) = delete;
  GroupWatchdog& operator=(const GroupWatchdog&) = delete;
  /// Without finished(): the launcher is failing, and the watchdog kills every group it was given.
  ~GroupWatchdog() {
    close_fd(fd_);
    if (pid_ > 0) ::waitpid(pid_, nullptr, 0);
  }
  /// Process group `group` (a rank's) is killed if the launcher dies.
  void watch(pid_t group) { send(group); }
  /// The ranks are reaped: the watchdog exits and kills nothing (what a rank left running on purpose stays).
  void finished() { send(0); }

 private:
  void send(pid_t value) {
    if (fd_ < 0) return;
    const ssize_t n = ::write(fd_, &value, sizeof(value));  // atomic: under PIPE_BUF
    (void)n;
  }
  pid_t pid_ = -1;
  int fd_ = -1;
};

// One output stream (stdout or stderr) of a rank.
struct Stream {
  int fd = -1;
  int target_fd = 1;
  std::string partial;
};

struct Rank {
  int global_rank = 0;
  int local_rank = 0;
  pid_t pid = -1;
  bool running = false;
  int status = 0;           // waitpid status once reaped
  bool group_gone = false;  // its process group was found empty after it was reaped
  Stream streams[2];
  std::deque<std::string> tail;
  int log_fd = -1;          // <log_dir>/rank_<N>.log, or -1
  std::string pending_log;  // lines not yet written to log_fd
};

class Supervisor {
 public:
  explicit Supervisor(const SupervisorOptions& options) : options_(options) {}

  SupervisorResult run() {
    SignalGuard guard;
    GroupWatchdog watchdog(options_.remove_if_launcher_dies);
    spawn_all(guard, watchdog);
    loop(guard.read_fd());
    // A stop (a failed rank, a signal) whose ranks all exited within the grace period: what they started and
    // left behind (a wrapper script's trainer that traps SIGTERM) is killed too, before the watchdog is
    // disarmed. A run whose ranks all succeeded leaves their groups alone.
    if (stopping_ && !killed_) signal_all(SIGKILL);
    watchdog.finished();
    return result();
  }

 private:
  void spawn_all(const SignalGuard& guard, GroupWatchdog& watchdog) {
    std::vector<const char*> argv;
    for (const std::string& arg : options_.argv)
      argv.push_back(arg.c_str());
    argv.push_back(nullptr);
    const std::string exec_failed = "accel-launch: cannot execute '" + options_.executable + "'\n";

    ranks_.resize(options_.ranks.size());
    if (!options_.log_dir.empty()) {
      for (std::size_t i = 0; i < ranks_.size(); ++i) {
        const std::string path =
            options_.log_dir + "/rank_" + std::to_string(options_.ranks[i].global_rank) + ".log";
        ranks_[i].log_fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
        if (ranks_[i].log_fd < 0) {
          const int error = errno;
          for (std::size_t j = 0; j < i; ++j)
            ::close(ranks_[j].log_fd);
          throw LaunchError("cannot open the log file '" + path + "': " + std::strerror(error) +
                            "; choose a writable --log_dir");
        }
      }
    }
    for (std::size_t i = 0; i < options_.ranks.size(); ++i) {
      // A stop signal is acted on before the next fork, not after the last one (seconds or minutes later
      // with hundreds of ranks on a loaded machine).
      handle_signals(guard.read_fd());
      if (stopping_) break;
      const RankSpec& spec = options_.ranks[i];
      Rank& rank = ranks_[i];
      rank.global_rank = spec.global_rank;
      rank.local_rank = spec.local_rank;
      std::vector<const char*> envp;
      for (const std::string& entry : spec.environment)
        envp.push_back(entry.c_str());
      envp.push_back(nullptr);

      int out[2] = {-1, -1};
      int err[2] = {-1, -1};
      if (::pipe2(out, O_CLOEXEC) != 0 || ::pipe2(err, O_CLOEXEC) != 0) {
        const int error = errno;
        for (int fd : {out[0], out[1], err[0], err[1]})
          if (fd >= 0) ::close(fd);
        abort_start(spec.global_rank, std::string("cannot create pipes: ") + std::strerror(error));
      }

      // Signals stay blocked across fork so that a handler never runs in the child before exec.
      sigset_t all;
      sigset_t previous;
      sigfillset(&all);
      sigprocmask(SIG_BLOCK, &all, &previous);
      const pid_t launcher_pid = ::getpid();
      const pid_t pid = ::fork();
      if (pid == 0) {
        // Child: only async-signal-safe calls from here on. Its own session and process group
        // (wait_for_own_session).
        if (::setsid() < 0) ::setpgid(0, 0);
        // The rank dies with the launcher, also when the launcher is killed with SIGKILL and cannot stop it
        // (its own process group would otherwise keep it training, orphaned); and not at all if the launcher
        // is already gone.
        ::prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (::getppid() != launcher_pid) ::_exit(1);
        guard.restore_for_child();
        sigprocmask(SIG_SETMASK, &previous, nullptr);
        const int null_fd = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
        if (null_fd >= 0) ::dup2(null_fd, 0);
        ::dup2(out[1], 1);
        ::dup2(err[1], 2);
        ::execve(options_.executable.c_str(), const_cast<char* const*>(argv.data()),
                 const_cast<char* const*>(envp.data()));
        [[maybe_unused]] const ssize_t ignored = ::write(2, exec_failed.data(), exec_failed.size());
        ::_exit(127);
      }
      const int fork_error = errno;
      if (pid > 0) {
        wait_for_own_session(pid);  // so that kill(-pid) works from here on
        watchdog.watch(pid);
      }
      sigprocmask(SIG_SETMASK, &previous, nullptr);
      ::close(out[1]);
      ::close(err[1]);
      if (pid < 0) {
        ::close(out[0]);
        ::close(err[0]);
        abort_start(spec.global_rank, std::string("fork failed: ") + std::strerror(fork_error));
      }
      rank.pid = pid;
      rank.running = true;
      ++started_;
      rank.streams[0] = Stream{out[0], options_.stdout_fd, {}};
      rank.streams[1] = Stream{err[0], options_.stderr_fd, {}};
      for (const Stream& stream : rank.streams) {
        ::fcntl(stream.fd, F_SETFL, ::fcntl(stream.fd, F_GETFL) | O_NONBLOCK);
      }
    }
  }

  // Kills and reaps the ranks started so far, then throws.
  [[noreturn]] void abort_start(int global_rank, const std::string& reason) {
    for (Rank& rank : ranks_) {
      if (rank.running) ::kill(-rank.pid, SIGKILL);
    }
    for (Rank& rank : ranks_) {
      if (rank.running) ::waitpid(rank.pid, nullptr, 0);
      for (Stream& stream : rank.streams)
        close_fd(stream.fd);
    }
    throw LaunchError("cannot start rank " + std::to_string(global_rank) + ": " + reason);
  }

  void signal_all(int signal_number) {
    // Exited ranks too: their process group may still hold grandchildren (not a group found empty: its
    // number may belong to another group by now).
    for (const Rank& rank : ranks_) {
      if (rank.pid > 0 && !rank.group_gone) ::kill(-rank.pid, signal_number);
    }
  }

  // The groups of reaped ranks that have emptied: never signalled again (checked at least every second).
  void forget_empty_groups() {
    for (Rank& rank : ranks_) {
      if (rank.running || rank.group_gone || rank.pid <= 0) continue;
      pid_t group = rank.pid;
      rank.group_gone = prune_empty_groups(&group, 1) == 0;
    }
  }

  void begin_stop(int signal_number) {
    if (stopping_) return;
    stopping_ = true;
    signal_all(signal_number);
    kill_at_ = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                  std::chrono::duration<double>(options_.grace_period_seconds));
  }

  void reap() {
    // Ranks that exited 0 are taken before those that failed in the same pass: a rank that left early and
    // the rank that then failed waiting for it are often reaped together, and the one that left came first.
    std::vector<std::size_t> failed;
    for (Rank& rank : ranks_) {
      if (!rank.running) continue;
      int status = 0;
      const pid_t r = ::waitpid(rank.pid, &status, WNOHANG);
      if (r != rank.pid) continue;
      rank.running = false;
      rank.status = status;
      const std::size_t index = static_cast<std::size_t>(&rank - ranks_.data());
      if (!(WIFEXITED(status) && WEXITSTATUS(status) == 0)) {
        failed.push_back(index);
      } else if (!early_exit_ && !stopping_) {
        early_exit_ = index;
        early_exit_at_ = Clock::now();
        early_exit_wall_ = std::chrono::system_clock::now();
      }
    }
    if (!failed.empty() && !stopping_) {
      failed_rank_ = failed.front();
      failed_at_ = Clock::now();
      begin_stop(SIGTERM);
    }
  }

  void handle_signals(int fd) {
    unsigned char bytes[64];
    for (;;) {
      const ssize_t n = ::read(fd, bytes, sizeof(bytes));
      if (n <= 0) break;
      for (ssize_t i = 0; i < n; ++i) {
        if (bytes[i] != SIGCHLD) on_stop_signal(bytes[i]);  // reap() runs every iteration anyway
      }
    }
  }

  // The first stop signal starts the grace period (forwarded to the ranks unless a failed rank already
  // stopped them); a later one kills at once unless it is a copy of the first (see escalates_to_kill).
  void on_stop_signal(int s) {
    const Clock::time_point now = Clock::now();
    if (!first_signal_) {
      first_signal_ = s;
      first_signal_at_ = now;
      if (!stopping_) received_signal_ = s;
      begin_stop(s);
      return;
    }
    if (killed_) return;
    const double later = std::chrono::duration<double>(now - first_signal_at_).count();
    if (!escalates_to_kill(s, later)) return;
    std::ostringstream line;
    line.precision(2);
    line << std::fixed << "accel-launch: " << signal_name(s) << " " << later << " s after "
         << signal_name(first_signal_) << ": killed the ranks at once (SIGKILL) instead of waiting out the "
         << std::defaultfloat << options_.grace_period_seconds << " s grace period\n";
    escalation_ = line.str();
    kill_now();
  }

  void kill_now() {
    signal_all(SIGKILL);
    killed_ = true;
    killed_at_ = Clock::now();
  }

  void emit_line(Rank& rank, std::string line, std::string& out) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (options_.console) out += "[rank " + std::to_string(rank.global_rank) + "] " + line + "\n";
    if (rank.log_fd >= 0) rank.pending_log += line + "\n";
    rank.tail.push_back(std::move(line));
    while (rank.tail.size() > options_.tail_lines)
      rank.tail.pop_front();
  }

  void read_stream(Rank& rank, Stream& stream) {
    char buffer[65536];
    std::string out;
    for (;;) {
      const ssize_t n = ::read(stream.fd, buffer, sizeof(buffer));
      if (n > 0) {
        stream.partial.append(buffer, static_cast<std::size_t>(n));
        std::size_t start = 0;
        for (std::size_t newline; (newline = stream.partial.find('\n', start)) != std::string::npos;
             start = newline + 1) {
          emit_line(rank, stream.partial.substr(start, newline - start), out);
        }
        stream.partial.erase(0, start);
        if (stream.partial.size() >= kMaxLineBytes) {
          emit_line(rank, std::move(stream.partial), out);
          stream.partial.clear();
        }
        if (static_cast<std::size_t>(n) < sizeof(buffer)) break;
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && errno == EAGAIN) break;
      // EOF or error: the partial last line still belongs to the output.
      flush_stream(rank, stream, out);
      break;
    }
    write_all(stream.target_fd, out);
    flush_log(rank);
  }

  void flush_log(Rank& rank) {
    if (rank.log_fd < 0 || rank.pending_log.empty()) return;
    write_all(rank.log_fd, rank.pending_log);
    rank.pending_log.clear();
  }

  void flush_stream(Rank& rank, Stream& stream, std::string& out) {
    if (!stream.partial.empty()) {
      emit_line(rank, std::move(stream.partial), out);
      stream.partial.clear();
    }
    close_fd(stream.fd);
  }

  void close_all_streams() {
    for (Rank& rank : ranks_) {
      for (Stream& stream : rank.streams) {
        if (stream.fd < 0) continue;
        std::string out;
        flush_stream(rank, stream, out);
        write_all(stream.target_fd, out);
      }
      flush_log(rank);
      if (rank.log_fd >= 0) {
        ::close(rank.log_fd);
        rank.log_fd = -1;
      }
    }
  }

  void loop(int signal_fd) {
    std::optional<Clock::time_point> all_exited_at;
    for (;;) {
      reap();
      forget_empty_groups();
      const Clock::time_point now = Clock::now();
      const bool any_running =
          std::any_of(ranks_.begin(), ranks_.end(), [](const Rank& r) { return r.running; });
      if (stopping_ && !killed_ && now >= kill_at_) kill_now();
      if (any_running && !stopping_) report_early_exit(now);
      if (killed_ && any_running && now - killed_at_ >= kReapTimeout) break;  // unkillable; give up

      std::vector<pollfd> fds;
      std::vector<std::pair<Rank*, Stream*>> owners;
      fds.push_back({signal_fd, POLLIN, 0});
      owners.emplace_back(nullptr, nullptr);
      for (Rank& rank : ranks_) {
        for (Stream& stream : rank.streams) {
          if (stream.fd < 0) continue;
          fds.push_back({stream.fd, POLLIN, 0});
          owners.emplace_back(&rank, &stream);
        }
      }

      // Once every rank is gone, a grandchild that inherited a pipe must not keep the launcher alive.
      std::optional<Clock::time_point> deadline;
      if (!any_running) {
        if (fds.size() == 1) break;
        if (!all_exited_at) all_exited_at = now;
        const auto drain = stopping_ ? Clock::duration(kDrainAfterStop)
                                     : std::chrono::duration_cast<Clock::duration>(
                                           std::chrono::duration<double>(options_.grace_period_seconds));
        deadline = *all_exited_at + drain;
        if (now >= *deadline) {
          close_all_streams();
          break;
        }
      }
      if (stopping_ && !killed_) deadline = deadline ? std::min(*deadline, kill_at_) : kill_at_;
      if (killed_ && any_running) {
        const Clock::time_point give_up = killed_at_ + kReapTimeout;
        deadline = deadline ? std::min(*deadline, give_up) : give_up;
      }
      int timeout_ms = 1000;  // also a safety net should a SIGCHLD be lost
      if (deadline) {
        const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(*deadline - now).count() + 1;
        timeout_ms = static_cast<int>(std::clamp<long long>(left, 0, timeout_ms));
      }

      const int ready = ::poll(fds.data(), fds.size(), timeout_ms);
      if (ready < 0) {
        if (errno == EINTR) continue;
        const int error = errno;
        signal_all(SIGKILL);
        throw LaunchError(std::string("poll failed while supervising the ranks: ") + std::strerror(error));
      }
      if (fds[0].revents != 0) handle_signals(signal_fd);
      for (std::size_t i = 1; i < fds.size(); ++i) {
        if (fds[i].revents != 0) read_stream(*owners[i].first, *owners[i].second);
      }
    }
  }

  SupervisorResult result() const {
    SupervisorResult result;
    if (failed_rank_) {
      const Rank& rank = ranks_[*failed_rank_];
      std::ostringstream report;
      report << left_before_failure();
      report << "accel-launch: rank " << rank.global_rank << " (local rank " << rank.local_rank << ", pid "
             << rank.pid << ") ";
      if (WIFSIGNALED(rank.status)) {
        const int s = WTERMSIG(rank.status);
        report << "was killed by signal " << s << " (" << signal_name(s) << ")\n";
        result.exit_code = 128 + s;
      } else {
        result.exit_code = WEXITSTATUS(rank.status);
        report << "failed with exit code " << result.exit_code << "\n";
      }
      if (rank.tail.empty()) {
        report << "---- rank " << rank.global_rank << " printed nothing ----\n";
      } else {
        report << "---- last " << rank.tail.size() << " lines of rank " << rank.global_rank << " ----\n";
        for (const std::string& line : rank.tail)
          report << line << "\n";
        report << "----\n";
      }
      result.report = report.str();
    } else if (received_signal_) {
      result.interrupted = true;
      result.exit_code = 128 + received_signal_;
      result.report =
          started_ == ranks_.size()
              ? "accel-launch: received " + signal_name(received_signal_) + "; forwarded it to all " +
                    std::to_string(ranks_.size()) + " rank(s) and stopped them\n"
              : "accel-launch: received " + signal_name(received_signal_) + " while starting the ranks (" +
                    std::to_string(started_) + " of " + std::to_string(ranks_.size()) +
                    " started); started no more, forwarded it to those and stopped them\n";
    }
    result.report += escalation_;
    for (const Rank& rank : ranks_) {
      if (rank.running) {
        result.report += "accel-launch: rank " + std::to_string(rank.global_rank) + " (pid " +
                         std::to_string(rank.pid) +
                         ") did not exit after SIGKILL; it may be stuck in the kernel\n";
        if (result.exit_code == 0) result.exit_code = 1;
      }
    }
    return result;
  }

  // Says which rank exited 0 and which still run, once, when they have run on for early_exit_report_seconds.
  void report_early_exit(Clock::time_point now) {
    // The others are likely waiting for it in a collective, which would otherwise go unexplained until the
    // collective timeout (30 min by default).
    if (!early_exit_ || early_exit_reported_ ||
        now - early_exit_at_ < std::chrono::duration<double>(options_.early_exit_report_seconds))
      return;
    early_exit_reported_ = true;
    std::string running;
    std::size_t count = 0;
    for (const Rank& rank : ranks_) {
      if (!rank.running) continue;
      if (count++ < 8) running += (running.empty() ? "" : ", ") + std::to_string(rank.global_rank);
    }
    if (count > 8) running += ", ...";
    const Rank& done = ranks_[*early_exit_];
    const auto waited = std::chrono::duration_cast<std::chrono::seconds>(now - early_exit_at_).count();
    write_all(options_.stderr_fd,
              "accel-launch: rank " + std::to_string(done.global_rank) + " exited with code 0 " +
                  std::to_string(waited) + " s ago while " + std::to_string(count) + " rank(s) still run (" +
                  running +
                  "); if they wait for it in a collective (every rank must make the same collective calls: a "
                  "rank-dependent break or return skips them) they stay blocked until the collective timeout "
                  "(collective_timeout_seconds, ACCEL_COLLECTIVE_TIMEOUT)\n");
  }

  // When a rank exited 0 while the others ran and one of them failed afterwards, the line that names the rank
  // that left (the likely cause: the failed rank waited for it in a collective), else "".
  std::string left_before_failure() const {
    if (!early_exit_ || !failed_rank_) return "";
    const Rank& left = ranks_[*early_exit_];
    const Rank& failed = ranks_[*failed_rank_];
    const std::time_t when = std::chrono::system_clock::to_time_t(early_exit_wall_);
    std::tm local{};
    ::localtime_r(&when, &local);
    char clock[16];
    std::strftime(clock, sizeof(clock), "%H:%M:%S", &local);
    const std::string leaver = "rank " + std::to_string(left.global_rank);
    const std::string waiter = "rank " + std::to_string(failed.global_rank);
    std::ostringstream line;
    line.precision(1);
    line << std::fixed << "accel-launch: " << leaver << " (local rank " << left.local_rank << ", pid "
         << left.pid << ") exited with status 0 at " << clock << ", "
         << std::chrono::duration<double>(failed_at_ - early_exit_at_).count() << " s before " << waiter
         << " failed, ";
    const std::string rule =
        "every rank must make the same collective calls (a rank-dependent return, break or exit skips "
        "them), so look first at why " +
        leaver + " stopped early";
    if (waited_in_collective(failed)) {
      line << "while " << waiter << " waited for it in a collective (its error says a peer closed its "
           << "connection or never arrived): " << leaver << " is the cause, " << waiter
           << " only its consequence; " << rule << "\n";
    } else {
      line << "while " << waiter << " still ran: if " << waiter << " waited for it in a collective, "
           << leaver << " is the cause; " << rule << "\n";
    }
    return line.str();
  }

  // Whether the last lines of `rank` are a collective's failure for a peer that left (the Communicator's
  // DistributedError, or Gloo's own words when a program catches and prints them).
  static bool waited_in_collective(const Rank& rank) {
    for (const std::string& line : rank.tail) {
      for (const char* words : {"closed its connection", "Connection closed by peer",
                                "Connection reset by peer", "did not reach"}) {
        if (line.find(words) != std::string::npos) return true;
      }
    }
    return false;
  }

  const SupervisorOptions& options_;
  std::vector<Rank> ranks_;
  std::size_t started_ = 0;  // ranks forked (fewer than ranks_ when a signal stopped the starting)
  bool stopping_ = false;
  bool killed_ = false;
  Clock::time_point kill_at_{};
  Clock::time_point killed_at_{};
  std::optional<std::size_t> failed_rank_;
  std::optional<std::size_t> early_exit_;  // the first rank that exited 0 before any stop
  Clock::time_point early_exit_at_{};
  std::chrono::system_clock::time_point early_exit_wall_{};  // the same moment, for the report's clock time
  Clock::time_point failed_at_{};                            // when failed_rank_ was reaped
  int first_signal_ = 0;                                     // the first stop signal received, or 0
  Clock::time_point first_signal_at_{};
  std::string escalation_;  // the report's line when a second signal cut the grace period short
  bool early_exit_reported_ = false;
  int received_signal_ = 0;
};

}  // namespace

bool escalates_to_kill(int second, double seconds_later) {
  // A Ctrl-C by hand comes a noticeable moment after the first; copies from a wrapper within microseconds.
  return seconds_later >= (second == SIGINT ? kRepeatedInterruptSeconds : kDuplicateSignalSeconds);
}

StopSignalsDeferred::StopSignalsDeferred() {
  sigset_t stop;
  sigemptyset(&stop);
  for (int s : kForwardedSignals)
    sigaddset(&stop, s);
  sigprocmask(SIG_BLOCK, &stop, &previous_);
}

StopSignalsDeferred::~StopSignalsDeferred() {
  sigset_t stop;
  sigemptyset(&stop);
  for (int s : kForwardedSignals) {
    if (!sigismember(&previous_, s)) sigaddset(&stop, s);
  }
  const timespec now{0, 0};
  while (::sigtimedwait(&stop, nullptr, &now) > 0) {
  }
  sigprocmask(SIG_SETMASK, &previous_, nullptr);
}

SupervisorResult supervise(const SupervisorOptions& options) {
  if (options.ranks.empty()) throw UsageError("supervise: no ranks to start");
  if (options.argv.empty()) throw UsageError("supervise: argv is empty");
  return Supervisor(options).run();
}

std::string find_executable(const std::string& program) {
  auto check = [](const std::string& path) -> std::optional<std::string> {
    struct stat info {};
    if (::stat(path.c_str(), &info) != 0) return "does not exist";
    if (S_ISDIR(info.st_mode)) return "is a directory";
    if (::access(path.c_str(), X_OK) != 0) return "is not executable (chmod +x it)";
    return std::nullopt;
  };
  if (program.empty()) throw LaunchError("the program to launch is an empty string");
  if (program.find('/') != std::string::npos) {
    if (const auto problem = check(program)) {
      throw LaunchError("cannot launch program '" + program + "': it " + *problem);
    }
    return program;
  }
  const char* path_env = std::getenv("PATH");
  const std::string path = path_env != nullptr ? path_env : "/usr/local/bin:/usr/bin:/bin";
  std::optional<std::string> first_problem;
  std::size_t start = 0;
  for (;;) {
    const std::size_t end = path.find(':', start);
    std::string dir = path.substr(start, end == std::string::npos ? std::string::npos : end - start);
    if (dir.empty()) dir = ".";
    const std::string candidate = dir + "/" + program;
    const auto problem = check(candidate);
    if (!problem) return candidate;
    if (!first_problem && *problem != "does not exist") first_problem = candidate + " " + *problem;
    if (end == std::string::npos) break;
    start = end + 1;
  }
  throw LaunchError("cannot launch program '" + program + "': not found in PATH" +
                    (first_problem ? " (" + *first_problem + ")" : std::string()) +
                    "; pass a path such as ./" + program + " for a program in the current directory");
}

std::size_t prune_empty_groups(pid_t* groups, std::size_t count) {
  // kill(-group, 0) signals nothing: ESRCH when no process is left in the group (async-signal-safe, as the
  // watchdog needs).
  std::size_t kept = 0;
  for (std::size_t i = 0; i < count; ++i) {
    if (::kill(-groups[i], 0) == 0 || errno != ESRCH) groups[kept++] = groups[i];
  }
  return kept;
}

std::string signal_name(int signal_number) {
  switch (signal_number) {
    case SIGHUP:
      return "SIGHUP";
    case SIGINT:
      return "SIGINT";
    case SIGQUIT:
      return "SIGQUIT";
    case SIGILL:
      return "SIGILL";
    case SIGTRAP:
      return "SIGTRAP";
    case SIGABRT:
      return "SIGABRT";
    case SIGBUS:
      return "SIGBUS";
    case SIGFPE:
      return "SIGFPE";
    case SIGKILL:
      return "SIGKILL";
    case SIGUSR1:
      return "SIGUSR1";
    case SIGSEGV:
      return "SIGSEGV";
    case SIGUSR2:
      return "SIGUSR2";
    case SIGPIPE:
      return "SIGPIPE";
    case SIGALRM:
      return "SIGALRM";
    case SIGTERM:
      return "SIGTERM";
    case SIGXCPU:
      return "SIGXCPU";
    case SIGXFSZ:
      return "SIGXFSZ";
    default:
      return "signal " + std::to_string(signal_number);
  }
}

}  // namespace accel::launcher
