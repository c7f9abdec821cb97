// LoRA's target selection: PEFT's "all-linear" shorthand (every Linear but the output head, as peft's
// _maybe_include_all_linear_layers) on a module tree laid out as transformers' Qwen2 models are, and
// rank-stabilised scaling (use_rslora). [.peft_all_linear] compares the adapted paths with PEFT's choice on
// the same trees in Python (tests/python/peft_all_linear.py, run by python_crosschecks.sh).
#include <catch2/catch.hpp>

#include <accel/errors.hpp>
#include <accel/nn/lora.hpp>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <string>
#include <tuple>
#include <vector>

namespace {

using Catch::Matchers::Contains;

// The module names of transformers' Qwen2 (modeling_qwen2.py): model.embed_tokens, model.layers.N.self_attn.
// {q,k,v,o}_proj, model.layers.N.mlp.{gate,up,down}_proj, the norms, and lm_head (causal LM) or score
// (sequence classification). Only the tree matters here, not the forward.
struct AttentionTree : torch::nn::Module {
  AttentionTree() {
    register_module("q_proj", torch::nn::Linear(16, 16));
    register_module("k_proj", torch::nn::Linear(16, 8));
    register_module("v_proj", torch::nn::Linear(16, 8));
    register_module("o_proj", torch::nn::Linear(torch::nn::LinearOptions(16, 16).bias(false)));
  }
};
struct MlpTree : torch::nn::Module {
  MlpTree() {
    register_module("gate_proj", torch::nn::Linear(torch::nn::LinearOptions(16, 32).bias(false)));
    register_module("up_proj", torch::nn::Linear(torch::nn::LinearOptions(16, 32).bias(false)));
    register_module("down_proj", torch::nn::Linear(torch::nn::LinearOptions(32, 16).bias(false)));
  }
};
struct LayerTree : torch::nn::Module {
  LayerTree() {
    register_module("self_attn", std::make_shared<AttentionTree>());
    register_module("mlp", std::make_shared<MlpTree>());
    register_module("input_layernorm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({16})));
    register_module("post_attention_layernorm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({16})));
  }
};
struct BodyTree : torch::nn::Module {
  BodyTree() {
    register_module("embed_tokens", torch::nn::Embedding(64, 16));
    torch::nn::ModuleList layers;
    layers->push_back(std::make_shared<LayerTree>());
    layers->push_back(std::make_shared<LayerTree>());
    register_module("layers", layers);
    register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({16})));
  }
};
// head: "lm_head" (Qwen2ForCausalLM) or "score" (Qwen2ForSequenceClassification).
std::shared_ptr<torch::nn::Module> lt_qwen2_tree(const std::string& head) {
  auto m = std::make_shared<torch::nn::Module>();
  m->register_module("model", std::make_shared<BodyTree>());
  m->register_module(head,
                     torch::nn::Linear(torch::nn::LinearOptions(16, head == "score" ? 3 : 64).bias(false)));
  return m;
}

std::vector<std::string> lt_sorted(std::vector<std::string> v) {
  std::sort(v.begin(), v.end());
  return v;
}

accel::peft::LoraConfig lt_all_linear(const std::string& task_type = "CAUSAL_LM") {
  accel::peft::LoraConfig c;
  c.r = 2;
  c.lora_alpha = 8;
  c.target_modules = {"all-linear"};
  c.task_type = task_type;
  return c;
}

}  // namespace

TEST_CASE("LoRA: all-linear adapts every Linear but the output head") {
  auto causal = lt_qwen2_tree("lm_head");
  auto lora = accel::peft::get_peft_model(causal, lt_all_linear());
  const auto adapted = lora->adapted_modules();
  CHECK(adapted.size() == 14);  // 2 layers x (4 attention + 3 MLP projections)
  CHECK(std::find(adapted.begin(), adapted.end(), "lm_head") == adapted.end());
  CHECK(std::find(adapted.begin(), adapted.end(), "model.layers.1.mlp.down_proj") != adapted.end());
  // The resolved names are the config's targets, as PEFT writes them into adapter_config.json.
  CHECK(lt_sorted(lora->config().target_modules) == lt_sorted(adapted));
  // Spelled as PEFT's string form, in any case.
  accel::peft::LoraConfig regex_form;
  regex_form.target_modules_regex = "ALL-LINEAR";
  CHECK(accel::peft::get_peft_model(lt_qwen2_tree("lm_head"), regex_form)->adapted_modules().size() == 14);
  // A sequence classifier: its score head is left out under SEQ_CLS (PEFT's SEQ_CLS_HEAD_NAMES), kept
  // otherwise.
  CHECK(accel::peft::get_peft_model(lt_qwen2_tree("score"), lt_all_linear("SEQ_CLS"))
            ->adapted_modules()
            .size() == 14);
  CHECK(accel::peft::get_peft_model(lt_qwen2_tree("score"), lt_all_linear("CAUSAL_LM"))
            ->adapted_modules()
            .size() == 15);
  // No Linear but the head: an error naming it.
  auto only_head = std::make_shared<torch::nn::Module>();
  only_head->register_module("lm_head", torch::nn::Linear(4, 4));
  CHECK_THROWS_WITH(accel::peft::get_peft_model(only_head, lt_all_linear()), Contains("'lm_head'"));
}

TEST_CASE("LoRA: use_rslora scales the adapters by lora_alpha / sqrt(r)") {
  torch::manual_seed(3);
  auto make = [] {
    auto m = std::make_shared<torch::nn::Module>();
    m->register_module("fc", torch::nn::Linear(8, 8));
    return m;
  };
  const auto x = torch::randn({4, 8});
  for (const bool rs : {false, true}) {
    torch::manual_seed(5);
    auto m = make();
    accel::peft::LoraConfig c;
    c.r = 4;
    c.lora_alpha = 8;
    c.target_modules = {"fc"};
    c.use_rslora = rs;
    auto lora = accel::peft::get_peft_model(m, c);
    auto* fc = m->named_modules()["fc"]->as<torch::nn::Linear>();
    auto a = fc->named_children()["lora_A"]->as<torch::nn::Linear>();
    auto b = fc->named_children()["lora_B"]->as<torch::nn::Linear>();
    {
      torch::NoGradGuard g;
      b->weight.normal_();
    }
    // A copy of the weight: the adapter term is added wherever the adapted weight itself is applied.
    const auto plain = torch::nn::functional::linear(x, fc->weight.detach().clone(), fc->bias);
    const auto delta = fc->forward(x) - plain;
    const double scale = rs ? 8.0 / std::sqrt(4.0) : 8.0 / 4.0;
    CHECK(torch::allclose(delta, b->forward(a->forward(x)) * scale, 1e-5, 1e-6));
  }
}

// PEFT's own choice, written by tests/python/peft_all_linear.py into $ACCEL_PEFT_EXPORT_DIR.
TEST_CASE("LoRA: all-linear adapts the modules PEFT adapts", "[.peft_all_linear]") {
  const char* dir = std::getenv("ACCEL_PEFT_EXPORT_DIR");
  REQUIRE(dir != nullptr);
  const std::vector<std::tuple<std::string, std::string, std::string>> cases = {
      {"all_linear_causal.txt", "lm_head", "CAUSAL_LM"}, {"all_linear_seq_cls.txt", "score", "SEQ_CLS"}};
  for (const auto& [file, head, task] : cases) {
    INFO(file);
    std::ifstream in(std::string(dir) + "/" + file);
    REQUIRE(in);
    std::vector<std::string> peft;
    for (std::string line; std::getline(in, line);)
      if (!line.empty()) peft.push_back(line);
    const auto ours =
        lt_sorted(accel::peft::get_peft_model(lt_qwen2_tree(head), lt_all_linear(task))->adapted_modules());
    CHECK(ours == lt_sorted(peft));
    std::cout << "peft_all_linear: " << file << ": the " << ours.size() << " modules PEFT adapts"
              << std::endl;
  }
}
