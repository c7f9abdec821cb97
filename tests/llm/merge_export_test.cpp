// accel::llm::merge_and_dequantize: a QLoRA model's merged export holds ordinary Linear layers whose weights
// are the dequantised 4-bit weights plus the adapters' product, in the dtype the base was quantised from.
#include <torch/torch.h>
#include <accel/llm/models/causal_lm.hpp>
#include <accel/llm/training/merge_export.hpp>
#include <accel/nn/lora.hpp>
#include <accel/nn/quant4bit.hpp>

#include <catch2/catch.hpp>

#include <map>
#include <string>

namespace {

namespace llm = accel::llm;

llm::CausalLM tiny_model(torch::ScalarType dtype) {
  const auto config = llm::ModelConfig::from_json(
      R"({"model_type": "qwen2", "vocab_size": 96, "hidden_size": 64, "intermediate_size": 128,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "max_position_embeddings": 64, "tie_word_embeddings": false})",
      "tiny.json");
  torch::manual_seed(4);
  llm::CausalLM model(config);
  {
    torch::NoGradGuard no_grad;
    for (auto& p : model->parameters())
      p.normal_(0.0, 0.2);
  }
  model->to(dtype);
  return model;
}

}  // namespace

TEST_CASE("merge_and_dequantize writes dequantised weights + scale B A in the base's dtype, not re-quantised",
          "[llm][merge]") {
  for (const auto dtype : {torch::kFloat32, torch::kBFloat16}) {
    INFO("dtype " << c10::toString(dtype));
    auto model = tiny_model(dtype);
    const auto quantised = accel::quant::quantize_linears(*model, {}, {"^lm_head$"});
    REQUIRE(quantised.size() == 14);  // 7 projections x 2 layers; the head stays in full precision
    accel::peft::LoraConfig c;
    c.r = 4;
    c.lora_alpha = 16;  // scale 4
    c.target_modules = {"q_proj", "v_proj", "lm_head"};
    auto lora = accel::peft::get_peft_model(model, c);
    std::map<std::string, torch::Tensor> expected;
    torch::Tensor head_expected;
    {
      torch::NoGradGuard no_grad;
      for (auto& p : model->named_parameters())
        if (p.key().find("lora_B") != std::string::npos) p.value().normal_(0.0, 0.1);
      for (const auto& m : model->named_modules("", false)) {
        auto* q = m.value()->as<accel::quant::Linear4bitImpl>();
        if (q == nullptr) continue;
        auto w = q->dequantized_weight(torch::kFloat32);
        const auto children = q->named_children();
        if (children.contains("lora_A"))
          w += 4.0 *
               torch::matmul(children["lora_B"]->as<torch::nn::LinearImpl>()->weight.to(torch::kFloat32),
                             children["lora_A"]->as<torch::nn::LinearImpl>()->weight.to(torch::kFloat32));
        expected[m.key()] = w.to(dtype);
      }
      auto* head = model->named_children()["lm_head"]->as<torch::nn::LinearImpl>();
      const auto hc = head->named_children();
      head_expected = head->weight + (4.0 * torch::matmul(hc["lora_B"]->as<torch::nn::LinearImpl>()->weight,
                                                          hc["lora_A"]->as<torch::nn::LinearImpl>()->weight))
                                         .to(dtype);
    }
    model->eval();
    const auto ids = torch::randint(0, 96, {2, 12}, torch::kInt64);
    torch::Tensor before;
    {
      torch::NoGradGuard no_grad;
      before = model->forward(ids).to(torch::kFloat32);
    }
    const auto replaced = llm::merge_and_dequantize(*model, *lora);
    CHECK(replaced.size() == 14);
    std::size_t linears = 0;
    for (const auto& m : model->named_modules("", false)) {
      CHECK(m.value()->as<accel::quant::Linear4bitImpl>() == nullptr);
      if (!expected.count(m.key())) continue;
      auto* linear = m.value()->as<torch::nn::LinearImpl>();
      REQUIRE(linear != nullptr);
      CHECK(linear->weight.scalar_type() == dtype);
      CHECK(torch::equal(linear->weight, expected.at(m.key())));
      ++linears;
    }
    CHECK(linears == 14);
    for (const auto& p : model->named_parameters())
      CHECK(p.key().find("lora_") == std::string::npos);
    CHECK(torch::allclose(model->named_children()["lm_head"]->as<torch::nn::LinearImpl>()->weight,
                          head_expected));
    torch::NoGradGuard no_grad;
    const auto after = model->forward(ids).to(torch::kFloat32);
    // float32: the same function up to summation order; bf16: the merged weights are rounded once to bf16.
    CHECK((after - before).abs().max().item<double>() <= (dtype == torch::kFloat32 ? 1e-4 : 0.15));
  }
}
