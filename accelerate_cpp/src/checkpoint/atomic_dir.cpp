#include "checkpoint/atomic_dir.hpp"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <random>
#include <system_error>
#include <vector>

#include "accel/errors.hpp"

#include <fmt/format.h>

namespace accel::detail {
namespace fs = std::filesystem;

namespace {

std::string errno_text(int error) {
  return std::strerror(error);
}

fs::path parent_of(const fs::path& path) {
  fs::path parent = path.parent_path();
  return parent.empty() ? fs::path(".") : parent;
}

// The longest name the file system holding `path` (or its nearest existing ancestor) allows, in bytes.
long name_max(const fs::path& path) {
  std::error_code ec;
  fs::path probe = path;
  while (!probe.empty() && !fs::exists(probe, ec) && probe != probe.parent_path())
    probe = probe.parent_path();
  if (probe.empty()) probe = ".";
  const long limit = ::pathconf(probe.c_str(), _PC_NAME_MAX);
  return limit > 0 ? limit : 255;
}

}  // namespace

fs::path normalize_checkpoint_dir(const std::string& dir) {
  fs::path path = fs::path(dir).lexically_normal();
  if (!path.empty() && path.filename().empty()) path = path.parent_path();
  const std::string name = path.filename().string();
  if (path.empty() || name.empty() || name == "." || name == ".." || path == path.root_path()) {
    throw CheckpointError(
        "invalid checkpoint directory '" + dir +
        "': it must name a directory below an existing or creatable parent, e.g. 'ckpt/step_100'");
  }
  // The temporary and old siblings (`<name>.tmp-<pid>-<8 hex>`, `<name>.old-<pid>`) are longer than the name:
  // say so here, instead of the file system's "File name too long" blamed on permissions or disk space.
  const long limit = name_max(parent_of(path));
  const auto longest = static_cast<long>(name.size() + kSiblingSuffixBytes);
  if (longest > limit) {
    throw CheckpointError(fmt::format(
        "checkpoint directory name '{}' is {} bytes; a checkpoint is written into a temporary sibling whose "
        "name adds up to {} bytes ('.tmp-<pid>-<8 hex digits>'), and this file system allows {} bytes per "
        "name: use a name of at most {} bytes",
        name, name.size(), kSiblingSuffixBytes, limit, limit - static_cast<long>(kSiblingSuffixBytes)));
  }
  return path;
}

namespace {

fs::path normalize(const std::string& dir) {
  return normalize_checkpoint_dir(dir);
}

fs::path with_suffix(const fs::path& path, const std::string& suffix) {
  return fs::path(path.string() + suffix);
}

std::string random_hex() {
  std::random_device device;
  char text[9];
  std::snprintf(text, sizeof text, "%08x", static_cast<unsigned>(device()));
  return text;
}

bool all_digits(const std::string& text) {
  if (text.empty()) return false;
  for (const char c : text) {
    if (c < '0' || c > '9') return false;
  }
  return true;
}

bool process_alive(long pid) {
  if (pid <= 0) return false;
  return ::kill(static_cast<pid_t>(pid), 0) == 0 || errno == EPERM;
}

// fsync a file or directory. Some filesystems cannot fsync directories (EINVAL): that is not an error.
void fsync_path(const fs::path& path, bool directory, const std::string& context) {
  const int fd = ::open(path.c_str(), (directory ? O_RDONLY | O_DIRECTORY : O_RDONLY) | O_CLOEXEC);
  if (fd < 0) {
    const int error = errno;
    throw CheckpointError(context + ": cannot open '" + path.string() +
                          "' to fsync it: " + errno_text(error));
  }
  int rc;
  do {
    rc = ::fsync(fd);
  } while (rc != 0 && errno == EINTR);
  const int error = errno;
  ::close(fd);
  if (rc != 0 && !(directory && (error == EINVAL || error == EROFS))) {
    throw CheckpointError(context + ": fsync of '" + path.string() + "' failed: " + errno_text(error) +
                          "; check free disk space and the health of the filesystem");
  }
}

struct Siblings {
  std::vector<fs::path> old;                    // <dir>.old-<pid>
  std::vector<std::pair<fs::path, long>> temp;  // <dir>.tmp-<pid>-<hex>
};

Siblings find_siblings(const fs::path& dir) {
  Siblings out;
  const fs::path parent = parent_of(dir);
  std::error_code ec;
  if (!fs::is_directory(parent, ec)) return out;
  const std::string old_prefix = dir.filename().string() + ".old-";
  const std::string temp_prefix = dir.filename().string() + ".tmp-";
  for (fs::directory_iterator it(parent, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.compare(0, old_prefix.size(), old_prefix) == 0 && all_digits(name.substr(old_prefix.size()))) {
      out.old.push_back(it->path());
    } else if (name.compare(0, temp_prefix.size(), temp_prefix) == 0) {
      const std::string rest = name.substr(temp_prefix.size());
      const auto dash = rest.find('-');
      if (dash != std::string::npos && dash <= 9 && all_digits(rest.substr(0, dash)) &&
          dash + 1 < rest.size()) {
        out.temp.emplace_back(it->path(), std::stol(rest.substr(0, dash)));
      }
    }
  }
  if (ec) {
    throw CheckpointError("cannot list '" + parent.string() + "' to check checkpoint '" + dir.string() +
                          "': " + ec.message());
  }
  return out;
}

// `<name>.tmp-<pid>-<8 hex digits>` (the temporary names AtomicDirectory and write_file_atomic make): the
// pid, or -1 for any other name.
long temporary_owner(const std::string& name) {
  const auto at = name.rfind(".tmp-");
  if (at == std::string::npos || at == 0) return -1;
  const std::string rest = name.substr(at + 5);
  const auto dash = rest.find('-');
  if (dash == std::string::npos || dash == 0 || dash > 9 || !all_digits(rest.substr(0, dash))) return -1;
  const std::string hex = rest.substr(dash + 1);
  if (hex.size() != 8 || hex.find_first_not_of("0123456789abcdef") != std::string::npos) return -1;
  return std::stol(rest.substr(0, dash));
}

// Temporary directories of dead processes beside `dir`, whatever checkpoint they were for: a run killed while
// saving `checkpoint-500` that resumes and never saves that name again would otherwise keep the unfinished
// copy (as large as a checkpoint) for ever. Only directories named exactly as AtomicDirectory names them.
void remove_dead_temporaries(const fs::path& parent) {
  std::error_code ec;
  if (!fs::is_directory(parent, ec)) return;
  std::vector<fs::path> dead;
  for (fs::directory_iterator it(parent, ec), end; !ec && it != end; it.increment(ec)) {
    const long pid = temporary_owner(it->path().filename().string());
    std::error_code type_ec;
    if (pid > 0 && fs::is_directory(it->symlink_status(type_ec)) && !type_ec && !process_alive(pid))
      dead.push_back(it->path());
  }
  for (const auto& d : dead)
    fs::remove_all(d, ec);
}

}  // namespace

// ---------------------------------------------------------------------------------------------------------------

void recover_interrupted(const std::string& dir) {
  const fs::path final_path = normalize(dir);
  const Siblings siblings = find_siblings(final_path);
  std::error_code ec;

  // Temporary directories of dead processes are unfinished checkpoints: never read, safe to delete (this
  // checkpoint's and, beside it, those of other checkpoints a killed run left).
  for (const auto& [temp, pid] : siblings.temp) {
    if (!process_alive(pid)) fs::remove_all(temp, ec);
  }
  remove_dead_temporaries(parent_of(final_path));

  const bool final_exists = fs::exists(fs::symlink_status(final_path, ec));
  if (final_exists) {
    // Crash after the new directory was in place: the old one is garbage.
    for (const auto& old : siblings.old)
      fs::remove_all(old, ec);
    return;
  }
  if (siblings.old.empty()) return;
  if (siblings.old.size() > 1) {
    std::string names;
    for (const auto& old : siblings.old)
      names += (names.empty() ? "'" : ", '") + old.string() + "'";
    throw CheckpointError("checkpoint directory '" + final_path.string() +
                          "' is missing and several earlier versions exist (" + names +
                          "); rename the one to keep to '" + final_path.string() + "' and delete the others");
  }
  // Crash between the two renames of a commit: the previous checkpoint is complete, put it back.
  fs::rename(siblings.old.front(), final_path, ec);
  if (ec) {
    throw CheckpointError("cannot restore checkpoint directory '" + final_path.string() + "' from '" +
                          siblings.old.front().string() + "': " + ec.message() + "; rename it by hand");
  }
  fsync_path(parent_of(final_path), true,
             "cannot restore checkpoint directory '" + final_path.string() + "'");
}

AtomicDirectory::AtomicDirectory(const std::string& dir) : final_(normalize(dir)) {
  recover_interrupted(final_.string());
  const std::string context = "cannot create checkpoint directory '" + final_.string() + "'";
  std::error_code ec;
  fs::create_directories(parent_of(final_), ec);
  if (ec)
    throw CheckpointError(context + ": creating its parent failed: " + ec.message() + "; check permissions");
  const std::string prefix = ".tmp-" + std::to_string(::getpid()) + "-";
  for (int attempt = 0; attempt < 16; ++attempt) {
    const fs::path candidate = with_suffix(final_, prefix + random_hex());
    if (fs::create_directory(candidate, ec)) {
      temp_ = candidate;
      return;
    }
    if (ec) {
      throw CheckpointError(context + ": creating '" + candidate.string() + "' failed: " + ec.message() +
                            "; check permissions and free disk space");
    }
  }
  throw CheckpointError(context + ": could not find an unused temporary name next to it");
}

AtomicDirectory::~AtomicDirectory() {
  if (committed_ || temp_.empty()) return;
  std::error_code ec;
  fs::remove_all(temp_, ec);
}

void AtomicDirectory::commit() {
  if (committed_) {
    throw UsageError("AtomicDirectory::commit() called twice for '" + final_.string() + "'");
  }
  const std::string context = "cannot save checkpoint directory '" + final_.string() + "'";

  // 1. Everything under temp_ durable before it becomes visible under the final name.
  std::error_code ec;
  for (fs::recursive_directory_iterator it(temp_, ec), end; !ec && it != end; it.increment(ec)) {
    const fs::file_status status = it->symlink_status(ec);
    if (ec) break;
    if (fs::is_regular_file(status)) fsync_path(it->path(), false, context);
    if (fs::is_directory(status)) fsync_path(it->path(), true, context);
  }
  if (ec) throw CheckpointError(context + ": listing '" + temp_.string() + "' failed: " + ec.message());
  fsync_path(temp_, true, context);

  // 2. A non-empty directory cannot be renamed over another, hence two renames; recover_interrupted
  //    repairs a crash between them.
  const fs::path parent = parent_of(final_);
  fs::path old;
  if (fs::exists(fs::symlink_status(final_, ec))) {
    old = with_suffix(final_, ".old-" + std::to_string(::getpid()));
    fs::remove_all(old, ec);
    fs::rename(final_, old, ec);
    if (ec) {
      throw CheckpointError(context + ": moving the previous checkpoint to '" + old.string() +
                            "' failed: " + ec.message() + "; check permissions on '" + parent.string() + "'");
    }
  }
  fs::rename(temp_, final_, ec);
  if (ec) {
    std::error_code ignored;
    if (!old.empty()) fs::rename(old, final_, ignored);
    throw CheckpointError(context + ": renaming '" + temp_.string() + "' to it failed: " + ec.message() +
                          "; the previous checkpoint is unchanged");
  }
  committed_ = true;
  fsync_path(parent, true, context);

  // 3. The new checkpoint is durable; the old one is garbage (recover_interrupted removes it if this fails).
  if (!old.empty()) {
    fs::remove_all(old, ec);
    try {
      fsync_path(parent, true, context);
    } catch (const CheckpointError&) {
      // Only the removal of garbage is at stake.
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------

void write_file_atomic(const std::string& path, std::string_view bytes) {
  const std::string context =
      "cannot write checkpoint file '" + path + "' (" + std::to_string(bytes.size()) + " bytes)";
  const fs::path target(path);
  if (target.filename().empty()) throw CheckpointError(context + ": the path names a directory, not a file");
  const fs::path temp = with_suffix(target, ".tmp-" + std::to_string(::getpid()) + "-" + random_hex());

  const int fd = ::open(temp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
  if (fd < 0) {
    const int error = errno;
    throw CheckpointError(context + ": creating '" + temp.string() + "' failed: " + errno_text(error) +
                          "; check that the directory exists and is writable");
  }
  auto fail = [&](const std::string& step, int error, bool close_fd) {
    if (close_fd) ::close(fd);
    ::unlink(temp.c_str());
    throw CheckpointError(context + ": " + step + " failed: " + errno_text(error) +
                          "; check free disk space");
  };
  const char* data = bytes.data();
  std::size_t left = bytes.size();
  while (left > 0) {
    const ssize_t written = ::write(fd, data, left);
    if (written < 0) {
      if (errno == EINTR) continue;
      fail("write", errno, true);
    }
    data += written;
    left -= static_cast<std::size_t>(written);
  }
  int rc;
  do {
    rc = ::fsync(fd);
  } while (rc != 0 && errno == EINTR);
  if (rc != 0) fail("fsync", errno, true);
  if (::close(fd) != 0) fail("close", errno, false);
  if (::rename(temp.c_str(), target.c_str()) != 0) fail("rename of '" + temp.string() + "'", errno, false);
  fsync_path(parent_of(target), true, context);
}

}  // namespace accel::detail
