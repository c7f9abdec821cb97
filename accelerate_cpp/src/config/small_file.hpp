#pragma once
// Reading a small text file a user names (an Accelerate YAML, a DeepSpeed JSON, TrainingArguments): bounded,
// and never blocked on a pipe nobody writes to.

#include <cstddef>
#include <optional>
#include <string>
#include <utility>

namespace accel::config_detail {

/// The text of a small file, or why it could not be read.
struct SmallFile {
  std::string text;
  /// "" when read; else why not, as a phrase ("No such file or directory", "it is a directory", ...).
  std::string error;
  /// The file holds more than the bound (the text is not returned).
  bool too_large = false;
};

/// Reads the whole of `path`, at most `max_bytes` (one more byte makes it too_large, so /dev/zero ends). A
/// directory is an error; so is a FIFO no process holds open for writing (it would block for ever: a named
/// pipe given by mistake), while a pipe with a writer (`--config_file <(cat x.yaml)`) is read to its end.
SmallFile read_small_file(const std::string& path, std::size_t max_bytes);

/// Why `text` is not UTF-8 text a config reader may hand to yaml-cpp (which decodes a NUL byte near the start
/// as UTF-16 and reads such a file as empty, without a word): a UTF-16 byte order mark or a NUL byte, as the
/// 1-based line and a phrase that says what to do; nullopt when it is fine.
std::optional<std::pair<int, std::string>> encoding_problem(const std::string& text);

}  // namespace accel::config_detail
