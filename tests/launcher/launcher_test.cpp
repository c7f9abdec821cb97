/// \file launcher_test.cpp
/// End-to-end tests of `accel-launch launch`: the real binary (launch_bin()) runs the fake rank programs
/// in tests/launcher/ (tests_dir()), each run under a time limit.

#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>
#include <catch2/catch.hpp>
#include "build_paths.hpp"
#include "supervisor.hpp"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "../../launcher/free_port.hpp"
#include "accel/config/config.hpp"
#include "accel/distributed/env_contract.hpp"
#include "accel/errors.hpp"
#include "free_port.hpp"  // tests/free_port.hpp

namespace fs = std::filesystem;
using accel::test::bound_loopback_socket;
using accel::test::free_port;

namespace {

using Clock = std::chrono::steady_clock;

std::string script(const std::string& name) {
  return accel::test::tests_dir() + "/launcher/" + name;
}

// A fresh directory for marker files, removed at the end of the test.
class TempDir {
 public:
  TempDir() {
    std::string name = (fs::temp_directory_path() / "accel-launcher-test-XXXXXX").string();
    REQUIRE(::mkdtemp(name.data()) != nullptr);
    path_ = name;
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  const fs::path& path() const { return path_; }
  std::string str() const { return path_.string(); }

 private:
  fs::path path_;
};

struct RunResult {
  int exit_code = -1;  // 128 + signal when the launcher itself was killed
  std::string out;
  std::string err;
  double seconds = 0;
};

// accel-launch running in its own process group with captured stdout/stderr. The destructor kills whatever
// is left, so a failing REQUIRE never leaves processes behind.
class Launcher {
 public:
  /// `env`: "NAME=value" to set, "NAME" to unset; `ignored_signals`: ignored on entry, as under nohup;
  /// `wrapper`: a command that runs accel-launch (such as {"timeout", "2"}), found in PATH.
  explicit Launcher(const std::vector<std::string>& args, const std::vector<std::string>& env = {},
                    const std::vector<int>& ignored_signals = {},
                    const std::vector<std::string>& wrapper = {}) {
    int out[2];
    int err[2];
    REQUIRE(::pipe2(out, O_CLOEXEC) == 0);
    REQUIRE(::pipe2(err, O_CLOEXEC) == 0);
    std::vector<std::string> argv_strings = wrapper;
    argv_strings.push_back(accel::test::launch_bin());
    argv_strings.insert(argv_strings.end(), args.begin(), args.end());
    std::vector<char*> argv;
    for (std::string& arg : argv_strings)
      argv.push_back(arg.data());
    argv.push_back(nullptr);
    start_ = Clock::now();
    pid_ = ::fork();
    REQUIRE(pid_ >= 0);
    if (pid_ == 0) {
      ::setpgid(0, 0);
      ::dup2(out[1], 1);
      ::dup2(err[1], 2);
      // Isolation from the user's default config and thread settings; "NAME" alone unsets NAME.
      ::setenv("ACCEL_CONFIG_FILE", "/nonexistent/accel-launcher-test/default_config.yaml", 1);
      ::unsetenv("OMP_NUM_THREADS");
      for (const std::string& entry : env) {
        const std::size_t equals = entry.find('=');
        if (equals == std::string::npos) {
          ::unsetenv(entry.c_str());
        } else {
          ::setenv(entry.substr(0, equals).c_str(), entry.c_str() + equals + 1, 1);
        }
      }
      // As from a terminal, whatever ran this test (a background job ignores SIGINT): only the list ignores.
      for (int signal_number : {SIGINT, SIGTERM, SIGHUP})
        ::signal(signal_number, SIG_DFL);
      for (int signal_number : ignored_signals)
        ::signal(signal_number, SIG_IGN);
      ::execvp(argv[0], argv.data());
      ::_exit(126);
    }
    ::setpgid(pid_, pid_);
    ::close(out[1]);
    ::close(err[1]);
    out_fd_ = out[0];
    err_fd_ = err[0];
  }
  Launcher(const Launcher&) = delete;
  Launcher& operator=(const Launcher&) = delete;
  ~Launcher() {
    if (pid_ > 0 && !reaped_) {
      ::kill(-pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
    if (out_fd_ >= 0) ::close(out_fd_);
    if (err_fd_ >= 0) ::close(err_fd_);
  }

  pid_t pid() const { return pid_; }
  const std::string& out() const { return result_.out; }

  // True once the launcher process has exited (it is reaped here).
  bool exited() {
    try_reap();
    return reaped_;
  }

  // Reads output until `predicate()` holds; false on timeout or when the launcher exited first.
  bool wait_for(const std::function<bool()>& predicate, double timeout_seconds) {
    const auto deadline = Clock::now() + std::chrono::duration<double>(timeout_seconds);
    while (!predicate()) {
      if (Clock::now() >= deadline || (out_fd_ < 0 && err_fd_ < 0)) return false;
      pump(50);
    }
    return true;
  }

  // Waits for exit and EOF on both pipes; FAILs (after killing it) when that takes longer than the limit.
  RunResult finish(double timeout_seconds = 30) {
    const auto deadline = Clock::now() + std::chrono::duration<double>(timeout_seconds);
    while (out_fd_ >= 0 || err_fd_ >= 0 || !reaped_) {
      if (Clock::now() >= deadline) {
        ::kill(-pid_, SIGKILL);
        FAIL("accel-launch did not finish within " << timeout_seconds << " s; stdout:\n"
                                                   << result_.out << "\nstderr:\n"
                                                   << result_.err);
      }
      pump(50);
      try_reap();
    }
    return result_;
  }

 private:
  void try_reap() {
    if (reaped_) return;
    int status = 0;
    if (::waitpid(pid_, &status, WNOHANG) == pid_) {
      reaped_ = true;
      result_.seconds = std::chrono::duration<double>(Clock::now() - start_).count();
      result_.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    }
  }

  void pump(int timeout_ms) {
    std::vector<pollfd> fds;
    if (out_fd_ >= 0) fds.push_back({out_fd_, POLLIN, 0});
    if (err_fd_ >= 0) fds.push_back({err_fd_, POLLIN, 0});
    if (fds.empty()) {
      std::this_thread::sleep_for(std::chrono::milliseconds(timeout_ms));
      return;
    }
    if (::poll(fds.data(), fds.size(), timeout_ms) <= 0) return;
    for (const pollfd& p : fds) {
      if (p.revents == 0) continue;
      int& fd = p.fd == out_fd_ ? out_fd_ : err_fd_;
      std::string& sink = p.fd == out_fd_ ? result_.out : result_.err;
      char buffer[4096];
      const ssize_t n = ::read(fd, buffer, sizeof(buffer));
      if (n > 0) {
        sink.append(buffer, static_cast<std::size_t>(n));
      } else if (n == 0 || errno != EINTR) {
        ::close(fd);
        fd = -1;
      }
    }
  }

  pid_t pid_ = -1;
  int out_fd_ = -1;
  int err_fd_ = -1;
  bool reaped_ = false;
  Clock::time_point start_;
  RunResult result_;
};

RunResult run(const std::vector<std::string>& args, const std::vector<std::string>& env = {},
              double timeout_seconds = 30) {
  Launcher launcher(args, env);
  return launcher.finish(timeout_seconds);
}

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);)
    lines.push_back(line);
  return lines;
}

// The values of `NAME=` lines printed by the ranks, e.g. values(out, "RANK") == {"0", "1"} (sorted).
std::multiset<std::string> values(const std::string& out, const std::string& name) {
  std::multiset<std::string> found;
  const std::regex pattern("^\\[rank [0-9]+\\] " + name + "=(.*)$");
  for (const std::string& line : lines_of(out)) {
    std::smatch match;
    if (std::regex_match(line, match, pattern)) found.insert(match[1]);
  }
  return found;
}

// The value of `NAME=` printed by one rank.
std::string value_of(const std::string& out, int rank, const std::string& name) {
  const std::string prefix = "[rank " + std::to_string(rank) + "] " + name + "=";
  for (const std::string& line : lines_of(out)) {
    if (line.rfind(prefix, 0) == 0) return line.substr(prefix.size());
  }
  return "<missing>";
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// True when `pid` is gone (or a zombie waiting for its new parent to reap it).
bool process_gone(pid_t pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  if (!stat) return true;
  std::string content;
  std::getline(stat, content);
  const std::size_t paren = content.rfind(')');
  return paren != std::string::npos && paren + 2 < content.size() && content[paren + 2] == 'Z';
}

// Writes `text` to `name` in `dir`; returns the path.
std::string write_file(const TempDir& dir, const std::string& name, const std::string& text) {
  const std::string path = (dir.path() / name).string();
  std::ofstream(path) << text;
  return path;
}

}  // namespace

TEST_CASE(
    "launcher: a rank's process group that emptied is forgotten, a live one kept (its number may be "
    "reused)") {
  // One child that leaves its own group empty at exit, one that stays in its own group.
  auto child = [](bool stay) {
    const pid_t pid = ::fork();
    if (pid == 0) {
      ::setpgid(0, 0);
      if (stay) ::pause();
      ::_exit(0);
    }
    ::setpgid(pid, pid);
    return pid;
  };
  const pid_t gone = child(false), live = child(true);
  REQUIRE(::waitpid(gone, nullptr, 0) == gone);
  pid_t groups[2] = {gone, live};
  CHECK(accel::launcher::prune_empty_groups(groups, 2) == 1);
  CHECK(groups[0] == live);
  ::kill(-live, SIGKILL);
  REQUIRE(::waitpid(live, nullptr, 0) == live);
  CHECK(accel::launcher::prune_empty_groups(groups, 1) == 0);
}

TEST_CASE("launcher: two ranks get prefixed output, the torchrun variables and the resolved config") {
  TempDir dir;
  const int port = free_port();
  const RunResult r = run({"launch", "--num_processes", "2", "--mixed_precision", "bf16", "--log_with",
                           "tensorboard,csv", "--main_process_port", std::to_string(port),
                           script("print_env.sh"), "--epochs", "3", "--num_processes", "7"},
                          {"MARKER_DIR=" + dir.str()});
  INFO("stdout:\n" << r.out << "\nstderr:\n" << r.err);
  REQUIRE(r.exit_code == 0);

  for (const std::string& line : lines_of(r.out)) {
    CHECK(std::regex_match(line, std::regex("^\\[rank [01]\\] .*")));
  }
  for (const std::string& line : lines_of(r.err)) {
    const bool prefixed = std::regex_match(line, std::regex("^\\[rank [01]\\] .*"));
    CHECK((prefixed || line.rfind("accel-launch: ", 0) == 0));
  }
  CHECK(contains(r.err, "[rank 0] stderr of rank 0\n"));
  CHECK(contains(r.err, "[rank 1] stderr of rank 1\n"));
  // The last line without '\n' is flushed when the rank exits.
  CHECK(contains(r.out, "[rank 0] no newline at the end\n"));
  CHECK(contains(r.out, "[rank 1] no newline at the end\n"));

  CHECK(values(r.out, "RANK") == std::multiset<std::string>{"0", "1"});
  CHECK(value_of(r.out, 1, "RANK") == "1");
  CHECK(value_of(r.out, 1, "LOCAL_RANK") == "1");
  CHECK(values(r.out, "WORLD_SIZE") == std::multiset<std::string>{"2", "2"});
  CHECK(values(r.out, "LOCAL_WORLD_SIZE") == std::multiset<std::string>{"2", "2"});
  CHECK(values(r.out, "GROUP_RANK") == std::multiset<std::string>{"0", "0"});
  CHECK(values(r.out, "MASTER_ADDR") == std::multiset<std::string>{"127.0.0.1", "127.0.0.1"});
  CHECK(values(r.out, "MASTER_PORT") ==
        std::multiset<std::string>{std::to_string(port), std::to_string(port)});
  CHECK(values(r.out, "ACCEL_LAUNCHED") == std::multiset<std::string>{"1", "1"});
  // The contract the library reads (accel/env_contract.hpp): every variable is set for every rank.
  for (const char* name : accel::env::kLaunchVariables) {
    INFO(name);
    CHECK(values(r.out, name).size() == 2);
  }
  // Everything after PROGRAM is the program's, even options that accel-launch also knows.
  CHECK(value_of(r.out, 0, "ARGS") == "--epochs 3 --num_processes 7");

  // The config file is the resolved one (flags applied), readable by accel::Config, and deleted at exit.
  std::string yaml;
  for (const std::string& line : lines_of(r.out)) {
    if (line.rfind("[rank 0] config: ", 0) == 0) yaml += line.substr(17) + "\n";
  }
  const accel::Config config = accel::Config::load_string(yaml, "resolved config");
  CHECK(config.mixed_precision == accel::MixedPrecision::Bf16);
  CHECK(config.log_with == "tensorboard,csv");
  CHECK(config.num_processes == 2);
  CHECK(config.main_process_port == port);
  CHECK(config.backend == "ddp");
  const std::string config_path = value_of(r.out, 0, "ACCEL_CONFIG_FILE");
  CHECK(value_of(r.out, 1, "ACCEL_CONFIG_FILE") == config_path);
  CHECK_FALSE(fs::exists(config_path));
}

TEST_CASE("launcher: OMP_NUM_THREADS is set per rank with a notice, unless the user set it") {
  const RunResult set =
      run({"launch", "--num_processes", "2", "--main_process_port", "0", script("print_env.sh")});
  INFO("stderr:\n" << set.err);
  REQUIRE(set.exit_code == 0);
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  CHECK(std::stoi(value_of(set.out, 0, "OMP_NUM_THREADS")) >= 1);
  CHECK(std::stoul(value_of(set.out, 0, "OMP_NUM_THREADS")) <= std::max(1u, cores / 2));
  CHECK(contains(set.err, "accel-launch: setting OMP_NUM_THREADS="));

  const RunResult kept =
      run({"launch", "--num_processes", "2", "--main_process_port", "0", script("print_env.sh")},
          {"OMP_NUM_THREADS=7"});
  REQUIRE(kept.exit_code == 0);
  CHECK(values(kept.out, "OMP_NUM_THREADS") == std::multiset<std::string>{"7", "7"});
  CHECK_FALSE(contains(kept.err, "OMP_NUM_THREADS"));
}

TEST_CASE("launcher: a failing rank stops the others and its exit code and last lines are reported") {
  const RunResult r =
      run({"launch", "--num_processes", "2", "--main_process_port", "0", script("fail_rank.sh")},
          {"FAIL_RANK=1", "FAIL_CODE=3"});
  INFO("stdout:\n" << r.out << "\nstderr:\n" << r.err);
  CHECK(r.exit_code == 3);
  CHECK(r.seconds < 5.0);
  CHECK(std::regex_search(r.err, std::regex("accel-launch: rank 1 \\(local rank 1, pid [0-9]+\\) failed with "
                                            "exit code 3\n---- last 20 lines of rank 1 ----\n")));
  // Ring buffer of 20 lines over stdout and stderr: lines 7..25 and the stderr line.
  CHECK(contains(r.err, "\nrank 1 line 7\nrank 1 line 8\n"));
  CHECK_FALSE(contains(r.err, "\nrank 1 line 6\n"));
  CHECK(contains(r.err, "rank 1 line 25\nabout to fail\n----\n"));
  CHECK(contains(r.out, "[rank 0] rank 0 sleeping\n"));
}

TEST_CASE("launcher: a rank killed by a signal is reported as such with exit code 128 + signal") {
  const RunResult r =
      run({"launch", "--num_processes", "2", "--main_process_port", "0", script("fail_rank.sh")},
          {"FAIL_RANK=0", "FAIL_SIGNAL=KILL"});
  INFO("stdout:\n" << r.out << "\nstderr:\n" << r.err);
  CHECK(r.exit_code == 128 + SIGKILL);
  CHECK(r.seconds < 5.0);
  CHECK(std::regex_search(
      r.err,
      std::regex(
          "accel-launch: rank 0 \\(local rank 0, pid [0-9]+\\) was killed by signal 9 \\(SIGKILL\\)\n")));
  CHECK(contains(r.err, "about to fail\n----\n"));
}

TEST_CASE("launcher: SIGTERM to the launcher reaches every rank and it exits 143") {
  TempDir dir;
  Launcher launcher({"launch", "--num_processes", "2", "--main_process_port", "0", script("trap_term.sh")},
                    {"MARKER_DIR=" + dir.str()});
  REQUIRE(launcher.wait_for(
      [&] {
        return contains(launcher.out(), "[rank 0] ready\n") && contains(launcher.out(), "[rank 1] ready\n");
      },
      20));
  const auto signalled = Clock::now();
  REQUIRE(::kill(launcher.pid(), SIGTERM) == 0);
  const RunResult r = launcher.finish();
  INFO("stdout:\n" << r.out << "\nstderr:\n" << r.err);
  CHECK(std::chrono::duration<double>(Clock::now() - signalled).count() < 5.0);
  CHECK(r.exit_code == 143);
  CHECK(fs::exists(dir.path() / "term.0"));
  CHECK(fs::exists(dir.path() / "term.1"));
  CHECK(contains(r.err, "accel-launch: received SIGTERM; forwarded it to all 2 rank(s) and stopped them\n"));
}

TEST_CASE("launcher: a SIGHUP ignored on entry (nohup) is neither caught nor forwarded") {
  TempDir dir;
  Launcher launcher({"launch", "--num_processes", "2", "--main_process_port", "0", script("trap_term.sh")},
                    {"MARKER_DIR=" + dir.str()}, {SIGHUP});
  REQUIRE(launcher.wait_for(
      [&] {
        return contains(launcher.out(), "[rank 0] ready\n") && contains(launcher.out(), "[rank 1] ready\n");
      },
      20));
  REQUIRE(::kill(launcher.pid(), SIGHUP) == 0);
  launcher.wait_for([] { return false; }, 0.5);  // reads output for half a second
  CHECK_FALSE(launcher.exited());
  CHECK(fs::is_empty(dir.path()));
  REQUIRE(::kill(launcher.pid(), SIGTERM) == 0);
  const RunResult r = launcher.finish();
  CHECK(r.exit_code == 143);
  CHECK(fs::exists(dir.path() / "term.0"));
}

TEST_CASE("launcher: ranks that ignore SIGTERM are killed with their process group after the grace period") {
  TempDir dir;
  const RunResult r = run({"launch", "--num_processes", "2", "--main_process_port", "0", "--grace-period",
                           "1", script("ignore_term.sh")},
                          {"MARKER_DIR=" + dir.str(), "FAIL_RANK=1"});
  INFO("stdout:\n" << r.out << "\nstderr:\n" << r.err);
  CHECK(r.exit_code == 5);
  CHECK(r.seconds < 5.0);
  CHECK(contains(r.err, "failed with exit code 5"));
  for (const char* name : {"grandchild.0", "grandchild.1"}) {
    std::ifstream in(dir.path() / name);
    pid_t pid = 0;
    REQUIRE(in >> pid);
    const auto deadline = Clock::now() + std::chrono::seconds(2);
    while (!process_gone(pid) && Clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    CHECK(process_gone(pid));
  }
}

TEST_CASE("launcher: a busy port is reported before any rank starts") {
  TempDir dir;
  const auto [fd, listening_port] = bound_loopback_socket(/*listen=*/true);  // another program's server
  const std::string port = std::to_string(listening_port);

  const RunResult r =
      run({"launch", "--num_processes", "2", "--main_process_port", port, script("print_env.sh")},
          {"MARKER_DIR=" + dir.str()});
  ::close(fd);
  CHECK(r.exit_code == 1);
  CHECK(r.err == "accel-launch: error: port " + port +
                     " on 127.0.0.1 is already in use (another training run?); choose another with "
                     "--main_process_port or use 0 to pick a free one\n");
  CHECK(r.out.empty());
  CHECK(fs::is_empty(dir.path()));
}

TEST_CASE("launcher: configuration and usage errors exit 2 before any rank starts") {
  TempDir dir;
  const std::vector<std::string> env = {"MARKER_DIR=" + dir.str()};

  SECTION("unknown key in the config file") {
    const std::string path =
        write_file(dir, "bad.yaml", "distributed_type: MULTI_CPU\nnum_processes: 2\nbogus_key: 1\n");
    std::string expected;
    try {
      accel::Config::load_file(path);
    } catch (const accel::ConfigError& e) {
      expected = e.what();
    }
    REQUIRE(contains(expected, "bogus_key"));
    const RunResult r = run({"launch", "--config_file", path, script("print_env.sh")}, env);
    CHECK(r.exit_code == 2);
    CHECK(r.err == "accel-launch: error: " + expected + "\n");
  }
  SECTION("missing config file") {
    const std::string path = (dir.path() / "missing.yaml").string();
    const RunResult r = run({"launch", "--config-file", path, script("print_env.sh")}, env);
    CHECK(r.exit_code == 2);
    CHECK(r.err.rfind("accel-launch: error: cannot open config file '" + path + "'", 0) == 0);
  }
  SECTION("flags that contradict each other") {
    const RunResult r = run({"launch", "--num_processes", "3", "--num_machines", "2", "--main_process_ip",
                             "127.0.0.1", script("print_env.sh")},
                            env);
    CHECK(r.exit_code == 2);
    CHECK(r.err.rfind("accel-launch: error: num_processes (3) must be a multiple of num_machines (2)", 0) ==
          0);
  }
  SECTION("port 0 with several machines") {
    const RunResult r = run({"launch", "--num_processes", "2", "--num_machines", "2", "--main_process_ip",
                             "127.0.0.1", "--main_process_port", "0", script("print_env.sh")},
                            env);
    CHECK(r.exit_code == 2);
    CHECK(contains(r.err, "every machine must use the same explicit port"));
  }
  SECTION("missing PROGRAM") {
    const RunResult r = run({"launch", "--num_processes", "2"}, env);
    CHECK(r.exit_code == 2);
    CHECK(r.err ==
          "accel-launch: error: launch: missing PROGRAM; usage: accel-launch launch [options] PROGRAM "
          "[ARGS...] "
          "(see accel-launch launch --help)\n");
  }
  SECTION("PROGRAM that does not exist") {
    const std::string program = (dir.path() / "no-such-program").string();
    const RunResult r = run({"launch", "--num_processes", "2", "--main_process_port", "0", program}, env);
    CHECK(r.exit_code == 1);
    CHECK(r.err == "accel-launch: error: cannot launch program '" + program + "': it does not exist\n");
  }
  SECTION("PROGRAM that is not executable") {
    const std::string program = write_file(dir, "not-executable.sh", "#!/bin/sh\n");
    const RunResult r = run({"launch", "--main_process_port", "0", program}, env);
    CHECK(r.exit_code == 1);
    CHECK(r.err == "accel-launch: error: cannot launch program '" + program +
                       "': it is not executable (chmod +x it)\n");
  }
  SECTION("no subcommand") {
    const RunResult r = run({}, env);
    CHECK(r.exit_code == 2);
    CHECK(r.err == "accel-launch: error: A subcommand is required; see `accel-launch --help`\n");
  }
  SECTION("a number no option takes") {
    const RunResult r = run({"launch", "--num_processes", "99999999999", script("print_env.sh")}, env);
    CHECK(r.exit_code == 2);
    CHECK(r.err ==
          "accel-launch: error: Could not convert: --num_processes = 99999999999 (not of the option's type, "
          "or outside its range: counts and ranks are whole numbers up to 2147483647); see `accel-launch "
          "launch --help`\n");
  }
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir.path(), ec)) {
    INFO(entry.path());
    CHECK(entry.path().filename().string().rfind("started.", 0) != 0);
  }
}

TEST_CASE("launcher: dash and underscore spellings both work, and port 0 picks a free port") {
  for (const std::string flag : {"--num_processes", "--num-processes"}) {
    const std::string port_flag = flag == "--num_processes" ? "--main_process_port" : "--main-process-port";
    const RunResult r = run({"launch", flag, "2", port_flag, "0", script("print_env.sh")});
    INFO(flag << "\nstdout:\n" << r.out << "\nstderr:\n" << r.err);
    REQUIRE(r.exit_code == 0);
    CHECK(values(r.out, "RANK") == std::multiset<std::string>{"0", "1"});
    const int port = std::stoi(value_of(r.out, 0, "MASTER_PORT"));
    CHECK(port > 0);
    CHECK(value_of(r.out, 1, "MASTER_PORT") == std::to_string(port));
    const int ephemeral_low = accel::launcher::ephemeral_port_range().first;
    if (ephemeral_low - 1 - accel::launcher::kFirstPickedPort >= 1000) {
      CHECK(port >= accel::launcher::kFirstPickedPort);
      CHECK(port < ephemeral_low);
    }
  }
}

// A picked port lies below the kernel's range for outgoing connections' local ports, where no connection that
// another program opens before rank 0 listens can take it (a flaky rendezvous failure when ports came from
// that range), and is free.
TEST_CASE("launcher: a picked port lies below the ephemeral range and is free") {
  const auto [low, high] = accel::launcher::ephemeral_port_range();
  INFO("ephemeral range " << low << "-" << high);
  CHECK(0 < low);
  CHECK(low <= high);
  // Where the range leaves fewer than 1000 ports below it the kernel picks (port 0), from inside it.
  const bool below = low - 1 - accel::launcher::kFirstPickedPort >= 1000;
  std::set<int> seen;
  for (int i = 0; i < 20; ++i) {
    const int port = accel::launcher::pick_free_port("127.0.0.1");
    CHECK(accel::launcher::is_port_free("127.0.0.1", port));
    if (below) {
      CHECK(port >= accel::launcher::kFirstPickedPort);
      CHECK(port < low);
    }
    seen.insert(port);
  }
  CHECK(seen.size() > 1);  // drawn, not one fixed port
}

TEST_CASE("launcher: gpu_ids become the ranks' CUDA_VISIBLE_DEVICES, as Accelerate's launcher does") {
  TempDir dir;
  const std::string gpu = write_file(dir, "gpu.yaml",
                                     "distributed_type: MULTI_GPU\nnum_processes: 2\nmain_process_port: 0\n"
                                     "gpu_ids: '2, 0'\n");
  const RunResult r =
      run({"launch", "--config_file", gpu, script("print_env.sh")}, {"CUDA_VISIBLE_DEVICES=7"});
  INFO("stdout:\n" << r.out << "\nstderr:\n" << r.err);
  REQUIRE(r.exit_code == 0);
  CHECK(values(r.out, "CUDA_VISIBLE_DEVICES") == std::multiset<std::string>{"2,0", "2,0"});
  // On the CPU (and with the default, all) the variable is left as it was.
  const RunResult cpu = run({"launch", "--config_file", gpu, "--cpu", script("print_env.sh")});
  REQUIRE(cpu.exit_code == 0);
  CHECK(values(cpu.out, "CUDA_VISIBLE_DEVICES") == std::multiset<std::string>{"unset", "unset"});
  // Not a list of indices: refused, naming the key, before any rank starts.
  const std::string bad =
      write_file(dir, "bad.yaml", "distributed_type: MULTI_GPU\nnum_processes: 2\ngpu_ids: 1.5\n");
  const RunResult refused = run({"launch", "--config_file", bad, script("print_env.sh")});
  CHECK(refused.exit_code == 2);
  CHECK(contains(refused.err,
                 "bad.yaml:3: gpu_ids: expected all, or GPU indices separated by commas such as "
                 "0,1, got '1.5'"));
}

TEST_CASE("launcher: a config file is read and flags override it") {
  TempDir dir;
  const std::string path = write_file(dir, "run.yaml",
                                      "distributed_type: MULTI_CPU\nnum_processes: 2\nmixed_precision: fp16\n"
                                      "main_process_port: 0\ngradient_accumulation_steps: 4\n");
  const RunResult r = run({"launch", "--config_file", path, "--gradient_accumulation_steps", "8", "--debug",
                           script("print_env.sh")});
  INFO("stdout:\n" << r.out << "\nstderr:\n" << r.err);
  REQUIRE(r.exit_code == 0);
  CHECK(values(r.out, "WORLD_SIZE") == std::multiset<std::string>{"2", "2"});
  std::string yaml;
  for (const std::string& line : lines_of(r.out)) {
    if (line.rfind("[rank 1] config: ", 0) == 0) yaml += line.substr(17) + "\n";
  }
  const accel::Config config = accel::Config::load_string(yaml);
  CHECK(config.mixed_precision == accel::MixedPrecision::Fp16);
  CHECK(config.gradient_accumulation_steps == 8);
  CHECK(config.debug);
  CHECK(config.use_cpu);
  CHECK(config.main_process_port == std::stoi(value_of(r.out, 1, "MASTER_PORT")));
  // The ranks learn the user's file, which their messages name beside the resolved copy.
  CHECK(values(r.out, "ACCEL_CONFIG_SOURCE") == std::multiset<std::string>{path, path});
}

TEST_CASE("launcher: two launchers with --num_machines 2 form one world") {
  const std::string port = std::to_string(free_port());
  auto args = [&port](const std::string& machine_rank) {
    return std::vector<std::string>{"launch",    "--num_processes",     "4",          "--num_machines",
                                    "2",         "--machine_rank",      machine_rank, "--main_process_ip",
                                    "127.0.0.1", "--main_process_port", port,         script("print_env.sh")};
  };
  Launcher machine0(args("0"));
  Launcher machine1(args("1"));
  const RunResult r0 = machine0.finish();
  const RunResult r1 = machine1.finish();
  INFO("machine 0:\n" << r0.out << r0.err << "\nmachine 1:\n" << r1.out << r1.err);
  REQUIRE(r0.exit_code == 0);
  REQUIRE(r1.exit_code == 0);
  CHECK(values(r0.out, "RANK") == std::multiset<std::string>{"0", "1"});
  CHECK(values(r1.out, "RANK") == std::multiset<std::string>{"2", "3"});
  CHECK(value_of(r1.out, 3, "LOCAL_RANK") == "1");
  CHECK(values(r1.out, "GROUP_RANK") == std::multiset<std::string>{"1", "1"});
  CHECK(values(r0.out, "WORLD_SIZE") == std::multiset<std::string>{"4", "4"});
  CHECK(values(r1.out, "LOCAL_WORLD_SIZE") == std::multiset<std::string>{"2", "2"});
  CHECK(values(r1.out, "MASTER_PORT") == std::multiset<std::string>{port, port});
}

TEST_CASE("launcher: a DeepSpeed JSON config reaches the ranks resolved, its unmapped keys noted once") {
  TempDir dir;
  std::ofstream(dir.str() + "/ds_config.json")
      << "{\n  \"zero_optimization\": {\"stage\": 3, \"offload_optimizer\": {\"device\": \"cpu\"}},\n"
         "  \"optimizer\": {\"type\": \"AdamW\"},\n  \"gradient_accumulation_steps\": \"auto\"\n}\n";
  std::ofstream(dir.str() + "/accelerate.yaml")
      << "distributed_type: DEEPSPEED\nuse_cpu: true\nnum_processes: 2\ngradient_accumulation_steps: 2\n"
         "deepspeed_config:\n  deepspeed_config_file: ds_config.json\n";
  const RunResult r = run({"launch", "--config_file", dir.str() + "/accelerate.yaml", "--main_process_port",
                           "0", script("print_env.sh")});
  INFO("stdout:\n" << r.out << "\nstderr:\n" << r.err);
  REQUIRE(r.exit_code == 0);
  std::size_t notes = 0;
  for (auto at = r.err.find("optimizer AdamW: accel::Trainer builds it"); at != std::string::npos;
       at = r.err.find("optimizer AdamW: accel::Trainer builds it", at + 1))
    ++notes;
  CHECK(notes == 1);  // by the launcher, not again by each rank
  std::string yaml;
  for (const std::string& line : lines_of(r.out)) {
    if (line.rfind("[rank 1] config: ", 0) == 0) yaml += line.substr(17) + "\n";
  }
  const accel::Config config = accel::Config::load_string(yaml, "resolved config");
  CHECK(config.backend == "zero");
  CHECK(config.zero.stage == 3);
  CHECK(config.zero.offload_optimizer_device == accel::OffloadDevice::Cpu);
  // The block reaches the ranks for accel::Trainer (issue 51), as the file's other Trainer keys.
  CHECK(config.zero.trainer_keys ==
        "{\"gradient_accumulation_steps\":\"auto\",\"optimizer\":{\"type\":\"AdamW\"}}");
  CHECK(config.gradient_accumulation_steps == 2);
}

TEST_CASE("launcher: --max_restarts starts every rank again after a failure, up to the limit") {
  const RunResult ok = run({"launch", "--num_processes", "2", "--main_process_port", "0", "--max_restarts",
                            "2", script("flaky_rank.sh")},
                           {"FAIL_TIMES=2"});
  INFO("stdout:\n" << ok.out << "\nstderr:\n" << ok.err);
  CHECK(ok.exit_code == 0);
  CHECK(contains(ok.out, "[rank 1] rank 1 fails on attempt 0\n"));
  CHECK(contains(ok.out, "[rank 1] rank 1 fails on attempt 1\n"));
  CHECK(contains(ok.out, "[rank 0] rank 0 ok on attempt 2 of at most 2 restarts"));
  CHECK(contains(ok.out, "[rank 1] rank 1 ok on attempt 2 of at most 2 restarts"));
  CHECK(contains(ok.err, "accel-launch: restarting all 2 rank(s) (restart 1 of 2)"));
  CHECK(contains(ok.err, "accel-launch: restarting all 2 rank(s) (restart 2 of 2)"));
  CHECK(contains(ok.err, "failed with exit code 3"));  // each failure is reported before its restart

  const RunResult gave_up = run({"launch", "--num_processes", "2", "--main_process_port", "0",
                                 "--max_restarts", "1", script("flaky_rank.sh")},
                                {"FAIL_TIMES=2"});
  INFO("stderr:\n" << gave_up.err);
  CHECK(gave_up.exit_code == 3);
  CHECK(contains(gave_up.err, "accel-launch: gave up after 1 restart(s) (--max_restarts 1)"));
  CHECK_FALSE(contains(gave_up.out, "rank 1 ok on attempt"));

  const RunResult two_machines =
      run({"launch", "--num_processes", "4", "--num_machines", "2", "--main_process_ip", "127.0.0.1",
           "--main_process_port", "29999", "--max_restarts", "1", script("print_env.sh")});
  CHECK(two_machines.exit_code == 2);
  CHECK(contains(two_machines.err, "--max_restarts restarts the ranks of one machine"));
}

TEST_CASE("launcher: --log_dir writes one file per rank, and the console gets the lines only with --tee") {
  TempDir dir;
  const std::string logs = (dir.path() / "logs").string();
  const RunResult quiet = run({"launch", "--num_processes", "2", "--main_process_port", "0", "--log_dir",
                               logs, script("print_env.sh")});
  INFO("stdout:\n" << quiet.out << "\nstderr:\n" << quiet.err);
  REQUIRE(quiet.exit_code == 0);
  CHECK_FALSE(contains(quiet.out, "[rank"));
  for (int r = 0; r < 2; ++r) {
    std::ifstream file(logs + "/rank_" + std::to_string(r) + ".log");
    std::stringstream text;
    text << file.rdbuf();
    CHECK(contains(text.str(), "RANK=" + std::to_string(r) + "\n"));
    CHECK(contains(text.str(), "stderr of rank " + std::to_string(r) + "\n"));
    CHECK_FALSE(contains(text.str(), "[rank"));
  }
  const RunResult tee = run({"launch", "--num_processes", "2", "--main_process_port", "0", "--log_dir", logs,
                             "--tee", script("print_env.sh")});
  REQUIRE(tee.exit_code == 0);
  CHECK(values(tee.out, "RANK") == std::multiset<std::string>{"0", "1"});
  std::ifstream again(logs + "/rank_1.log");
  std::stringstream text;
  text << again.rdbuf();
  const auto log_lines = lines_of(text.str());
  CHECK(std::count(log_lines.begin(), log_lines.end(), "RANK=1") == 2);  // appended, not replaced

  const RunResult tee_alone =
      run({"launch", "--num_processes", "2", "--main_process_port", "0", "--tee", script("print_env.sh")});
  CHECK(tee_alone.exit_code == 2);
  CHECK(contains(tee_alone.err, "--tee copies the ranks' output"));
}

TEST_CASE("launcher: --num_cpu_threads_per_process sets OMP_NUM_THREADS of every rank") {
  const RunResult r = run({"launch", "--num_processes", "2", "--main_process_port", "0",
                           "--num_cpu_threads_per_process", "3", script("print_env.sh")},
                          {"OMP_NUM_THREADS=7"});
  REQUIRE(r.exit_code == 0);
  CHECK(values(r.out, "OMP_NUM_THREADS") == std::multiset<std::string>{"3", "3"});
  CHECK(values(r.out, "TORCHELASTIC_RESTART_COUNT") == std::multiset<std::string>{"0", "0"});
}

TEST_CASE("launcher: config update rewrites a config with every key and keeps the original") {
  TempDir dir;
  const std::string original = "distributed_type: MULTI_CPU\nnum_processes: 2\nmixed_precision: bf16\n";
  const std::string path = write_file(dir, "old.yaml", original);
  const RunResult r = run({"config", "update", "--config_file", path});
  INFO("stdout:\n" << r.out << "\nstderr:\n" << r.err);
  REQUIRE(r.exit_code == 0);
  std::ifstream updated(path), backup(path + ".bak");
  std::stringstream updated_text, backup_text;
  updated_text << updated.rdbuf();
  backup_text << backup.rdbuf();
  CHECK(backup_text.str() == original);
  CHECK(contains(updated_text.str(), "ddp_bucket_cap_mb: 25\n"));
  CHECK(contains(updated_text.str(), "fsdp_config: {}\n"));
  CHECK(accel::Config::load_file(path) == accel::Config::load_string(original));
  const RunResult missing = run({"config", "update", "--config_file", (dir.path() / "nope.yaml").string()});
  CHECK(missing.exit_code == 2);
  CHECK(contains(missing.err, "nope.yaml does not exist"));
}

TEST_CASE(
    "launcher: ranks and what they started die with the launcher, also when it is killed with SIGKILL; its "
    "resolved config file is deleted") {
  TempDir dir;
  // Each rank starts a helper of its own first (a wrapper script's program): the ranks die through
  // PR_SET_PDEATHSIG, their helpers through the launcher's watchdog, which kills the ranks' process groups.
  Launcher launcher(
      {"launch", "--num_processes", "2", "--main_process_port", "0", script("pid_then_sleep.sh")},
      {"MARKER_DIR=" + dir.str(), "HELPER=1"});
  REQUIRE(launcher.wait_for(
      [&] {
        return contains(launcher.out(), "[rank 0] ready\n") && contains(launcher.out(), "[rank 1] ready\n");
      },
      20));
  std::vector<std::pair<std::string, pid_t>> processes;
  for (const char* name : {"pid.0", "pid.1", "helper.0", "helper.1"}) {
    std::ifstream in(dir.path() / name);
    pid_t pid = 0;
    REQUIRE(in >> pid);
    REQUIRE_FALSE(process_gone(pid));
    processes.emplace_back(name, pid);
  }
  REQUIRE(::kill(launcher.pid(), SIGKILL) == 0);  // the launcher alone: it cannot stop anything
  const auto deadline = Clock::now() + std::chrono::seconds(3);
  for (const auto& [name, pid] : processes) {
    while (!process_gone(pid) && Clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    INFO(name << " (pid " << pid << ") ignores SIGTERM and sleeps 60 s");
    CHECK(process_gone(pid));
  }
  // The launcher could not delete the resolved config file it wrote to $TMPDIR: its watchdog does.
  std::string config_file;
  REQUIRE(std::getline(std::ifstream(dir.path() / "config.0"), config_file));
  REQUIRE_FALSE(config_file.empty());
  while (std::filesystem::exists(config_file) && Clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  INFO("the resolved config file " << config_file);
  CHECK_FALSE(std::filesystem::exists(config_file));
}

TEST_CASE("launcher: after SIGTERM, what the ranks started and left ignoring it is killed before exit") {
  TempDir dir;
  // The ranks end on the forwarded SIGTERM within the grace period; their helpers ignore it: killed with the
  // ranks' process groups before the launcher exits (they trained on, orphaned, before).
  Launcher launcher(
      {"launch", "--num_processes", "2", "--main_process_port", "0", script("pid_then_sleep.sh")},
      {"MARKER_DIR=" + dir.str(), "HELPER=1", "TERM_EXITS=1"});
  REQUIRE(launcher.wait_for(
      [&] {
        return contains(launcher.out(), "[rank 0] ready\n") && contains(launcher.out(), "[rank 1] ready\n");
      },
      20));
  std::vector<pid_t> helpers;
  for (const char* name : {"helper.0", "helper.1"}) {
    std::ifstream in(dir.path() / name);
    pid_t pid = 0;
    REQUIRE(in >> pid);
    helpers.push_back(pid);
  }
  REQUIRE(::kill(launcher.pid(), SIGTERM) == 0);
  const RunResult r = launcher.finish(30);
  CHECK(r.exit_code == 128 + SIGTERM);
  const auto deadline = Clock::now() + std::chrono::seconds(2);
  for (const pid_t pid : helpers) {
    while (!process_gone(pid) && Clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    CHECK(process_gone(pid));
  }
}

TEST_CASE("launcher: a rank that exits 0 while the others run on is named within seconds") {
  // --early_exit_report 1 (default 5 s, below) keeps the test short.
  const RunResult r = run({"launch", "--num_processes", "2", "--main_process_port", "0",
                           "--early_exit_report", "1", script("early_exit.sh")},
                          {"SLEEP=2.5"});
  INFO("stdout:\n" << r.out << "\nstderr:\n" << r.err);
  CHECK(r.exit_code == 0);
  CHECK(std::regex_search(
      r.err,
      std::regex("accel-launch: rank 1 exited with code 0 [1-2] s ago while 1 rank\\(s\\) still run \\(0\\); "
                 "if they wait for it in a collective .* until the collective timeout "
                 "\\(collective_timeout_seconds, ACCEL_COLLECTIVE_TIMEOUT\\)\n")));
  // Ranks that end a moment apart say nothing; the default waits 5 s.
  const RunResult quiet = run(
      {"launch", "--num_processes", "2", "--main_process_port", "0", script("early_exit.sh")}, {"SLEEP=2"});
  CHECK(quiet.exit_code == 0);
  CHECK_FALSE(contains(quiet.err, "exited with code 0"));
  const RunResult help = run({"launch", "--help"});
  CHECK(std::regex_search(help.out, std::regex("--early_exit_report[^\n]*FLOAT=5\\b")));
}

TEST_CASE("launcher: a picked port taken before rank 0 listens is replaced, without using a restart") {
  TempDir dir;
  const RunResult r =
      run({"launch", "--num_processes", "2", "--main_process_port", "0", script("port_taken_once.sh")},
          {"MARKER_DIR=" + dir.str()});
  INFO("stdout:\n" << r.out << "\nstderr:\n" << r.err);
  CHECK(r.exit_code == 0);
  CHECK(std::regex_search(r.err,
                          std::regex("accel-launch: port [0-9]+ was taken by another program before rank 0 "
                                     "listened on it; starting the ranks again on another free port\n")));
  std::set<std::string> seen;
  for (const std::string& line : lines_of(r.out)) {
    std::smatch m;
    if (std::regex_match(line, m, std::regex("\\[rank [01]\\] port ([0-9]+)"))) seen.insert(m[1]);
  }
  REQUIRE(seen.size() == 1);  // both ranks got the new port
  CHECK(!contains(r.err, "accel-launch: port " + *seen.begin() + " was taken"));
  // Two launchers picked the same port: a rank refused by the other job's store fails first; the same.
  TempDir other_dir;
  const RunResult other =
      run({"launch", "--num_processes", "2", "--main_process_port", "0", script("port_taken_once.sh")},
          {"MARKER_DIR=" + other_dir.str(), "OTHER_JOB=1"});
  INFO("stderr:\n" << other.err);
  CHECK(other.exit_code == 0);
  CHECK(contains(other.err, "was taken by another program before rank 0 listened on it"));
  // An explicit port is the user's: it is never replaced.
  TempDir fixed_dir;
  const RunResult fixed = run({"launch", "--num_processes", "2", "--main_process_port",
                               std::to_string(free_port()), script("port_taken_once.sh")},
                              {"MARKER_DIR=" + fixed_dir.str()});
  CHECK(fixed.exit_code == 1);
  CHECK_FALSE(contains(fixed.err, "was taken by another program"));
}

TEST_CASE("launcher: more than 8 ranks per core is refused unless --oversubscribe") {
  const RunResult r = run({"launch", "--num_processes", "100000", "--main_process_port", "0", "/bin/true"});
  INFO("stderr:\n" << r.err);
  CHECK(r.exit_code == 2);
  CHECK(r.seconds < 5.0);
  CHECK(std::regex_search(r.err,
                          std::regex("num_processes asks for 100000 ranks on this machine, which has [0-9]+ "
                                     "core\\(s\\) \\(more than 8 per core and more than 16\\); use fewer, or "
                                     "pass --oversubscribe to start them anyway")));
  const RunResult forced =
      run({"launch", "--num_processes", "17", "--oversubscribe", "--main_process_port", "0", "/bin/true"});
  CHECK(forced.exit_code == 0);
}

TEST_CASE(
    "launcher: copies of a stop signal (as `timeout` sends) wait out the grace period; a later one kills") {
  using accel::launcher::escalates_to_kill;
  CHECK_FALSE(escalates_to_kill(SIGTERM, 0.000001));  // timeout: to the launcher, then to its process group
  CHECK_FALSE(escalates_to_kill(SIGTERM, 0.9));
  CHECK(escalates_to_kill(SIGTERM, 1.0));
  CHECK(escalates_to_kill(SIGHUP, 2.0));
  CHECK_FALSE(escalates_to_kill(SIGINT, 0.01));  // timeout -s INT
  CHECK(escalates_to_kill(SIGINT, 0.3));         // Ctrl-C twice

  TempDir dir;
  const std::vector<std::string> args = {"launch", "--num_processes",     "2", "--main_process_port",
                                         "0",      script("trap_term.sh")};
  // The ranks save a checkpoint for a second on SIGTERM (TERM_DELAY), then write their marker and exit 0.
  const std::vector<std::string> env = {"MARKER_DIR=" + dir.str(), "TERM_DELAY=1"};
  auto both_ready = [](Launcher& launcher) {
    return launcher.wait_for(
        [&] {
          return contains(launcher.out(), "[rank 0] ready\n") && contains(launcher.out(), "[rank 1] ready\n");
        },
        20);
  };
  SECTION("under timeout -s TERM") {
    Launcher launcher(args, env, {}, {"timeout", "-s", "TERM", "3"});
    const RunResult r = launcher.finish();
    INFO("stdout:\n" << r.out << "\nstderr:\n" << r.err);
    CHECK(r.exit_code == 124);  // timeout's own code once its signal ended the command
    CHECK(fs::exists(dir.path() / "term.0"));
    CHECK(fs::exists(dir.path() / "term.1"));
    CHECK_FALSE(contains(r.err, "killed the ranks at once"));
  }
  SECTION("a second SIGTERM 0.1 s after the first is absorbed") {
    Launcher launcher(args, env);
    REQUIRE(both_ready(launcher));
    REQUIRE(::kill(launcher.pid(), SIGTERM) == 0);
    launcher.wait_for([] { return false; }, 0.1);
    REQUIRE(::kill(launcher.pid(), SIGTERM) == 0);
    const RunResult r = launcher.finish();
    INFO("stdout:\n" << r.out << "\nstderr:\n" << r.err);
    CHECK(r.exit_code == 143);
    CHECK(fs::exists(dir.path() / "term.0"));
    CHECK(fs::exists(dir.path() / "term.1"));
    CHECK(
        contains(r.err, "accel-launch: received SIGTERM; forwarded it to all 2 rank(s) and stopped them\n"));
  }
  SECTION("a second SIGTERM a second later, or a second Ctrl-C, kills at once") {
    const bool ctrl_c = GENERATE(false, true);
    const int signal_number = ctrl_c ? SIGINT : SIGTERM;
    std::vector<std::string> slow = {"MARKER_DIR=" + dir.str(), "TERM_DELAY=8", "ALSO_TRAP=INT"};
    std::vector<std::string> long_grace = args;
    long_grace.insert(long_grace.begin() + 1, {"--grace_period", "30"});
    Launcher launcher(long_grace, slow);
    REQUIRE(both_ready(launcher));
    REQUIRE(::kill(launcher.pid(), signal_number) == 0);
    const auto first = Clock::now();
    launcher.wait_for([] { return false; }, ctrl_c ? 0.4 : 1.2);
    REQUIRE(::kill(launcher.pid(), signal_number) == 0);
    const RunResult r = launcher.finish();
    INFO("stdout:\n" << r.out << "\nstderr:\n" << r.err);
    CHECK(std::chrono::duration<double>(Clock::now() - first).count() < (ctrl_c ? 3.0 : 4.0));
    CHECK(r.exit_code == 128 + signal_number);
    CHECK(fs::is_empty(dir.path()));  // killed before the checkpoint's end
    const std::string name = ctrl_c ? "SIGINT" : "SIGTERM";
    CHECK(
        std::regex_search(r.err, std::regex("accel-launch: " + name + " [0-9.]+ s after " + name +
                                            ": killed the ranks at once \\(SIGKILL\\) instead of waiting out "
                                            "the 30 s grace period\n")));
  }
  const RunResult help = run({"launch", "--help"});
  CHECK(std::regex_search(help.out, std::regex("a second Ctrl-C, or a second\\s+signal 1 s or more after the "
                                               "first, kills them at once")));
}

TEST_CASE(
    "launcher: a stop signal while hundreds of ranks start stops the starting, leaving no config file") {
  TempDir markers, tmp;
  // 1000 ranks take a second or more to fork here; the signal comes when the first has started.
  Launcher launcher({"launch", "--num_processes", "1000", "--oversubscribe", "--main_process_port", "0", "sh",
                     "-c", "touch \"$MARKER_DIR/started.$RANK\"; exec sleep 30"},
                    {"MARKER_DIR=" + markers.str(), "TMPDIR=" + tmp.str()});
  REQUIRE(launcher.wait_for([&] { return fs::exists(markers.path() / "started.0"); }, 20));
  REQUIRE(::kill(launcher.pid(), SIGTERM) == 0);
  const auto signalled = Clock::now();
  const RunResult r = launcher.finish();
  INFO("stderr:\n" << r.err);
  CHECK(std::chrono::duration<double>(Clock::now() - signalled).count() < 5.0);
  CHECK(r.exit_code == 143);
  std::smatch started;
  REQUIRE(
      std::regex_search(r.err, started,
                        std::regex("accel-launch: received SIGTERM while starting the ranks \\(([0-9]+) of "
                                   "1000 started\\); started no more, forwarded it to those and stopped "
                                   "them\n")));
  CHECK(std::stoi(started[1]) < 1000);
  CHECK(fs::is_empty(tmp.path()));  // the resolved config file is gone
}

TEST_CASE(
    "launcher: a stop signal that waited while the launcher prepared is acted on before any rank starts") {
  TempDir dir;
  accel::launcher::SupervisorOptions options;
  options.executable = "/bin/sh";
  options.argv = {"sh", "-c", "touch \"$0/started\"; sleep 30", dir.str()};
  for (int rank = 0; rank < 3; ++rank)
    options.ranks.push_back({rank, rank, {"PATH=/usr/bin:/bin"}});
  const auto begin = Clock::now();
  accel::launcher::SupervisorResult result;
  {
    const accel::launcher::StopSignalsDeferred deferred;  // as run_launch holds it around the config file
    REQUIRE(::raise(SIGTERM) == 0);                       // pending, not the default action
    result = accel::launcher::supervise(options);
  }
  CHECK(std::chrono::duration<double>(Clock::now() - begin).count() < 2.0);
  CHECK(result.interrupted);
  CHECK(result.exit_code == 143);
  CHECK(
      result.report ==
      "accel-launch: received SIGTERM while starting the ranks (0 of 3 started); started no more, forwarded "
      "it to those and stopped them\n");
  CHECK(fs::is_empty(dir.path()));
}

TEST_CASE("launcher: a rank that exited 0 before another failed in a collective is named as the cause") {
  const std::string collective_failure =
      "accel: rank 0: all_reduce failed: another rank of the group closed its connection (Connection closed "
      "by peer): that rank stopped first";
  const RunResult r =
      run({"launch", "--num_processes", "2", "--main_process_port", "0", script("early_exit.sh")},
          {"SLEEP=0.5", "FAIL_LINE=" + collective_failure});
  INFO("stdout:\n" << r.out << "\nstderr:\n" << r.err);
  CHECK(r.exit_code == 1);
  CHECK(std::regex_search(
      r.err,
      std::regex("accel-launch: rank 1 \\(local rank 1, pid [0-9]+\\) exited with status 0 at "
                 "[0-9]{2}:[0-9]{2}:[0-9]{2}, [0-9.]+ s before rank 0 failed, while rank 0 waited for it "
                 "in a collective \\(its error says a peer closed its connection or never arrived\\): "
                 "rank 1 is the cause, rank 0 only its consequence; every rank must make the same "
                 "collective calls \\(a rank-dependent return, break or exit skips them\\), so look "
                 "first at why rank 1 stopped early\naccel-launch: rank 0 \\(local rank 0, pid "
                 "[0-9]+\\) failed with exit code 1\n")));
  // A failure that does not say it waited for a peer: the rank that left is named, without a verdict.
  const RunResult other =
      run({"launch", "--num_processes", "2", "--main_process_port", "0", script("early_exit.sh")},
          {"SLEEP=0.5", "FAIL_LINE=out of memory"});
  CHECK(other.exit_code == 1);
  CHECK(std::regex_search(
      other.err, std::regex("exited with status 0 at [0-9:]+, [0-9.]+ s before rank 0 failed, while "
                            "rank 0 still ran: if rank 0 waited for it in a collective, rank 1 is the "
                            "cause;")));
  // A rank that fails while no other has left is reported as before, alone.
  const RunResult alone =
      run({"launch", "--num_processes", "2", "--main_process_port", "0", script("fail_rank.sh")},
          {"FAIL_RANK=1", "FAIL_CODE=3"});
  CHECK_FALSE(contains(alone.err, "exited with status 0"));
}

TEST_CASE("launcher: the ranks of a launch share one run id, random per launch unless --run_id names it") {
  auto ids = [](const RunResult& r) { return values(r.out, "TORCHELASTIC_RUN_ID"); };
  const RunResult first =
      run({"launch", "--num_processes", "2", "--main_process_port", "0", script("print_env.sh")});
  const RunResult second =
      run({"launch", "--num_processes", "2", "--main_process_port", "0", script("print_env.sh")});
  REQUIRE(first.exit_code == 0);
  REQUIRE(second.exit_code == 0);
  REQUIRE(ids(first).size() == 2);
  const std::string id = *ids(first).begin();
  CHECK(ids(first) == std::multiset<std::string>{id, id});
  CHECK(std::regex_match(id, std::regex("[0-9a-f]{16}")));
  CHECK(*ids(second).begin() != id);
  // The user's id (the same on every machine), under either spelling (torchrun's --rdzv_id too).
  const RunResult named = run({"launch", "--num_processes", "2", "--main_process_port", "0", "--rdzv-id",
                               "job-4711", script("print_env.sh")},
                              {"TORCHELASTIC_RUN_ID=inherited"});
  CHECK(ids(named) == std::multiset<std::string>{"job-4711", "job-4711"});
  const RunResult bad =
      run({"launch", "--run_id", "two words", "--main_process_port", "0", script("print_env.sh")});
  CHECK(bad.exit_code == 2);
  CHECK(
      bad.err ==
      "accel-launch: error: --run_id 'two words' must be 1 to 128 letters, digits, '-', '_', '.' or ':' (the "
      "same on every machine of the job, e.g. the scheduler's job id)\n");
  // Several machines cannot agree on a random id: torchrun's "none", and a note asking for --run_id.
  const std::string port = std::to_string(free_port());
  auto machine = [&port](const std::string& rank) {
    return std::vector<std::string>{"launch",    "--num_processes",     "2",  "--num_machines",
                                    "2",         "--machine_rank",      rank, "--main_process_ip",
                                    "127.0.0.1", "--main_process_port", port, script("print_env.sh")};
  };
  Launcher machine0(machine("0"));
  Launcher machine1(machine("1"));
  const RunResult r0 = machine0.finish();
  const RunResult r1 = machine1.finish();
  CHECK(ids(r0) == std::multiset<std::string>{"none"});
  CHECK(ids(r1) == std::multiset<std::string>{"none"});
  CHECK(contains(r0.err,
                 "accel-launch: note: no --run_id: the job's rendezvous id is \"none\"; pass the same "
                 "--run_id (e.g. the scheduler's job id) to the launcher of every machine, so that a rank "
                 "of another job on port " +
                     port + " is refused instead of joining this one\n"));
}

TEST_CASE("launcher: a privileged main_process_port (below 1024) is warned about before it is used") {
  // Root binds it (the run goes on); anyone else is refused by the port check after the warning.
  const RunResult r = run({"launch", "--main_process_port", "1023", "/bin/true"});
  INFO("stderr:\n" << r.err);
  CHECK(contains(r.err,
                 "accel-launch: warning: main_process_port 1023 is a privileged port (below 1024): "
                 "binding it needs root (or CAP_NET_BIND_SERVICE) and system services use these "
                 "ports; choose one from 1024 to 65535 (torchrun's default is 29500) or 0 to pick a "
                 "free one\n"));
  const RunResult fine = run({"launch", "--main_process_port", "0", "/bin/true"});
  CHECK(fine.exit_code == 0);
  CHECK_FALSE(contains(fine.err, "privileged"));
}

namespace {

// The C library this test runs with (/proc/self/maps): a real shared object that every rank loads anyway, so
// a fake allocator library pointing at it can be preloaded without changing what the ranks do.
std::string c_library_path() {
  std::ifstream maps("/proc/self/maps");
  for (std::string line; std::getline(maps, line);) {
    const std::size_t slash = line.find('/');
    if (slash != std::string::npos && contains(line, "/libc.so.6")) return line.substr(slash);
  }
  return "";
}

}  // namespace

TEST_CASE(
    "launcher: --enable_jemalloc/--enable_tcmalloc preload the library found into every rank (prepended), "
    "warn naming the search when it is missing, and --use_default_allocator leaves LD_PRELOAD alone") {
  TempDir dir;
  const std::string libc = c_library_path();
  REQUIRE_FALSE(libc.empty());
  const std::string jemalloc = dir.str() + "/libjemalloc.so.2";
  fs::create_symlink(libc, jemalloc);
  // Only these directories are searched (no system directory, no ldconfig cache): the test does not depend on
  // what the machine has installed.
  const std::string search = "ACCEL_ALLOCATOR_SEARCH_PATH=/nonexistent/accel-allocator:" + dir.str();
  const auto launch = [](const std::vector<std::string>& flags, const std::vector<std::string>& env) {
    std::vector<std::string> args = {"launch", "--num_processes", "2", "--main_process_port", "0"};
    args.insert(args.end(), flags.begin(), flags.end());
    for (const char* part :
         {"/bin/sh", "-c", "echo LD_PRELOAD=${LD_PRELOAD:-unset}; echo MALLOC_CONF=${MALLOC_CONF:-unset}"})
      args.emplace_back(part);
    return run(args, env);
  };
  const auto twice = [](const std::string& value) { return std::multiset<std::string>{value, value}; };

  // Found: prepended to the inherited LD_PRELOAD, with run_cpu's MALLOC_CONF, and said once.
  const RunResult je = launch({"--enable_jemalloc"}, {search, "LD_PRELOAD=" + libc, "MALLOC_CONF"});
  INFO("stdout:\n" << je.out << "\nstderr:\n" << je.err);
  REQUIRE(je.exit_code == 0);
  CHECK(values(je.out, "LD_PRELOAD") == twice(jemalloc + ":" + libc));
  const std::string run_cpu_conf = "oversize_threshold:1,background_thread:true,metadata_thp:auto";
  CHECK(values(je.out, "MALLOC_CONF") == twice(run_cpu_conf));
  CHECK(contains(je.err, "accel-launch: preloading jemalloc into every rank: LD_PRELOAD=" + jemalloc + ":" +
                             libc + ", MALLOC_CONF=" + run_cpu_conf + "\n"));
  // The user's MALLOC_CONF is kept (as run_cpu keeps it); the dashed spelling works.
  const RunResult conf =
      launch({"--enable-jemalloc"}, {search, "LD_PRELOAD", "MALLOC_CONF=dirty_decay_ms:0"});
  REQUIRE(conf.exit_code == 0);
  CHECK(values(conf.out, "LD_PRELOAD") == twice(jemalloc));
  CHECK(values(conf.out, "MALLOC_CONF") == twice("dirty_decay_ms:0"));

  // Missing: a warning naming the files and the directories searched; the ranks run with LD_PRELOAD
  // unchanged.
  const RunResult tc = launch({"--enable-tcmalloc"}, {search, "LD_PRELOAD"});
  INFO("stderr:\n" << tc.err);
  REQUIRE(tc.exit_code == 0);
  CHECK(values(tc.out, "LD_PRELOAD") == twice("unset"));
  CHECK(contains(tc.err,
                 "accel-launch: warning: --enable_tcmalloc: none of libtcmalloc.so, libtcmalloc.so.4, "
                 "libtcmalloc_minimal.so, libtcmalloc_minimal.so.4 found in /nonexistent/accel-allocator, " +
                     dir.str() + "; the ranks run with glibc's malloc"));

  // --use_default_allocator, and no flag (the default): LD_PRELOAD as inherited, nothing said.
  for (const std::vector<std::string>& flags :
       {std::vector<std::string>{"--use_default_allocator"}, std::vector<std::string>{}}) {
    const RunResult plain = launch(flags, {search, "LD_PRELOAD=" + libc});
    REQUIRE(plain.exit_code == 0);
    CHECK(values(plain.out, "LD_PRELOAD") == twice(libc));
    CHECK(values(plain.out, "MALLOC_CONF") == twice("unset"));
    CHECK_FALSE(contains(plain.err, "preloading"));
  }
  // Two allocators: refused before any rank starts.
  const RunResult both = launch({"--enable_tcmalloc", "--enable_jemalloc"}, {search});
  CHECK(both.exit_code == 2);
  CHECK(contains(both.err, "--enable_tcmalloc excludes --enable_jemalloc"));
  CHECK_FALSE(contains(both.out, "LD_PRELOAD="));
}

TEST_CASE(
    "launcher: train preloads tcmalloc where it is found (run_cpu's default), notes glibc's malloc where it "
    "is "
    "not, and keeps an allocator the user preloads or --use_default_allocator") {
  TempDir dir;
  const std::string libc = c_library_path();
  REQUIRE_FALSE(libc.empty());
  fs::create_directories(dir.path() / "with");
  const std::string tcmalloc = dir.str() + "/with/libtcmalloc_minimal.so.4";
  fs::create_symlink(libc, tcmalloc);
  // The Trainer program: prints its LD_PRELOAD (train puts the type's files before its arguments).
  const std::string program = dir.str() + "/program.sh";
  {
    std::ofstream f(program);
    f << "#!/bin/sh\necho LD_PRELOAD=${LD_PRELOAD:-unset}\n";
  }
  fs::permissions(program, fs::perms::owner_all);
  const auto train = [&](const std::vector<std::string>& flags, const std::vector<std::string>& env) {
    std::vector<std::string> args = {"train", "-t", "lora", "--num_processes", "2", "--main_process_port",
                                     "0"};
    args.insert(args.end(), flags.begin(), flags.end());
    args.push_back(program);
    return run(args, env);
  };
  const auto twice = [](const std::string& value) { return std::multiset<std::string>{value, value}; };
  const std::string found = "ACCEL_ALLOCATOR_SEARCH_PATH=" + dir.str() + "/with";
  const std::string none = "ACCEL_ALLOCATOR_SEARCH_PATH=/nonexistent/accel-allocator";

  const RunResult pre = train({}, {found, "LD_PRELOAD"});
  INFO("stdout:\n" << pre.out << "\nstderr:\n" << pre.err);
  REQUIRE(pre.exit_code == 0);
  CHECK(values(pre.out, "LD_PRELOAD") == twice(tcmalloc));
  CHECK(contains(pre.err, "accel-launch: preloading tcmalloc into every rank: LD_PRELOAD=" + tcmalloc));
  // Not installed: a note, not the warning of an asked-for allocator; glibc's malloc.
  const RunResult missing = train({}, {none, "LD_PRELOAD"});
  REQUIRE(missing.exit_code == 0);
  CHECK(values(missing.out, "LD_PRELOAD") == twice("unset"));
  CHECK(contains(missing.err, "accel-launch: note: train preloads tcmalloc where it is installed"));
  CHECK_FALSE(contains(missing.err, "warning"));
  // The user's own allocator in LD_PRELOAD stays alone; --use_default_allocator preloads nothing.
  const std::string own = dir.str() + "/libjemalloc.so.2";
  fs::create_symlink(libc, own);
  const RunResult kept = train({}, {found, "LD_PRELOAD=" + own});
  REQUIRE(kept.exit_code == 0);
  CHECK(values(kept.out, "LD_PRELOAD") == twice(own));
  const RunResult plain = train({"--use_default_allocator"}, {found, "LD_PRELOAD"});
  REQUIRE(plain.exit_code == 0);
  CHECK(values(plain.out, "LD_PRELOAD") == twice("unset"));
  CHECK_FALSE(contains(plain.err, "preloading"));
}
