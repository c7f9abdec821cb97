#include "../../accelerate_cpp/src/checkpoint/atomic_dir.hpp"

#include <signal.h>
#include <stdlib.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <set>
#include <string>
#include <vector>

#include "accel/checkpoint/safetensors.hpp"
#include "accel/errors.hpp"
#include "temp_dir.hpp"

namespace fs = std::filesystem;
using accel::detail::AtomicDirectory;

namespace {

using accel::test::TempDir;

std::string read_text(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

void write_text(const fs::path& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary);
  out << text;
}

// File names directly inside `dir`.
std::set<std::string> entries(const fs::path& dir) {
  std::set<std::string> out;
  for (const auto& entry : fs::directory_iterator(dir))
    out.insert(entry.path().filename().string());
  return out;
}

// The pid of a process that has exited (and been reaped), to name stale temporary directories.
pid_t dead_pid() {
  const pid_t pid = ::fork();
  if (pid == 0) ::_exit(0);
  int status = 0;
  ::waitpid(pid, &status, 0);
  return pid;
}

// A complete checkpoint "generation": a safetensors file whose tensor holds `value`, plus a small state file.
void write_checkpoint(const fs::path& dir, float value, int files = 2) {
  const std::vector<float> weights(4, value);
  accel::safetensors::write_file((dir / "model.safetensors").string(),
                                 {{"w", accel::safetensors::DType::F32, {4}, weights.data(), 16}});
  for (int i = 1; i < files; ++i)
    write_text(dir / ("state_" + std::to_string(i) + ".txt"), std::to_string(value));
}

// Reads the checkpoint written by write_checkpoint and returns its value (fails on any inconsistency).
float read_checkpoint(const fs::path& dir) {
  const auto file = accel::safetensors::File::open((dir / "model.safetensors").string());
  float values[4];
  std::memcpy(values, file.data("w"), sizeof values);
  for (float v : values)
    REQUIRE(v == values[0]);
  REQUIRE(read_text(dir / "state_1.txt") == std::to_string(values[0]));
  return values[0];
}

}  // namespace

TEST_CASE("atomic_dir: commit creates, then replaces, the directory") {
  TempDir scratch;
  const fs::path dir = scratch.path / "nested" / "step_1";
  {
    AtomicDirectory out(dir.string());
    CHECK(out.final_path() == dir);
    CHECK(out.path().parent_path() == dir.parent_path());
    CHECK(out.path().filename().string().rfind("step_1.tmp-" + std::to_string(::getpid()) + "-", 0) == 0);
    CHECK(!fs::exists(dir));
    write_checkpoint(out.path(), 1.0f);
    write_text(out.path() / "only_in_first.txt", "x");
    fs::create_directory(out.path() / "sub");
    write_text(out.path() / "sub" / "rng.bin", "rng");
    out.commit();
    CHECK(out.committed());
  }
  CHECK(read_checkpoint(dir) == 1.0f);
  CHECK(read_text(dir / "sub" / "rng.bin") == "rng");
  CHECK(entries(dir.parent_path()) == std::set<std::string>{"step_1"});

  {
    AtomicDirectory out(dir.string() + "/");  // trailing slash names the same directory
    write_checkpoint(out.path(), 2.0f);
    out.commit();
    CHECK_THROWS_AS(out.commit(), accel::UsageError);
  }
  CHECK(read_checkpoint(dir) == 2.0f);
  CHECK(!fs::exists(dir / "only_in_first.txt"));  // replaced, not merged
  CHECK(entries(dir.parent_path()) == std::set<std::string>{"step_1"});
}

TEST_CASE("atomic_dir: without commit the temporary directory is removed and the old one kept") {
  TempDir scratch;
  const fs::path dir = scratch.path / "ckpt";
  {
    AtomicDirectory out(dir.string());
    write_checkpoint(out.path(), 1.0f);
    out.commit();
  }
  {
    AtomicDirectory out(dir.string());
    write_checkpoint(out.path(), 2.0f);
    CHECK(fs::exists(out.path()));
  }  // e.g. an exception while saving
  CHECK(read_checkpoint(dir) == 1.0f);
  CHECK(entries(scratch.path) == std::set<std::string>{"ckpt"});
}

TEST_CASE("atomic_dir: a process killed before commit leaves the previous checkpoint intact") {
  TempDir scratch;
  const fs::path dir = scratch.path / "ckpt";
  {
    AtomicDirectory out(dir.string());
    write_checkpoint(out.path(), 1.0f);
    out.commit();
  }
  for (const bool sigkill : {false, true}) {
    INFO((sigkill ? "SIGKILL" : "_exit(1)"));
    const pid_t child = ::fork();
    REQUIRE(child >= 0);
    if (child == 0) {
      // Half a checkpoint, then die without unwinding (no destructor runs).
      try {
        AtomicDirectory out(dir.string());
        const std::vector<float> weights(4, 2.0f);
        accel::safetensors::write_file((out.path() / "model.safetensors").string(),
                                       {{"w", accel::safetensors::DType::F32, {4}, weights.data(), 16}});
        if (sigkill) ::raise(SIGKILL);
        ::_exit(1);  // inside the scope: the destructor must not run
      } catch (...) {
      }
      ::_exit(2);
    }
    int status = 0;
    REQUIRE(::waitpid(child, &status, 0) == child);
    if (sigkill) {
      REQUIRE(WIFSIGNALED(status));
      CHECK(WTERMSIG(status) == SIGKILL);
    } else {
      REQUIRE(WIFEXITED(status));
      CHECK(WEXITSTATUS(status) == 1);
    }

    // The previous checkpoint is intact; the child's temporary directory is left behind, never read.
    CHECK(read_checkpoint(dir) == 1.0f);
    const std::string stale = "ckpt.tmp-" + std::to_string(child) + "-";
    const auto names = entries(scratch.path);
    REQUIRE(names.size() == 2);
    CHECK(*names.begin() == "ckpt");
    CHECK(names.rbegin()->rfind(stale, 0) == 0);

    // Recovery removes the dead process's temporary directory and keeps the checkpoint.
    accel::detail::recover_interrupted(dir.string());
    CHECK(entries(scratch.path) == std::set<std::string>{"ckpt"});
    CHECK(read_checkpoint(dir) == 1.0f);
  }
}

TEST_CASE("atomic_dir: recover_interrupted repairs a crash between the two renames") {
  TempDir scratch;
  const fs::path dir = scratch.path / "ckpt";
  {
    AtomicDirectory out(dir.string());
    write_checkpoint(out.path(), 1.0f);
    out.commit();
  }
  // The state commit() leaves after "rename dir -> dir.old-<pid>" when the process dies before the second
  // rename: no dir, the previous checkpoint under .old-<pid>, the new (complete) one under
  // .tmp-<pid>-<random>.
  const pid_t pid = dead_pid();
  const fs::path old = scratch.path / ("ckpt.old-" + std::to_string(pid));
  const fs::path temp = scratch.path / ("ckpt.tmp-" + std::to_string(pid) + "-0badcafe");
  fs::rename(dir, old);
  fs::create_directory(temp);
  write_checkpoint(temp, 2.0f);

  SECTION("explicit recovery") {
    accel::detail::recover_interrupted(dir.string());
    CHECK(read_checkpoint(dir) == 1.0f);
    CHECK(entries(scratch.path) == std::set<std::string>{"ckpt"});
    accel::detail::recover_interrupted(dir.string());  // idempotent
    CHECK(entries(scratch.path) == std::set<std::string>{"ckpt"});
  }
  SECTION("the next save recovers first, then replaces") {
    AtomicDirectory out(dir.string());
    CHECK(read_checkpoint(dir) == 1.0f);
    write_checkpoint(out.path(), 3.0f);
    out.commit();
    CHECK(read_checkpoint(dir) == 3.0f);
    CHECK(entries(scratch.path) == std::set<std::string>{"ckpt"});
  }
}

TEST_CASE("atomic_dir: recover_interrupted removes an old directory left after the second rename") {
  TempDir scratch;
  const fs::path dir = scratch.path / "ckpt";
  fs::create_directory(dir);
  write_checkpoint(dir, 2.0f);
  const fs::path old = scratch.path / "ckpt.old-123";
  fs::create_directory(old);
  write_checkpoint(old, 1.0f);
  write_text(scratch.path / "ckpt.old-notapid", "unrelated");  // not ours: left alone
  write_text(scratch.path / "other.old-1", "unrelated");

  accel::detail::recover_interrupted(dir.string());
  CHECK(read_checkpoint(dir) == 2.0f);
  CHECK(entries(scratch.path) == std::set<std::string>{"ckpt", "ckpt.old-notapid", "other.old-1"});
}

TEST_CASE("atomic_dir: a save removes another checkpoint's temporary directory left by a killed run") {
  // A run killed while saving checkpoint-500 resumes from checkpoint-400 and saves checkpoint-600 next: the
  // unfinished checkpoint-500.tmp-<pid>-<hex> (as large as a checkpoint) goes with that save. Lookalikes that
  // are not ours stay: a file, a live process's directory, a name whose suffix is not 8 hex digits.
  TempDir scratch;
  const pid_t dead = dead_pid();
  const fs::path stale = scratch.path / ("checkpoint-500.tmp-" + std::to_string(dead) + "-0badcafe");
  fs::create_directory(stale);
  write_checkpoint(stale, 5.0f);
  const std::string live = "checkpoint-700.tmp-" + std::to_string(::getpid()) + "-12345678";
  fs::create_directory(scratch.path / live);
  const std::string user_file = "notes.tmp-" + std::to_string(dead) + "-deadbeef";
  write_text(scratch.path / user_file, "the user's");
  const std::string odd = "data.tmp-" + std::to_string(dead) + "-backup";
  fs::create_directory(scratch.path / odd);
  {
    AtomicDirectory out((scratch.path / "checkpoint-600").string());
    write_checkpoint(out.path(), 6.0f);
    out.commit();
  }
  CHECK(entries(scratch.path) == std::set<std::string>{"checkpoint-600", live, user_file, odd});
  CHECK(read_checkpoint(scratch.path / "checkpoint-600") == 6.0f);
}

TEST_CASE("atomic_dir: recover_interrupted leaves temporary directories of live processes alone") {
  TempDir scratch;
  const fs::path dir = scratch.path / "ckpt";
  AtomicDirectory writing(dir.string());  // this live process is "another writer"
  accel::detail::recover_interrupted(dir.string());
  CHECK(fs::is_directory(writing.path()));
}

TEST_CASE("atomic_dir: recover_interrupted refuses to guess between several old directories") {
  TempDir scratch;
  const fs::path dir = scratch.path / "ckpt";
  fs::create_directory(scratch.path / "ckpt.old-11");
  fs::create_directory(scratch.path / "ckpt.old-22");
  try {
    accel::detail::recover_interrupted(dir.string());
    FAIL("no exception");
  } catch (const accel::CheckpointError& error) {
    const std::string message = error.what();
    const std::string a = "'" + (scratch.path / "ckpt.old-11").string() + "'";
    const std::string b = "'" + (scratch.path / "ckpt.old-22").string() + "'";
    const std::string listed = message.find(a) < message.find(b) ? a + ", " + b : b + ", " + a;
    REQUIRE(message == "checkpoint directory '" + dir.string() +
                           "' is missing and several earlier versions exist (" + listed +
                           "); rename the one to keep to '" + dir.string() + "' and delete the others");
  }
}

TEST_CASE("atomic_dir: invalid directory names are rejected") {
  for (const std::string bad : {"", ".", "..", "/", "ckpt/.."}) {
    INFO(bad);
    try {
      AtomicDirectory out(bad);
      FAIL("no exception");
    } catch (const accel::CheckpointError& error) {
      REQUIRE(std::string(error.what()) ==
              "invalid checkpoint directory '" + bad +
                  "': it must name a directory below an existing or creatable parent, e.g. 'ckpt/step_100'");
    }
  }
}

TEST_CASE("atomic_dir: a name that leaves no room for the temporary sibling is refused saying so") {
  TempDir dir;
  // 234 bytes + the 21 of ".tmp-<pid>-<8 hex>" is the 255 a Linux file system allows.
  const std::string fits(234, 'n');
  {
    AtomicDirectory out((dir.path / fits).string());
    out.commit();
  }
  CHECK(fs::is_directory(dir.path / fits));
  for (const std::size_t length : {235u, 237u, 255u}) {
    const std::string name(length, 'n');
    INFO(length);
    try {
      AtomicDirectory out((dir.path / name).string());
      FAIL("no exception");
    } catch (const accel::CheckpointError& error) {
      CHECK(
          std::string(error.what()) ==
          "checkpoint directory name '" + name + "' is " + std::to_string(length) +
              " bytes; a checkpoint is written into a temporary sibling whose name adds up to 21 bytes "
              "('.tmp-<pid>-<8 hex digits>'), and this file system allows 255 bytes per name: use a name of "
              "at most 234 bytes");
    }
  }
}

TEST_CASE("atomic_dir: write_file_atomic replaces a file and leaves no temporary file") {
  TempDir scratch;
  const fs::path file = scratch.path / "state.json";
  accel::detail::write_file_atomic(file.string(), "first");
  CHECK(read_text(file) == "first");
  accel::detail::write_file_atomic(file.string(), std::string("sec\0nd", 6));
  CHECK(read_text(file) == std::string("sec\0nd", 6));
  accel::detail::write_file_atomic(file.string(), "");
  CHECK(read_text(file).empty());
  CHECK(entries(scratch.path) == std::set<std::string>{"state.json"});

  const fs::path missing = scratch.path / "no_such_dir" / "x.json";
  try {
    accel::detail::write_file_atomic(missing.string(), "x");
    FAIL("no exception");
  } catch (const accel::CheckpointError& error) {
    const std::string message = error.what();
    const std::string head = "cannot write checkpoint file '" + missing.string() + "' (1 bytes): creating '" +
                             missing.string() + ".tmp-" + std::to_string(::getpid()) + "-";
    const std::string tail =
        "' failed: No such file or directory; check that the directory exists and is writable";
    REQUIRE(message.rfind(head, 0) == 0);
    REQUIRE(message.size() == head.size() + 8 + tail.size());  // 8 random hex digits
    REQUIRE(message.substr(head.size() + 8) == tail);
  }
}
