// The C++ side of sharded_load_check.py (issue 50: "under ZeRO-3 or FULL_SHARD a model larger than one
// rank's memory loads without any rank holding it whole"; and the same for a LoRA model's frozen base).
//
//   sharded_load_check whole   MODEL_DIR IDS_FILE OUT.safetensors  one process: from_pretrained, no
//   Accelerator sharded_load_check sharded MODEL_DIR IDS_FILE OUT_PREFIX       each rank of accel-launch
//   (zero3_init_flag /
//                                                                  fsdp_cpu_ram_efficient_loading config)
//   sharded_load_check refuse  MODEL_DIR IDS_FILE -                each rank of accel-launch on DDP: prepare
//                                                                  refuses the empty model, naming the fix
//   sharded_load_check early   MODEL_DIR IDS_FILE -                ZeRO-3: a forward before load_model stops
// whole and sharded write the logits of IDS_FILE's batch, the loss, and the logits after one SGD step (lr
// 0.5) on that batch, of the model and ("lora_" keys) of the model with LoRA adapters (r 4 on q_proj and
// v_proj, the base frozen, the optimizer over the adapters). The sharded run builds each model empty
// (from_pretrained_empty; LoRA's adapters then added with memory), prepares it and fills it with
// Accelerator::load_model (the files hold the base only: the adapters keep their values), and prints what
// LibTorch allocated on this rank's CPU meanwhile (CpuMemoryCounter, installed before anything is allocated):
//   [lora ]rank R: load peak P bytes, held after load H bytes, model M bytes, largest tensor L bytes, frozen
//   F bytes; resident: ...
// (the resident figures, from /proc/self/status, are for information: they include the mapped checkpoint
// pages this rank read, which the kernel may drop again)
#include <accel/accelerator/accelerator.hpp>
#include <accel/checkpoint/safetensors.hpp>
#include <accel/config/weight_loading.hpp>
#include <accel/llm/models/causal_lm.hpp>
#include <accel/llm/models/empty_weights.hpp>
#include <accel/monitor/memory.hpp>
#include <accel/nn/lora.hpp>

#include <torch/torch.h>

#include <algorithm>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

namespace {

torch::Tensor read_ids(const std::string& path) {
  std::ifstream in(path);
  std::int64_t rows = 0, cols = 0;
  in >> rows >> cols;
  std::vector<std::int64_t> ids(static_cast<std::size_t>(rows * cols));
  for (auto& id : ids)
    in >> id;
  if (!in) throw std::runtime_error("cannot read ids from " + path);
  return torch::tensor(ids, torch::kInt64).reshape({rows, cols});
}

torch::Tensor lm_loss(const torch::Tensor& logits, const torch::Tensor& ids) {
  const auto v = logits.size(-1);
  return torch::nn::functional::cross_entropy(logits.narrow(1, 0, logits.size(1) - 1).reshape({-1, v}),
                                              ids.narrow(1, 1, ids.size(1) - 1).reshape({-1}));
}

void write(const std::string& path, const std::vector<std::pair<std::string, torch::Tensor>>& tensors) {
  std::vector<torch::Tensor> keep;
  std::vector<accel::safetensors::TensorView> views;
  for (const auto& [name, t] : tensors) {
    keep.push_back(t.detach().to(torch::kFloat32).contiguous());
    views.push_back({name, accel::safetensors::DType::F32, keep.back().sizes().vec(), keep.back().data_ptr(),
                     keep.back().nbytes()});
  }
  accel::safetensors::write_file(path, views);
}

// A field of /proc/self/status in bytes (VmRSS, VmHWM, RssAnon, RssFile); 0 where there is none.
std::int64_t status_bytes(const std::string& key) {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(key + ":", 0) == 0) return std::stoll(line.substr(key.size() + 1)) * 1024;
  }
  return 0;
}

// LoRA r 4 on q_proj and v_proj, drawn from seed 3 in every run: the base frozen, the adapters trained. The
// handle keeps the adapted layers' operator observers alive: hold it while the model runs.
std::shared_ptr<accel::peft::LoraModel> adapt(accel::llm::CausalLM& model) {
  accel::peft::LoraConfig c;
  c.r = 4;
  c.lora_alpha = 8;
  c.target_modules = {"q_proj", "v_proj"};
  torch::manual_seed(3);
  return accel::peft::get_peft_model(model.ptr(), c);
}

// The parameters that require gradients (the adapters of a LoRA model): what the Trainer's optimizer gets.
std::vector<torch::Tensor> trainable(torch::nn::Module& model) {
  std::vector<torch::Tensor> out;
  for (const auto& p : model.parameters()) {
    if (p.requires_grad()) out.push_back(p);
  }
  return out;
}

// One process: the logits, loss and logits after an SGD step of the model and of its LoRA version ("lora_").
int whole(const std::string& dir, const torch::Tensor& ids, const std::string& out) {
  std::vector<std::pair<std::string, torch::Tensor>> tensors;
  for (const bool lora : {false, true}) {
    auto model = accel::llm::from_pretrained(dir);
    const auto adapters = lora ? adapt(model) : nullptr;
    torch::optim::SGD optimizer(trainable(*model), 0.5);
    const auto logits = model(ids);
    const auto loss = lm_loss(logits, ids);
    loss.backward();
    optimizer.step();
    torch::NoGradGuard no_grad;
    const std::string prefix = lora ? "lora_" : "";
    tensors.insert(
        tensors.end(),
        {{prefix + "logits", logits}, {prefix + "loss", loss}, {prefix + "logits_after_step", model(ids)}});
  }
  write(out, tensors);
  return 0;
}

// Builds the model empty (with LoRA adapters when `lora`: they hold memory, the base none), prepares it with
// SGD over its trainable parameters, fills it with load_model and prints what LibTorch allocated meanwhile;
// returns the logits, loss and logits after one step, named as whole() names them.
std::vector<std::pair<std::string, torch::Tensor>> sharded_run(accel::Accelerator& acc,
                                                               const std::string& dir,
                                                               const torch::Tensor& ids, bool lora) {
  using accel::CpuMemoryCounter;
  CpuMemoryCounter::reset_peak();
  const auto base = CpuMemoryCounter::current();
  const auto rss_before = status_bytes("VmRSS"), anon_before = status_bytes("RssAnon");
  const auto file_before = status_bytes("RssFile");
  auto model = accel::llm::from_pretrained_empty(dir);
  const auto adapters = lora ? adapt(model) : nullptr;
  const auto anon_built = status_bytes("RssAnon") - anon_before;
  torch::optim::SGD optimizer(trainable(*model), 0.5);
  acc.prepare(model, optimizer);
  const auto anon_prepared = status_bytes("RssAnon") - anon_before;
  acc.load_model(model, dir);
  const auto peak = CpuMemoryCounter::peak() - base;
  const auto held = CpuMemoryCounter::current() - base;
  std::int64_t model_bytes = 0, largest = 0, frozen = 0;
  for (const auto& p : model->parameters()) {
    model_bytes += p.numel() * p.element_size();
    largest = std::max<std::int64_t>(largest, p.numel() * p.element_size());
    if (!p.requires_grad()) frozen += p.numel() * p.element_size();
  }
  std::cout << (lora ? "lora " : "") << "rank " << acc.process_index() << ": load peak " << peak
            << " bytes, held after load " << held << " bytes, model " << model_bytes
            << " bytes, largest tensor " << largest << " bytes, frozen " << frozen
            << " bytes; resident: anonymous growth " << anon_built << " bytes after building, "
            << anon_prepared << " after prepare; peak growth " << status_bytes("VmHWM") - rss_before
            << " bytes, anonymous " << status_bytes("RssAnon") - anon_before << " bytes and file pages "
            << status_bytes("RssFile") - file_before << " bytes more after load" << std::endl;
  const auto logits = model(ids);
  const auto loss = lm_loss(logits, ids);
  acc.backward(loss);
  optimizer.step();
  optimizer.zero_grad();
  torch::NoGradGuard no_grad;
  const auto after = model(ids);
  const std::string prefix = lora ? "lora_" : "";
  return {{prefix + "logits", logits}, {prefix + "loss", loss}, {prefix + "logits_after_step", after}};
}

// The whole model, then its LoRA version (the frozen base sharded as the rest), each in its own Accelerator.
int sharded(const std::string& dir, const torch::Tensor& ids, const std::string& prefix) {
  std::vector<std::pair<std::string, torch::Tensor>> tensors;
  int rank = 0;
  for (const bool lora : {false, true}) {
    accel::Accelerator acc;
    if (!accel::loads_weights_sharded(acc.config())) {
      std::cerr << "sharded_load_check: the config does not load weights sharded (zero3_init_flag / "
                   "fsdp_cpu_ram_efficient_loading on ZeRO-3 / FULL_SHARD)\n";
      return 2;
    }
    rank = acc.process_index();
    for (auto& t : sharded_run(acc, dir, ids, lora))
      tensors.push_back(std::move(t));
  }
  write(prefix + std::to_string(rank) + ".safetensors", tensors);
  return 0;
}

// A backend that keeps parameters whole (DDP) cannot take an empty model: prepare must stop with the
// parameter's message, naming from_pretrained_empty and the fix.
int refuse(const std::string& dir) {
  accel::Accelerator acc;
  auto model = accel::llm::from_pretrained_empty(dir);
  torch::optim::SGD optimizer(model->parameters(), 0.5);
  try {
    acc.prepare(model, optimizer);
  } catch (const std::exception& e) {
    std::cout << "rank " << acc.process_index() << " refused: " << e.what() << std::endl;
    return 0;
  }
  std::cout << "rank " << acc.process_index() << " prepared an empty model on " << acc.backend_name()
            << std::endl;
  return 1;
}

// A forward on a prepared empty model before load_model: the engine stops the rank (an error cannot leave
// LibTorch's operator callback) with a message naming the parameter and the call.
int early(const std::string& dir, const torch::Tensor& ids) {
  accel::Accelerator acc;
  auto model = accel::llm::from_pretrained_empty(dir);
  torch::optim::SGD optimizer(model->parameters(), 0.5);
  acc.prepare(model, optimizer);
  torch::NoGradGuard no_grad;
  model(ids);
  std::cout << "rank " << acc.process_index() << " ran a forward on an empty model" << std::endl;
  return 0;
}

}  // namespace

int main(int argc, char** argv) try {
  accel::CpuMemoryCounter::install();  // first: every allocation of the load is counted
  if (argc != 5) {
    std::cerr << "usage: sharded_load_check whole|sharded MODEL_DIR IDS_FILE OUT\n";
    return 2;
  }
  const std::string mode = argv[1];
  const auto ids = read_ids(argv[3]);
  if (mode == "refuse") return refuse(argv[2]);
  if (mode == "early") return early(argv[2], ids);
  return mode == "whole" ? whole(argv[2], ids, argv[4]) : sharded(argv[2], ids, argv[4]);
} catch (const std::exception& e) {
  std::cerr << "sharded_load_check: " << e.what() << std::endl;
  return 1;
}
