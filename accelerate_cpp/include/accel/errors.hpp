#pragma once
/// \file errors.hpp
/// The one error hierarchy of accelerate-cpp. Library code throws; only `main` functions turn errors into
/// exit codes. Every message names the offending value (file, key, rank ...) and says how to fix it.

#include <stdexcept>
#include <string>

namespace accel {

/// Base of every error thrown by accelerate-cpp.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// A configuration file, key, value or environment variable is invalid.
/// `file()`, `line()` (1-based, 0 when unknown) and `key()` locate the problem; `what()` is the full message.
class ConfigError : public Error {
 public:
  explicit ConfigError(const std::string& message, std::string file = {}, int line = 0, std::string key = {})
      : Error(message), file_(std::move(file)), line_(line), key_(std::move(key)) {}
  const std::string& file() const noexcept { return file_; }
  int line() const noexcept { return line_; }
  const std::string& key() const noexcept { return key_; }

 private:
  std::string file_;
  int line_;
  std::string key_;
};

/// The library was called in a way that cannot work (wrong order, wrong argument).
class UsageError : public Error {
 public:
  using Error::Error;
};

/// A collective failed or ranks disagree (mismatched shapes, timeout, a peer died).
class DistributedError : public Error {
 public:
  using Error::Error;
};

/// accel-launch could not start or keep the ranks running.
class LaunchError : public Error {
 public:
  using Error::Error;
};

/// The selected backend or build does not support the requested operation.
class UnsupportedOperation : public Error {
 public:
  using Error::Error;
};

/// A checkpoint could not be written or read (missing file, corrupt header, incompatible content).
class CheckpointError : public Error {
 public:
  using Error::Error;
};

}  // namespace accel
