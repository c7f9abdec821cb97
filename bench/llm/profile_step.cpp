// One LoRA training step of an accel::llm model, profiled op by op (issue 51, "Performance and memory"): what
// each rank of bench/llm/finetune_bench.py's LoRA row does (one row of SEQ tokens, one thread, LoRA r 8 alpha
// 16 on q_proj and v_proj, the recipe's fused linear + cross-entropy loss, grad-norm clipping, AdamW), with
// every ATen op and autograd node timed in thread CPU time by op_recorder.hpp's RecordFunction callbacks.
// bench/llm/profile_step.py runs it beside transformers + PEFT (timed by the same recorder) and prints the
// per-op-class table.
//
//   profile_step --model DIR [--seq 512] [--warmup 1] [--steps 2] --out ops.json
//
// Writes a JSON list of {"phase", "name", "shapes", "self_us", "count"} per (phase, op name, input shapes),
// summed over the measured steps (self time: the op's CPU time minus that of the ops recorded inside it), and
// prints `result step_s=... cpu_s=...` (wall and process CPU seconds per measured step, profiled).
#include <accel/llm/models/causal_lm.hpp>
#include <accel/llm/training/fused_linear_cross_entropy.hpp>
#include <accel/nn/lora.hpp>
#include <accel/optim/chunked_adamw.hpp>

#include <ATen/Parallel.h>
#include <sys/resource.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "op_recorder.hpp"

namespace {

struct Args {
  std::string model, out;
  std::int64_t seq = 512, warmup = 1, steps = 2;
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    if (i + 1 >= argc) throw std::invalid_argument(k + " needs a value");
    const std::string v = argv[++i];
    if (k == "--model")
      a.model = v;
    else if (k == "--out")
      a.out = v;
    else if (k == "--seq")
      a.seq = std::stoll(v);
    else if (k == "--warmup")
      a.warmup = std::stoll(v);
    else if (k == "--steps")
      a.steps = std::stoll(v);
    else
      throw std::invalid_argument("unknown option " + k +
                                  "; use --model DIR --out FILE [--seq --warmup --steps]");
  }
  if (a.model.empty() || a.out.empty())
    throw std::invalid_argument("--model DIR and --out FILE are required");
  return a;
}

double cpu_seconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
         static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec) / 1e6;
}

}  // namespace

int main(int argc, char** argv) try {
  const Args a = parse(argc, argv);
  at::set_num_threads(1);
  torch::manual_seed(0);
  auto model = accel::llm::from_pretrained(a.model, accel::llm::LoadOptions().dtype(torch::kFloat32));
  accel::peft::LoraConfig c;
  c.r = 8;
  c.lora_alpha = 16;
  c.target_modules = {"q_proj", "v_proj"};
  auto lora = accel::peft::get_peft_model(model.ptr(), c);
  model->train();
  std::vector<torch::Tensor> trainable;
  for (const auto& p : model->parameters())
    if (p.requires_grad()) trainable.push_back(p);
  accel::optim::ChunkedAdamW opt(trainable, torch::optim::AdamWOptions(1e-4).weight_decay(0));
  const auto vocab = model->config().vocab_size;
  const auto ids = torch::randint(vocab, {1, a.seq}, torch::kInt64);
  auto& r = accel_bench::OpRecorder::get();
  auto one_step = [&] {
    r.phase = "forward";
    const auto hidden = model->model->forward(ids);
    r.phase = "loss";
    const auto loss = accel::llm::fused_linear_cross_entropy(hidden, model->model->embed_tokens->weight, ids,
                                                             /*num_items_in_batch=*/a.seq - 1);
    r.phase = "backward";
    loss.backward();
    r.phase = "optimizer";
    torch::nn::utils::clip_grad_norm_(trainable, 1.0);
    opt.step();
    opt.zero_grad(true);
    r.phase = "other";
  };
  r.install();
  for (std::int64_t i = 0; i < a.warmup; ++i)
    one_step();
  r.on = true;
  const double cpu0 = cpu_seconds();
  const auto t0 = std::chrono::steady_clock::now();
  for (std::int64_t i = 0; i < a.steps; ++i)
    one_step();
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const double cpu = cpu_seconds() - cpu0;
  r.remove();
  std::ofstream out(a.out);
  out << "{\"side\": \"ours\", \"steps\": " << a.steps << ", \"seq\": " << a.seq
      << ", \"step_s\": " << wall / static_cast<double>(a.steps)
      << ", \"cpu_s\": " << cpu / static_cast<double>(a.steps) << ", \"ops\": ";
  out << r.json() << "}\n";
  std::printf("result step_s=%.3f cpu_s=%.3f\n", wall / static_cast<double>(a.steps),
              cpu / static_cast<double>(a.steps));
  return 0;
} catch (const std::exception& e) {
  std::cerr << "profile_step: " << e.what() << std::endl;
  return 1;
}
