#pragma once
// A fresh directory for one test, removed with everything in it at scope exit. Torch-free: the unit tests use
// it as well as the LibTorch ones (test_support.hpp) and the fuzzers (fault/fuzz_support.hpp).

#include <stdlib.h>  // mkdtemp

#include <filesystem>
#include <stdexcept>
#include <string>
#include <system_error>

namespace accel::test {

struct TempDir {
  TempDir() {
    std::string pattern = (std::filesystem::temp_directory_path() / "accel-test-XXXXXX").string();
    if (::mkdtemp(pattern.data()) == nullptr) throw std::runtime_error("mkdtemp failed for " + pattern);
    path = pattern;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  /// The path of `name` in the directory.
  std::string file(const std::string& name) const { return (path / name).string(); }

  std::filesystem::path path;
};

}  // namespace accel::test
