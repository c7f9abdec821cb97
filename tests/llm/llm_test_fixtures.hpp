// Shared set-up of the LLM tests (fused_loss_test.cpp, sp_fused_loss_test.cpp, models_test.cpp): a tiny Qwen2
// config, a model with random weights of some spread, LoRA adapters whose B is non-zero, and the reading of
// the reference tensors the Python side wrote.
#pragma once

#include <torch/torch.h>
#include <accel/checkpoint/safetensors.hpp>
#include <accel/llm/models/causal_lm.hpp>
#include <accel/llm/models/model_config.hpp>
#include <accel/nn/lora.hpp>

#include <cstdint>
#include <map>
#include <memory>
#include <string>

namespace llm_test {

/// Qwen2 at toy sizes (hidden 32, 2 layers, 4 query heads over 2 key-value heads), the head tied to the
/// embedding or its own lm_head.
inline accel::llm::ModelConfig tiny_qwen2(bool tied, std::int64_t vocab = 97) {
  return accel::llm::ModelConfig::from_json(
      R"({"model_type": "qwen2", "vocab_size": )" + std::to_string(vocab) +
          R"(, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "max_position_embeddings": 512,
          "tie_word_embeddings": )" +
          (tied ? "true" : "false") + "}",
      "tiny.json");
}

/// A model of `config` with every parameter drawn from N(0, 0.3) after torch::manual_seed(seed): logits far
/// from uniform, so that losses and gradients tell paths apart.
inline accel::llm::CausalLM random_model(const accel::llm::ModelConfig& config, std::uint64_t seed) {
  torch::manual_seed(static_cast<std::int64_t>(seed));
  accel::llm::CausalLM model(config);
  torch::NoGradGuard no_grad;
  for (auto& p : model->parameters())
    p.normal_(0.0, 0.3);
  return model;
}

/// LoRA r 4 (alpha 8) on `target` and v_proj, each B drawn from N(0, 0.2) so that the adapters change the
/// loss. Keep the returned model alive while `model` is used.
inline std::shared_ptr<accel::peft::LoraModel> lora_on(accel::llm::CausalLM& model,
                                                       const std::string& target) {
  accel::peft::LoraConfig c;
  c.r = 4;
  c.lora_alpha = 8;
  c.target_modules = {target, "v_proj"};
  auto lora = accel::peft::get_peft_model(model, c);
  torch::NoGradGuard no_grad;
  for (auto& p : model->named_parameters())
    if (p.key().find("lora_B") != std::string::npos) p.value().normal_(0.0, 0.2);
  return lora;
}

/// Every tensor of a safetensors file the Python side wrote (int64 ids and masks, float32 values), copied.
inline std::map<std::string, torch::Tensor> load_reference_tensors(const std::string& path) {
  const auto file = accel::safetensors::File::open(path);
  std::map<std::string, torch::Tensor> out;
  for (const auto& name : file.names()) {
    const auto& info = file.info(name);
    const auto dtype = info.dtype == accel::safetensors::DType::I64 ? torch::kInt64 : torch::kFloat32;
    out[name] = torch::from_blob(const_cast<std::uint8_t*>(file.data(name)), info.shape, dtype).clone();
  }
  return out;
}

}  // namespace llm_test
