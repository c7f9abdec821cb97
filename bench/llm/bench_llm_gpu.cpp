// The LLM path on one device (issue 53): training-step tokens/s, MFU and peak memory of an accel::llm model
// loaded from a checkpoint directory (full fine-tuning, LoRA, QLoRA), and its logits for the equality checks.
// bench/llm/llm_gpu_bench.py runs it interleaved with transformers + PEFT on the same device and the same
// checkpoint, and prints BENCHMARKS.md's rows.
//
//   bench_llm_gpu --model DIR --mode full|lora|qlora --device cuda --dtype bf16 --seq 2048 [--batch 1]
//                 [--steps 5] [--warmup 2] [--lora_r 8] [--targets q_proj,v_proj] [--checkpointing 0|1]
//   bench_llm_gpu --model DIR --mode logits --device cuda --dtype fp32 --ids 1,2,3 --out logits.safetensors
//
// Prints `result mode=... tokens_per_s=... step_s=... peak_gb=... tflops=...` (training) or writes the logits
// (float32, [1, T, vocab]) to --out. FLOPs per step: 6 N T (full) or 4 N T (adapters: no weight gradients of
// the frozen base) for the N parameters of the blocks and the head, plus attention's 12 L T^2 d (half of it
// causal), the same formula the Python side uses.
#include <accel/checkpoint/safetensors.hpp>
#include <accel/llm/models/causal_lm.hpp>
#include <accel/nn/lora.hpp>

#include <torch/torch.h>
#ifdef ACCEL_BENCH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

#include <chrono>
#include <cstdio>
#include <iostream>
#include <sstream>
#include <stdexcept>
#include <string>

namespace {

struct Args {
  std::string model, mode = "lora", device = "cuda", dtype = "bf16", ids, out, targets = "q_proj,v_proj";
  std::int64_t seq = 2048, batch = 1, steps = 5, warmup = 2, lora_r = 8;
  bool checkpointing = false;
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    if (i + 1 >= argc) throw std::invalid_argument(k + " needs a value");
    const std::string v = argv[++i];
    if (k == "--model")
      a.model = v;
    else if (k == "--mode")
      a.mode = v;
    else if (k == "--device")
      a.device = v;
    else if (k == "--dtype")
      a.dtype = v;
    else if (k == "--ids")
      a.ids = v;
    else if (k == "--out")
      a.out = v;
    else if (k == "--targets")
      a.targets = v;
    else if (k == "--seq")
      a.seq = std::stoll(v);
    else if (k == "--batch")
      a.batch = std::stoll(v);
    else if (k == "--steps")
      a.steps = std::stoll(v);
    else if (k == "--warmup")
      a.warmup = std::stoll(v);
    else if (k == "--lora_r")
      a.lora_r = std::stoll(v);
    else if (k == "--checkpointing")
      a.checkpointing = v == "1";
    else
      throw std::invalid_argument("unknown option " + k);
  }
  if (a.model.empty()) throw std::invalid_argument("--model DIR is required");
  return a;
}

std::vector<std::string> split(const std::string& text) {
  std::vector<std::string> out;
  std::stringstream in(text);
  for (std::string item; std::getline(in, item, ',');)
    if (!item.empty()) out.push_back(item);
  return out;
}

void synchronize(const torch::Device& device) {
  if (device.is_cuda()) torch::cuda::synchronize();
}

double peak_gb(const torch::Device& device) {
#ifdef ACCEL_BENCH_CUDA
  if (device.is_cuda()) {
    const auto stats =
        c10::cuda::CUDACachingAllocator::getDeviceStats(device.index() < 0 ? 0 : device.index());
    return static_cast<double>(
               stats.allocated_bytes[static_cast<std::size_t>(c10::CachingAllocator::StatType::AGGREGATE)]
                   .peak) /
           1e9;
  }
#endif
  return 0.0;
}

accel::llm::CausalLM load(const Args& a, const torch::Device& device) {
  accel::llm::LoadOptions options;
  options.dtype(a.dtype == "bf16" ? torch::kBFloat16 : torch::kFloat32).device(device);
  if (a.mode == "qlora") options.load_in_4bit();
  return accel::llm::from_pretrained(a.model, options);
}

void write_logits(const Args& a, const torch::Device& device) {
  auto model = load(a, device);
  model->eval();
  std::vector<std::int64_t> ids;
  for (const auto& s : split(a.ids))
    ids.push_back(std::stoll(s));
  torch::NoGradGuard no_grad;
  const auto input = torch::tensor(ids, torch::kInt64).view({1, -1}).to(device);
  const auto logits = model->forward(input).to(torch::kFloat32).cpu().contiguous();
  accel::safetensors::TensorView view;
  view.name = "logits";
  view.dtype = accel::safetensors::DType::F32;
  view.shape = logits.sizes().vec();
  view.data = logits.data_ptr();
  view.nbytes = static_cast<std::size_t>(logits.numel()) * sizeof(float);
  accel::safetensors::write_file(a.out, {view});
  std::printf("logits written: %s [1, %lld, %lld]\n", a.out.c_str(), static_cast<long long>(logits.size(1)),
              static_cast<long long>(logits.size(2)));
}

double step_flops(const accel::llm::CausalLM& model, const Args& a, bool adapters) {
  const auto& c = model->config();
  const double tokens = static_cast<double>(a.seq * a.batch);
  // Blocks and head (the embedding lookup does no matrix work; a tied head is the embedding's matrix).
  double n = static_cast<double>(c.vocab_size * c.hidden_size);
  for (const auto& p : model->model->layers->named_parameters())
    n += static_cast<double>(p.value().numel());
  const double attention = 12.0 * static_cast<double>(c.num_hidden_layers) * tokens *
                           static_cast<double>(a.seq) *
                           static_cast<double>(c.num_attention_heads * c.head_dim) / 2;
  return (adapters ? 4.0 : 6.0) * n * tokens + (adapters ? 2.0 / 3.0 : 1.0) * attention;
}

void train(const Args& a, const torch::Device& device) {
  torch::manual_seed(0);
  auto model = load(a, device);
  std::shared_ptr<accel::peft::LoraModel> lora;
  if (a.mode != "full") {
    accel::peft::LoraConfig c;
    c.r = static_cast<int>(a.lora_r);
    c.lora_alpha = 2.0 * static_cast<double>(a.lora_r);
    c.target_modules = split(a.targets);
    lora = accel::peft::get_peft_model(model.ptr(), c);
    model->to(device);
  }
  if (a.checkpointing) model->model->gradient_checkpointing_enable();
  model->train();
  std::vector<torch::Tensor> trainable;
  for (const auto& p : model->parameters())
    if (p.requires_grad()) trainable.push_back(p);
  torch::optim::AdamW opt(trainable, torch::optim::AdamWOptions(1e-5));
  const auto vocab = model->config().vocab_size;
  auto one_step = [&] {
    const auto ids =
        torch::randint(vocab, {a.batch, a.seq}, torch::TensorOptions().dtype(torch::kInt64).device(device));
    const auto loss = accel::llm::causal_lm_loss(model->forward(ids), ids);
    loss.backward();
    opt.step();
    opt.zero_grad(true);
  };
  for (std::int64_t i = 0; i < a.warmup; ++i)
    one_step();
  synchronize(device);
  const auto start = std::chrono::steady_clock::now();
  for (std::int64_t i = 0; i < a.steps; ++i)
    one_step();
  synchronize(device);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() /
                         static_cast<double>(a.steps);
  const double tokens = static_cast<double>(a.seq * a.batch);
  std::printf(
      "result side=accel mode=%s seq=%lld dtype=%s tokens_per_s=%.1f step_s=%.4f peak_gb=%.3f tflops=%.2f\n",
      a.mode.c_str(), static_cast<long long>(a.seq), a.dtype.c_str(), tokens / seconds, seconds,
      peak_gb(device), step_flops(model, a, a.mode != "full") / seconds / 1e12);
}

}  // namespace

int main(int argc, char** argv) try {
  const Args a = parse(argc, argv);
  const torch::Device device(a.device);
  if (a.mode == "logits")
    write_logits(a, device);
  else
    train(a, device);
  return 0;
} catch (const std::exception& e) {
  std::cerr << "bench_llm_gpu: " << e.what() << std::endl;
  return 1;
}
