// The merged model of a LoRA / QLoRA run, with ordinary tensors only (merge_export.hpp).
#include <accel/errors.hpp>
#include <accel/llm/training/merge_export.hpp>
#include <accel/nn/quant4bit.hpp>

#include <torch/torch.h>

#include <cmath>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace accel::llm {

namespace {

struct Replacement {
  std::string path;
  torch::nn::Linear linear{nullptr};
};

// W = dequantise(q) + scale * B A in float32, then the dtype the weight was quantised from.
Replacement dequantized(const std::string& path, quant::Linear4bitImpl& base, double scale) {
  auto w = base.dequantized_weight(torch::kFloat32);
  const auto children = base.named_children();
  if (children.contains("lora_A") && children.contains("lora_B")) {
    auto* a = children["lora_A"]->as<torch::nn::LinearImpl>();
    auto* b = children["lora_B"]->as<torch::nn::LinearImpl>();
    if (a == nullptr || b == nullptr)
      throw UsageError("accel::llm::merge_and_dequantize: '" + path +
                       "' holds lora_A / lora_B children that are not Linear layers");
    w.add_(torch::matmul(b->weight.to(torch::kFloat32), a->weight.to(torch::kFloat32)).to(w.device()) *
           scale);
    b->weight.zero_();  // merge_and_unload then adds nothing to the 4-bit copy this replaces
  }
  const auto& q = base.quantized();
  torch::nn::Linear linear(
      torch::nn::LinearOptions(base.in_features(), base.out_features()).bias(base.bias.defined()));
  linear->weight.set_data(w.to(q.dtype));
  if (base.bias.defined()) linear->bias.set_data(base.bias.detach().clone());
  linear->weight.set_requires_grad(false);
  if (base.bias.defined()) linear->bias.set_requires_grad(base.bias.requires_grad());
  return {path, linear};
}

void replace(torch::nn::Module& model, const Replacement& r) {
  const auto dot = r.path.rfind('.');
  const std::string parent_path = dot == std::string::npos ? "" : r.path.substr(0, dot);
  const std::string name = dot == std::string::npos ? r.path : r.path.substr(dot + 1);
  std::shared_ptr<torch::nn::Module> parent;
  if (parent_path.empty()) {
    parent = model.shared_from_this();
  } else {
    const auto modules = model.named_modules();
    if (!modules.contains(parent_path))
      throw UsageError("accel::llm::merge_and_dequantize: no module '" + parent_path + "' holds '" + r.path +
                       "'");
    parent = modules[parent_path];
  }
  parent->replace_module(name, r.linear.ptr());
}

}  // namespace

std::vector<std::string> merge_and_dequantize(torch::nn::Module& model, peft::LoraModel& lora) {
  const auto& c = lora.config();
  const double scale = c.use_rslora ? c.lora_alpha / std::sqrt(static_cast<double>(c.r)) : c.lora_alpha / c.r;
  std::vector<Replacement> replacements;
  {
    torch::NoGradGuard no_grad;
    for (const auto& item : model.named_modules("", /*include_self=*/false)) {
      if (auto* base = item.value()->as<quant::Linear4bitImpl>())
        replacements.push_back(dequantized(item.key(), *base, scale));
    }
  }
  // Full-precision adapted layers merge as PEFT merges them; the 4-bit ones (their B now zero) are left
  // unchanged by it and replaced below, so the exact sums computed above are what the model holds.
  lora.merge_and_unload();
  std::vector<std::string> paths;
  for (const auto& r : replacements) {
    replace(model, r);
    paths.push_back(r.path);
  }
  return paths;
}

}  // namespace accel::llm
