// Forward and full training step (AdamW: accel::optim::ChunkedAdamW, the Trainer's adamw_torch) tokens/s of
// an accel::llm causal LM with random weights, and the measured fp32 GEMM rate of this machine (the roofline
// of both). bench/llm/models_bench.py runs it interleaved with transformers on the same shape and prints
// BENCHMARKS.md's table ("Models").
//
//   bench_models --config config.json --mode forward|train|gemm [--seq 512] [--batch 1] [--steps 3]
//                [--warmup 1] [--threads 2] [--phases 1]
//
// Prints one line: `result mode=... tokens_per_s=... step_s=... cpu_s=... gflops=... peak_rss_mb=...` (cpu_s:
// the process's user + system CPU seconds per timed step). With --phases 1
// (train), also a line per phase of each step (`phase STEP NAME rss_mb=... peak_mb=...`: the resident MB at
// its end and the peak within it, /proc/self/status after resetting VmHWM through clear_refs) and one as each
// layer's down_proj and the embedding get their gradient: where the step's peak is, to compare with
// models_bench.py's same lines for transformers. --hold-logits 1 keeps the step's logits through backward.
// --profile FILE writes the timed steps' per-op self CPU times (op_recorder.hpp's JSON, summed over the
// steps).
#include <accel/llm/models/causal_lm.hpp>
#include <accel/optim/chunked_adamw.hpp>

#include <sys/resource.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <iostream>
#include <stdexcept>
#include <string>

#include "op_recorder.hpp"

namespace {

struct Args {
  std::string config, mode = "forward", profile;
  std::int64_t seq = 512, batch = 1, steps = 3, warmup = 1, threads = 2, phases = 0, hold_logits = 0;
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    if (i + 1 >= argc) throw std::invalid_argument(k + " needs a value");
    const std::string v = argv[++i];
    if (k == "--config") {
      a.config = v;
    } else if (k == "--mode") {
      a.mode = v;
    } else if (k == "--seq") {
      a.seq = std::stoll(v);
    } else if (k == "--batch") {
      a.batch = std::stoll(v);
    } else if (k == "--steps") {
      a.steps = std::stoll(v);
    } else if (k == "--warmup") {
      a.warmup = std::stoll(v);
    } else if (k == "--threads") {
      a.threads = std::stoll(v);
    } else if (k == "--phases") {
      a.phases = std::stoll(v);
    } else if (k == "--profile") {
      a.profile = v;
    } else if (k == "--hold-logits") {
      a.hold_logits = std::stoll(v);
    } else {
      throw std::invalid_argument("unknown flag " + k +
                                  "; use --config F --mode forward|train|gemm --seq N --batch B --steps S "
                                  "--warmup W --threads T --phases 0|1 --hold-logits 0|1 --profile FILE");
    }
  }
  return a;
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

double peak_rss_mb() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<double>(usage.ru_maxrss) / 1024.0;
}

// User + system CPU seconds of this process (all its threads).
double cpu_seconds() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  auto s = [](const timeval& t) {
    return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_usec) / 1e6;
  };
  return s(usage.ru_utime) + s(usage.ru_stime);
}

// VmRSS and VmHWM of this process in MB (/proc/self/status).
std::pair<double, double> rss_and_peak_mb() {
  std::ifstream status("/proc/self/status");
  double rss = 0, hwm = 0;
  for (std::string line; std::getline(status, line);) {
    if (line.rfind("VmRSS:", 0) == 0) rss = std::stod(line.substr(6)) / 1024.0;
    if (line.rfind("VmHWM:", 0) == 0) hwm = std::stod(line.substr(6)) / 1024.0;
  }
  return {rss, hwm};
}

// --phases: prints the resident and peak MB since the last mark, then resets the peak (clear_refs 5).
struct PhaseMarks {
  bool on = false;
  std::string step;
  double max_peak = 0;
  void mark(const std::string& name) {
    if (!on) return;
    const auto [rss, hwm] = rss_and_peak_mb();
    max_peak = std::max(max_peak, hwm);
    std::cout << "phase " << step << " " << name << " rss_mb=" << rss << " peak_mb=" << hwm << "\n";
    std::ofstream("/proc/self/clear_refs") << "5";
  }
};

// The fp32 GEMM rate on the model's largest projection shape ([tokens, hidden] x [hidden, intermediate]).
void gemm(const Args& a, const accel::llm::ModelConfig& c) {
  const auto x = torch::randn({a.batch * a.seq, c.hidden_size});
  const auto w = torch::randn({c.intermediate_size, c.hidden_size});
  for (int i = 0; i < 3; ++i)
    torch::linear(x, w);
  const int reps = 20;
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < reps; ++i)
    torch::linear(x, w);
  const double t = seconds_since(start) / reps;
  const double flops = 2.0 * static_cast<double>(x.size(0) * c.hidden_size * c.intermediate_size);
  std::cout << "result mode=gemm gflops=" << flops / t / 1e9 << " peak_rss_mb=" << peak_rss_mb() << std::endl;
}

}  // namespace

int main(int argc, char** argv) try {
  const Args a = parse(argc, argv);
  torch::set_num_threads(static_cast<int>(a.threads));
  const auto config = accel::llm::ModelConfig::from_file(a.config);
  if (a.mode == "gemm") {
    gemm(a, config);
    return 0;
  }
  torch::manual_seed(0);
  accel::llm::CausalLM model(config);
  const auto ids = torch::randint(0, config.vocab_size, {a.batch, a.seq}, torch::kInt64);
  const bool train = a.mode == "train";
  if (!train && a.mode != "forward") throw std::invalid_argument("--mode takes forward, train or gemm");
  // What the Trainer's `optim: adamw_torch` steps with: LibTorch's AdamW operator for operator (bitwise
  // equal) in cache-sized slices, as transformers' Trainer steps with PyTorch's single-tensor AdamW on CPU.
  accel::optim::ChunkedAdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-5));
  PhaseMarks marks;
  marks.on = train && a.phases != 0;
  if (marks.on) {
    for (const auto& item : model->named_parameters()) {
      const std::string name = item.key();
      if (name.find("down_proj") == std::string::npos && name.find("embed_tokens") == std::string::npos)
        continue;
      item.value().register_hook([&marks, name](const torch::Tensor& g) {
        marks.mark("grad:" + name);
        return g;
      });
    }
  }
  auto step = [&]() {
    if (train) {
      model->train();
      marks.mark("start");
      optimizer.zero_grad();
      marks.mark("zero_grad");
      auto logits = model->forward(ids);
      marks.mark("forward");
      auto loss = accel::llm::causal_lm_loss(logits, ids);
      // The logits are not needed by backward (log-softmax keeps its output): dropped before it, as
      // transformers' `model(ids, labels=ids).loss.backward()` drops its output's. --hold-logits 1 keeps them
      // through backward, as this program's one-expression step did (`causal_lm_loss(model->forward(ids),
      // ids).backward()`: a temporary lives until the end of its full expression).
      if (a.hold_logits == 0) logits.reset();
      marks.mark("loss");
      loss.backward();
      marks.mark("backward");
      optimizer.step();
      marks.mark("optimizer_step");
    } else {
      torch::NoGradGuard no_grad;
      model->eval();
      model->forward(ids);
    }
  };
  for (std::int64_t i = 0; i < a.warmup; ++i) {
    marks.step = "warmup" + std::to_string(i);
    step();
  }
  auto& recorder = accel_bench::OpRecorder::get();
  if (!a.profile.empty()) {
    recorder.install();
    recorder.on = true;
    recorder.phase = a.mode;
  }
  const double cpu_start = cpu_seconds();
  const auto start = std::chrono::steady_clock::now();
  for (std::int64_t i = 0; i < a.steps; ++i) {
    marks.step = "step" + std::to_string(i);
    step();
  }
  const double per_step = seconds_since(start) / static_cast<double>(a.steps);
  const double cpu_per_step = (cpu_seconds() - cpu_start) / static_cast<double>(a.steps);
  if (!a.profile.empty()) {
    recorder.remove();
    std::ofstream(a.profile) << recorder.json() << "\n";
  }
  std::cout << "result mode=" << a.mode << " tokens_per_s=" << static_cast<double>(a.batch * a.seq) / per_step
            << " step_s=" << per_step << " cpu_s=" << cpu_per_step
            << " peak_rss_mb=" << (marks.on ? marks.max_peak : peak_rss_mb()) << std::endl;
  return 0;
} catch (const std::exception& e) {
  std::cerr << "bench_models: " << e.what() << "\n";
  return 1;
}
