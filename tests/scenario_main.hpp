#pragma once
// The main of a multi-process test worker (dist_worker.cpp, pipeline_worker.cpp): the scenario named on the
// command line runs as the one Catch2 test case of the process, so a failed CHECK_MSG is reported by Catch2
// with file, line and message, and the rank exits non-zero. Include it in exactly one file per worker.

#include <catch2/catch.hpp>

#include <functional>
#include <iostream>
#include <string>

namespace worker {

/// The scenario run_scenario runs.
inline std::function<void()>& selected_scenario() {
  static std::function<void()> scenario;
  return scenario;
}

/// Runs `scenario` as the Catch2 test case below; returns the process's exit status.
inline int run_scenario(const char* argv0, const std::string& name, std::function<void()> scenario) {
  selected_scenario() = std::move(scenario);
  Catch::Session session;
  const char* catch_args[] = {argv0, "--use-colour", "no"};
  if (session.run(3, catch_args) > 0) {
    std::cerr << "scenario " << name << ": check(s) failed (Catch2's report above names each)" << std::endl;
    return 1;
  }
  std::cout << "scenario " << name << " passed" << std::endl;
  return 0;
}

}  // namespace worker

TEST_CASE("scenario") {
  try {
    worker::selected_scenario()();
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << std::endl;
    FAIL("the scenario threw: " << e.what());
  }
}
