#pragma once
// The main of a multi-process test worker (dist_worker.cpp, pipeline_worker.cpp, tensor_parallel_worker.cpp).
// One launch runs a list of scenarios in the same process group (starting LibTorch processes is most of a
// multi-rank test's time): each scenario is its own Catch2 test case, named "<scenario> on <row>, <N>
// rank(s)", so a failed CHECK_MSG is reported by Catch2 with the scenario, backend row, rank count, file,
// line and message, and the rank exits non-zero at the end. A scenario that throws stops the rank at once
// (the other ranks may be inside a collective it will never join; the launcher then stops them), naming the
// scenario. Include it in exactly one file per worker.

#include <catch2/catch.hpp>

#include <cstdio>
#include <cstdlib>
#include <deque>
#include <functional>
#include <iostream>
#include <map>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace worker {

/// One scenario of a launch: its name in test reports and what it runs.
struct Scenario {
  std::string name;
  std::function<void()> run;
};

/// Splits "a,b,c" at the commas.
inline std::vector<std::string> split_list(const std::string& list, char sep = ',') {
  std::vector<std::string> out;
  std::stringstream ss(list);
  for (std::string item; std::getline(ss, item, sep);)
    if (!item.empty()) out.push_back(item);
  return out;
}

namespace detail {

inline std::string rank_label() {
  const char* ws = std::getenv("WORLD_SIZE");
  const std::string n = ws ? ws : "1";
  return n + (n == "1" ? " rank" : " ranks");
}

class ScenarioInvoker final : public Catch::ITestInvoker {
 public:
  explicit ScenarioInvoker(Scenario s) : s_(std::move(s)) {}
  void invoke() const override {
    ::setenv("ACCEL_TEST_SCENARIO", base_name().c_str(), 1);
    try {
      s_.run();
    } catch (const std::exception& e) {
      std::cout.flush();
      const std::string what = e.what();
      // A port accel-launch picked and another program took before rank 0 listened: the launcher starts the
      // ranks again on another port, so this attempt is no failure of the scenario (nor of the test, whose
      // output CTest reads for "check(s) failed").
      const bool port_taken = what.find("EADDRINUSE") != std::string::npos ||
                              what.find("ddress already in use") != std::string::npos;
      std::cerr << "error: scenario " << s_.name << " threw: " << what << "\nscenario " << s_.name
                << (port_taken
                        ? ": the rendezvous port was taken; accel-launch starts the ranks again on another "
                          "port when it picked the port"
                        : ": check(s) failed; the remaining scenarios of this launch did not run")
                << std::endl;
      std::_Exit(1);
    }
    std::cout << "scenario " << s_.name << " done" << std::endl;
  }

 private:
  std::string base_name() const { return s_.name.substr(0, s_.name.find(' ')); }
  Scenario s_;
};

}  // namespace detail

/// Runs `scenarios` in order as Catch2 test cases of this process; returns the process's exit status.
/// `row` names the backend row in the test case names ("" for none).
inline int run_scenarios(const char* argv0, std::vector<Scenario> scenarios, const std::string& row = "") {
  static std::deque<std::string> names;  // Catch2 keeps references to the names
  for (auto& s : scenarios) {
    s.name += (row.empty() ? "" : " on " + row) + ", " + detail::rank_label();
    names.push_back(s.name);
    Catch::AutoReg(new detail::ScenarioInvoker(s), Catch::SourceLineInfo(__FILE__, __LINE__), "",
                   Catch::NameAndTags(Catch::StringRef(names.back()), Catch::StringRef("")));
  }
  Catch::Session session;
  const char* catch_args[] = {argv0, "--use-colour", "no", "--order", "decl"};
  const int failed = session.run(5, catch_args);
  if (failed > 0) {
    std::cerr << "scenario(s) failed: check(s) failed in " << failed
              << " scenario(s) (Catch2's report above names each)" << std::endl;
    return 1;
  }
  std::cout << "scenario(s) passed: " << scenarios.size() << std::endl;
  return 0;
}

/// The common command line `worker <scenario>[,<scenario>...] [row]`: every named scenario of `known` runs,
/// in the given order. Returns 2 with `usage` printed when a name is unknown.
inline int run_named(int argc, char** argv, const std::map<std::string, std::function<void()>>& known,
                     const std::string& usage, const std::string& row = "") {
  if (argc < 2) {
    std::cerr << usage << std::endl;
    return 2;
  }
  std::vector<Scenario> list;
  for (const auto& name : split_list(argv[1])) {
    const auto it = known.find(name);
    if (it == known.end()) {
      std::cerr << "unknown scenario '" << name << "'\n" << usage << std::endl;
      return 2;
    }
    list.push_back({name, it->second});
  }
  return run_scenarios(argv[0], std::move(list), row);
}

}  // namespace worker
