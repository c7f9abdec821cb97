// A self-time recorder of ATen ops and autograd nodes (RecordFunction callbacks) on the calling thread, in
// thread CPU time (CLOCK_THREAD_CPUTIME_ID: what others' load on the machine does not inflate), summed per
// (phase, op name, input shapes). profile_step.cpp uses it in our training step; op_recorder_lib.cpp exports
// it to Python (ctypes) so that transformers' step is measured by the same code (bench/llm/profile_step.py).
#pragma once

#include <ATen/record_function.h>
#include <time.h>

#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

namespace accel_bench {

inline double thread_cpu_us() {
  timespec t{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) * 1e6 + static_cast<double>(t.tv_nsec) / 1e3;
}

struct OpRecorder {
  struct Frame {
    std::string name, shapes;
    double start = 0, child_us = 0;
  };
  bool on = false;
  std::string phase = "other";
  std::vector<Frame> stack;
  std::map<std::tuple<std::string, std::string, std::string>, std::pair<double, std::int64_t>> sums;
  at::CallbackHandle handle = 0;

  static OpRecorder& get() {
    static OpRecorder r;
    return r;
  }

  static std::string shapes_of(const at::RecordFunction& fn) {
    std::ostringstream s;
    s << "[";
    bool first = true;
    for (const auto& v : fn.inputs()) {
      s << (first ? "" : ", ");
      first = false;
      if (v.isTensor() && v.toTensor().defined()) {
        const auto sizes = v.toTensor().sizes();
        s << "[";
        for (std::size_t i = 0; i < sizes.size(); ++i)
          s << (i ? ", " : "") << sizes[i];
        s << "]";
      } else {
        s << "[]";
      }
    }
    s << "]";
    return s.str();
  }

  static std::unique_ptr<at::ObserverContext> enter(const at::RecordFunction& fn) {
    auto& r = get();
    if (r.on) r.stack.push_back({fn.name(), shapes_of(fn), thread_cpu_us(), 0});
    return nullptr;
  }

  static void leave(const at::RecordFunction& fn, at::ObserverContext* /*ctx*/) {
    auto& r = get();
    if (!r.on || r.stack.empty() || r.stack.back().name != fn.name()) return;
    const auto f = r.stack.back();
    r.stack.pop_back();
    const double us = thread_cpu_us() - f.start;
    if (!r.stack.empty()) r.stack.back().child_us += us;
    auto& sum = r.sums[{r.phase, f.name, f.shapes}];
    sum.first += us - f.child_us;
    sum.second += 1;
  }

  void install() {
    if (handle == 0)
      handle = at::addGlobalCallback(at::RecordFunctionCallback(enter, leave).needsInputs(true));
  }

  void remove() {
    if (handle != 0) at::removeCallback(handle);
    handle = 0;
    on = false;
  }

  // {"phase", "name", "shapes", "self_us", "count"} per key, as a JSON list.
  std::string json() const {
    std::ostringstream out;
    out << "[\n";
    bool first = true;
    for (const auto& [key, sum] : sums) {
      std::string name;
      for (char c : std::get<1>(key)) {
        if (c == '"' || c == '\\') name += '\\';
        name += c;
      }
      out << (first ? "" : ",\n") << "{\"phase\": \"" << std::get<0>(key) << "\", \"name\": \"" << name
          << "\", \"shapes\": \"" << std::get<2>(key) << "\", \"self_us\": " << sum.first
          << ", \"count\": " << sum.second << "}";
      first = false;
    }
    out << "\n]";
    return out.str();
  }
};

}  // namespace accel_bench
