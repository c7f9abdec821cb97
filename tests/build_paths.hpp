// Where this checkout and its build are, for tests that read files of the source tree or run a program of the
// build. Defined in a file CMake generates (build_paths.cpp in the build's tests/ folder) rather than passed
// as compile definitions: a definition holding an absolute path makes every file of its target a
// compiler-cache miss in a clone at another path (CI clones afresh), the LibTorch-heavy ones included.
#pragma once

#include <string>

namespace accel::test {

/// tests/fixtures of the source tree.
const std::string& test_data_dir();
/// tests/ of the source tree.
const std::string& tests_dir();
/// config_templates/ of the source tree.
const std::string& config_template_dir();
/// The venv's Python configured as ACCEL_PYTHON ("" when none was).
const std::string& python();
/// The accel-launch program of this build.
const std::string& launch_bin();

}  // namespace accel::test
