// op_recorder.hpp for Python (ctypes, after `import torch`, so that the callbacks join the process's
// libtorch): profile_step.py measures transformers' step with the same recorder as ours.
#include <cstring>
#include <fstream>

#include "op_recorder.hpp"

extern "C" {

/// Installs the callbacks and starts recording (sums kept across calls until op_recorder_write).
void op_recorder_start() {
  auto& r = accel_bench::OpRecorder::get();
  r.install();
  r.on = true;
}

/// The phase the following ops are summed under ("forward", "backward", "optimizer", ...).
void op_recorder_phase(const char* phase) {
  accel_bench::OpRecorder::get().phase = phase;
}

/// Stops recording and removes the callbacks.
void op_recorder_stop() {
  accel_bench::OpRecorder::get().remove();
}

/// Writes the sums (a JSON list) to `path`; returns 0, or 1 when the file cannot be written.
int op_recorder_write(const char* path) {
  std::ofstream out(path);
  out << accel_bench::OpRecorder::get().json() << "\n";
  return out ? 0 : 1;
}
}
