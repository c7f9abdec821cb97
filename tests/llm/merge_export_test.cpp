// accel::llm::merge_and_dequantize: a QLoRA model's merged export holds ordinary Linear layers whose weights
// are the dequantised 4-bit weights plus the adapters' product, in the dtype the base was quantised from.
#include <torch/torch.h>
#include <accel/llm/models/causal_lm.hpp>
#include <accel/llm/training/merge_export.hpp>
#include <accel/nn/lora.hpp>
#include <accel/nn/quant4bit.hpp>

#include <ATen/CPUGeneratorImpl.h>

#include <catch2/catch.hpp>

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

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
      // The head's adapters are float32 (PEFT's autocast_adapter_dtype on a bf16 base): W + delta rounded
      // once.
      head_expected = (head->weight.to(torch::kFloat32) +
                       4.0 * torch::matmul(hc["lora_B"]->as<torch::nn::LinearImpl>()->weight,
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

namespace {

// The merged weight PEFT 0.21 computes (peft/tuners/lora/layer.py Linear.get_delta_weight, then merge with
// safe_merge false: `base_layer.weight.data += delta_weight`), each rounding spelled out: on the CPU, bf16 /
// fp16 adapters are multiplied in float32, the delta (B A) * scaling rounded to the adapters' dtype, then
// added to W and rounded to W's dtype (two roundings); float32 adapters on a bf16 base: the float32 delta
// added to W in float32 and rounded once.
torch::Tensor peft_merged(const torch::Tensor& w, const torch::Tensor& a, const torch::Tensor& b,
                          double scaling) {
  auto delta = torch::matmul(b.to(torch::kFloat32), a.to(torch::kFloat32)) * scaling;
  delta = delta.to(b.scalar_type()).to(torch::kFloat32);  // the first rounding (none for float32 adapters)
  return (w.to(torch::kFloat32) + delta).to(w.scalar_type());
}

// A tiny tied or untied model adapted on q/v and lm_head, B drawn (not zeros) so that the merge moves W.
std::shared_ptr<accel::peft::LoraModel> adapted(llm::CausalLM& model, torch::ScalarType adapter_dtype) {
  accel::peft::LoraConfig c;
  c.r = 4;
  c.lora_alpha = 12;  // scaling 3: not a power of two, so the product's rounding shows
  c.target_modules = {"q_proj", "v_proj", "lm_head"};
  auto lora = accel::peft::get_peft_model(model, c);
  torch::NoGradGuard no_grad;
  for (auto& m : model->named_modules("", false)) {
    if (m.key().find(".lora_") == std::string::npos && m.key().rfind("lora_", 0) != 0) continue;
    m.value()->to(adapter_dtype);
  }
  for (auto& p : model->named_parameters())
    if (p.key().find("lora_B") != std::string::npos) p.value().normal_(0.0, 0.3);
  return lora;
}

}  // namespace

TEST_CASE("LoraModel::merge and merged_state round as PEFT's merge_and_unload, bit for bit", "[llm][merge]") {
  struct Case {
    torch::ScalarType base, adapters;
  };
  for (const auto& [base, adapters] :
       {Case{torch::kFloat32, torch::kFloat32}, Case{torch::kBFloat16, torch::kBFloat16},
        Case{torch::kBFloat16, torch::kFloat32}}) {
    INFO("base " << c10::toString(base) << ", adapters " << c10::toString(adapters));
    auto model = tiny_model(base);
    auto lora = adapted(model, adapters);
    std::map<std::string, torch::Tensor> expected;
    std::int64_t two_roundings = 0;  // entries where PEFT's two roundings differ from one
    for (const auto& m : model->named_modules("", false)) {
      const auto children = m.value()->named_children();
      if (!children.contains("lora_A")) continue;
      const auto& w = m.value()->as<torch::nn::LinearImpl>()->weight;
      const auto& a = children["lora_A"]->as<torch::nn::LinearImpl>()->weight;
      const auto& b = children["lora_B"]->as<torch::nn::LinearImpl>()->weight;
      expected[m.key() + ".weight"] = peft_merged(w, a, b, 3.0);
      const auto once =
          (w.to(torch::kFloat32) + torch::matmul(b.to(torch::kFloat32), a.to(torch::kFloat32)) * 3.0)
              .to(w.scalar_type());
      two_roundings += expected[m.key() + ".weight"].ne(once).sum().item<std::int64_t>();
    }
    REQUIRE(expected.size() == 5);                               // q, v of two layers and the head
    if (adapters == torch::kBFloat16) CHECK(two_roundings > 0);  // the check tells the arithmetics apart
    // The merge of a gathered state (ZeRO-3 / FULL_SHARD's --save_merged): the model's whole state, as
    // Accelerator::get_state_dict gives it.
    std::vector<std::pair<std::string, torch::Tensor>> state;
    for (const auto& p : model->named_parameters())
      state.emplace_back(p.key(), p.value().detach().clone());
    const auto merged_state = lora->merged_state(state);
    lora->merge();
    const auto params = model->named_parameters();
    std::size_t weights = 0;
    for (const auto& [name, t] : merged_state) {
      CHECK(name.find("lora_") == std::string::npos);
      INFO(name);
      REQUIRE(params.contains(name));
      CHECK(t.scalar_type() == params[name].scalar_type());
      CHECK(torch::equal(t, params[name]));  // the in-memory merge and the gathered-state merge agree
      if (expected.count(name) == 0) continue;
      CHECK(torch::equal(t, expected.at(name)));
      ++weights;
    }
    CHECK(weights == 5);
    CHECK(merged_state.size() + 10 == params.size());  // every tensor but the 5 x 2 adapters
  }
}

TEST_CASE("CausalLM::untie_word_embeddings copies the embedding without drawing a random head",
          "[llm][merge]") {
  for (const auto dtype : {torch::kFloat32, torch::kBFloat16}) {
    INFO("dtype " << c10::toString(dtype));
    const auto config = llm::ModelConfig::from_json(
        R"({"model_type": "qwen2", "vocab_size": 96, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 64, "tie_word_embeddings": true})",
        "tied.json");
    llm::CausalLM model(config);
    model->to(dtype);
    model->model->embed_tokens->weight.set_requires_grad(false);
    const auto rng = at::detail::getDefaultCPUGenerator().get_state();
    model->untie_word_embeddings();
    CHECK(torch::equal(at::detail::getDefaultCPUGenerator().get_state(), rng));  // no draw
    const auto params = model->named_parameters();
    REQUIRE(params.contains("lm_head.weight"));
    const auto& head = params["lm_head.weight"];
    const auto& embedding = model->model->embed_tokens->weight;
    CHECK(head.scalar_type() == dtype);
    CHECK(head.device() == embedding.device());
    CHECK_FALSE(head.requires_grad());
    CHECK(torch::equal(head, embedding));
    CHECK(head.data_ptr() != embedding.data_ptr());  // a copy: the two train apart
    CHECK_FALSE(model->config().tie_word_embeddings);
    auto* linear = model->named_children()["lm_head"]->as<torch::nn::LinearImpl>();
    REQUIRE(linear != nullptr);
    CHECK(linear->options.in_features() == 64);
    CHECK(linear->options.out_features() == 96);
  }
}
