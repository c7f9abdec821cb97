// Forward and full training step (AdamW) tokens/s of an accel::llm causal LM with random weights, and the
// measured fp32 GEMM rate of this machine (the roofline of both). bench/llm/models_bench.py runs it
// interleaved with transformers on the same shape and prints BENCHMARKS.md's table ("Models").
//
//   bench_models --config config.json --mode forward|train|gemm [--seq 512] [--batch 1] [--steps 3]
//                [--warmup 1] [--threads 2]
//
// Prints one line: `result mode=... tokens_per_s=... step_s=... gflops=... peak_rss_mb=...`.
#include <accel/llm/models/causal_lm.hpp>

#include <sys/resource.h>
#include <torch/torch.h>

#include <chrono>
#include <iostream>
#include <stdexcept>
#include <string>

namespace {

struct Args {
  std::string config, mode = "forward";
  std::int64_t seq = 512, batch = 1, steps = 3, warmup = 1, threads = 2;
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
    } else {
      throw std::invalid_argument("unknown flag " + k +
                                  "; use --config F --mode forward|train|gemm --seq N --batch B --steps S "
                                  "--warmup W --threads T");
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
  torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-5));
  auto step = [&]() {
    if (train) {
      model->train();
      optimizer.zero_grad();
      accel::llm::causal_lm_loss(model->forward(ids), ids).backward();
      optimizer.step();
    } else {
      torch::NoGradGuard no_grad;
      model->eval();
      model->forward(ids);
    }
  };
  for (std::int64_t i = 0; i < a.warmup; ++i)
    step();
  const auto start = std::chrono::steady_clock::now();
  for (std::int64_t i = 0; i < a.steps; ++i)
    step();
  const double per_step = seconds_since(start) / static_cast<double>(a.steps);
  std::cout << "result mode=" << a.mode << " tokens_per_s=" << static_cast<double>(a.batch * a.seq) / per_step
            << " step_s=" << per_step << " peak_rss_mb=" << peak_rss_mb() << std::endl;
  return 0;
} catch (const std::exception& e) {
  std::cerr << "bench_models: " << e.what() << "\n";
  return 1;
}
