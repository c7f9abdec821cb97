#include "config/small_file.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string>

namespace accel::config_detail {

namespace {

// Closes the descriptor at scope exit.
struct Fd {
  int fd = -1;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

}  // namespace

std::optional<std::pair<int, std::string>> encoding_problem(const std::string& text) {
  if (text.rfind("\xFF\xFE", 0) == 0 || text.rfind("\xFE\xFF", 0) == 0)
    return std::make_pair(1,
                          std::string("the file is UTF-16 encoded (it starts with a UTF-16 byte order mark); "
                                      "save it as UTF-8 text"));
  const auto nul = text.find('\0');
  if (nul == std::string::npos) return std::nullopt;
  const int line =
      1 + static_cast<int>(std::count(text.begin(), text.begin() + static_cast<std::ptrdiff_t>(nul), '\n'));
  return std::make_pair(line,
                        "the file holds a NUL byte (byte " + std::to_string(nul) +
                            "): a config file is UTF-8 text, and this one is UTF-16 or binary; save it as "
                            "UTF-8 text");
}

SmallFile read_small_file(const std::string& path, std::size_t max_bytes) {
  SmallFile out;
  // Non-blocking open: opening a FIFO for reading otherwise waits for a writer, for ever if none comes.
  Fd f{::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC)};
  if (f.fd < 0) {
    out.error = std::strerror(errno);
    return out;
  }
  struct stat st {};
  if (::fstat(f.fd, &st) != 0) {
    out.error = std::strerror(errno);
    return out;
  }
  if (S_ISDIR(st.st_mode)) {
    out.error = "it is a directory";
    return out;
  }
  // The buffer grows as it fills, up to the bound plus one byte (which tells a file over the bound): a config
  // file is a few kilobytes, and zeroing the whole bound (16 MiB) for every read cost ~2 ms a read (13 s of
  // the parser fuzzer's 7,500 reads).
  const std::size_t cap = max_bytes + 1;
  const std::size_t hint =
      S_ISREG(st.st_mode) && st.st_size > 0 ? static_cast<std::size_t>(st.st_size) + 1 : 0;
  std::string text(std::min(cap, std::max(hint, std::size_t{64} << 10)), '\0');
  std::size_t got = 0;
  if (S_ISFIFO(st.st_mode)) {
    // With no writer, a non-blocking read of an empty FIFO returns 0 (end of file); with a writer that has
    // not written yet, EAGAIN. Only the second may wait. An anonymous pipe (`<(cmd)`, /dev/fd/N) at its end
    // at once is an empty file; a named FIFO nobody writes to is a mistake worth naming.
    const ssize_t n = ::read(f.fd, text.data(), text.size());
    if (n == 0) {
      char target[64] = {};
      const std::string self = "/proc/self/fd/" + std::to_string(f.fd);
      const ssize_t len = ::readlink(self.c_str(), target, sizeof target - 1);
      if (len > 0 && std::string(target, static_cast<std::size_t>(len)).rfind("pipe:", 0) == 0) return out;
      out.error = "it is a FIFO (named pipe) that no process writes to; pass the file itself";
      return out;
    }
    if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK) {
      out.error = std::strerror(errno);
      return out;
    }
    got = n > 0 ? static_cast<std::size_t>(n) : 0;
  }
  // From here on a plain blocking read to the end (or the bound).
  const int flags = ::fcntl(f.fd, F_GETFL);
  if (flags >= 0) ::fcntl(f.fd, F_SETFL, flags & ~O_NONBLOCK);
  for (;;) {
    if (got == text.size()) {
      if (text.size() == cap) break;
      text.resize(std::min(cap, 2 * text.size()));
    }
    const ssize_t n = ::read(f.fd, text.data() + got, text.size() - got);
    if (n == 0) break;
    if (n < 0) {
      if (errno == EINTR) continue;
      out.error = std::strerror(errno);
      return out;
    }
    got += static_cast<std::size_t>(n);
  }
  if (got > max_bytes) {
    out.too_large = true;
    return out;
  }
  text.resize(got);
  out.text = std::move(text);
  return out;
}

}  // namespace accel::config_detail
