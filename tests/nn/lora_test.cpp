// accel::peft LoRA on an unmodified model: the term PEFT computes, gradients to the adapters only, merge,
// PEFT's adapter files, and the errors.
#include <accel/checkpoint/safetensors.hpp>
#include <accel/errors.hpp>
#include <accel/nn/activation_checkpoint.hpp>
#include <accel/nn/lora.hpp>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <thread>

#include "test_support.hpp"

using namespace accel;
using Catch::Matchers::Contains;

namespace {

struct BlockImpl : torch::nn::Module {
  BlockImpl()
      : q_proj(register_module("q_proj", torch::nn::Linear(6, 6))),
        v_proj(register_module("v_proj", torch::nn::Linear(6, 6))),
        norm(register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({6})))),
        out(register_module("out", torch::nn::Linear(6, 2))) {}
  // Unmodified user code: the Linear members are called directly.
  torch::Tensor forward(torch::Tensor x) { return out(norm(torch::relu(q_proj(x)) + v_proj(x))); }
  torch::nn::Linear q_proj, v_proj;
  torch::nn::LayerNorm norm;
  torch::nn::Linear out;
};
TORCH_MODULE(Block);

// What PEFT's LoRA layer computes for `linear` with adapters (A, B) and scale s.
torch::Tensor reference(const torch::Tensor& x, const torch::nn::Linear& base, const torch::Tensor& w,
                        const torch::Tensor& A, const torch::Tensor& B, double s) {
  return torch::linear(x, w, base->bias) + s * torch::linear(torch::linear(x, A), B);
}

// The set-up most cases share: r 2, lora_alpha 4 (scale 2) on q_proj and v_proj.
peft::LoraConfig qv_config(double dropout = 0.0) {
  peft::LoraConfig config;
  config.r = 2;
  config.lora_alpha = 4;
  config.lora_dropout = dropout;
  config.target_modules = {"q_proj", "v_proj"};
  return config;
}

// B starts at zero (the adapted output is the base's): values drawn for every lora_B so that the term shows.
void randomize_lora_b(torch::nn::Module& model, double stddev = 1.0) {
  torch::NoGradGuard no_grad;
  for (auto& p : model.named_parameters())
    if (p.key().find("lora_B") != std::string::npos) p.value().normal_(0, stddev);
}

// The adapted Block's output by PEFT's formula at scale 2 (qv_config), from copies `wq`, `wv` of the base
// weights (the observer adds the term to any product with the adapted weights themselves) and the adapters.
torch::Tensor peft_output(Block& model, const torch::Tensor& x, const torch::Tensor& wq,
                          const torch::Tensor& wv, const torch::Tensor& Aq, const torch::Tensor& Bq,
                          const torch::Tensor& Av, const torch::Tensor& Bv) {
  const auto h = torch::relu(reference(x, model->q_proj, wq, Aq, Bq, 2.0)) +
                 reference(x, model->v_proj, wv, Av, Bv, 2.0);
  return model->out(model->norm(h));
}

}  // namespace

TEST_CASE("LoRA: get_peft_model adapts the named Linear layers of an unmodified model, as PEFT computes") {
  torch::manual_seed(0);
  Block model;
  auto lora = peft::get_peft_model(model, qv_config());
  CHECK(lora->adapted_modules() == std::vector<std::string>{"q_proj", "v_proj"});
  // Only the adapters train: 2 layers x (2x6 + 6x2).
  const auto [trainable, all] = lora->trainable_parameters();
  CHECK(trainable == 2 * (12 + 12));
  CHECK_THAT(lora->print_trainable_parameters(), Contains("trainable params: 48 || all params: "));
  // B starts at zero: the output is the base model's.
  auto x = torch::randn({5, 6});
  auto q = model->q_proj->named_children()["lora_A"];
  REQUIRE(q != nullptr);
  // Give B values so the term shows, then compare with PEFT's formula, 2-D (addmm) and 3-D (matmul) inputs.
  randomize_lora_b(*model);
  auto named = model->named_parameters();
  const auto Aq = named["q_proj.lora_A.weight"], Bq = named["q_proj.lora_B.weight"];
  const auto Av = named["v_proj.lora_A.weight"], Bv = named["v_proj.lora_B.weight"];
  const auto wq = model->q_proj->weight.detach().clone(), wv = model->v_proj->weight.detach().clone();
  for (const auto& input : {x, torch::randn({3, 4, 6})}) {
    CHECK(torch::allclose(model(input), peft_output(model, input, wq, wv, Aq, Bq, Av, Bv), 1e-5, 1e-6));
  }
  // Gradients reach the adapters, exactly as through the formula, and no frozen parameter.
  model->zero_grad();
  model(x).pow(2).sum().backward();
  auto A2 = Aq.detach().clone().requires_grad_(), B2 = Bq.detach().clone().requires_grad_();
  peft_output(model, x, wq, wv, A2, B2, Av.detach(), Bv.detach()).pow(2).sum().backward();
  CHECK(torch::allclose(Aq.grad(), A2.grad(), 1e-5, 1e-6));
  CHECK(torch::allclose(Bq.grad(), B2.grad(), 1e-5, 1e-6));
  CHECK_FALSE(model->q_proj->weight.grad().defined());
  CHECK_FALSE(model->out->weight.grad().defined());
  // merge: the weights absorb the term and the outputs stay; unmerge gives the adapters back.
  torch::NoGradGuard no_grad;
  const auto before = model(x);
  lora->merge();
  CHECK(torch::allclose(model(x), before, 1e-5, 1e-6));
  CHECK_FALSE(torch::allclose(model->q_proj->weight, wq));
  lora->unmerge();
  CHECK(torch::allclose(model->q_proj->weight, wq, 1e-6, 1e-6));
  CHECK(torch::allclose(model(x), before, 1e-5, 1e-6));
  lora->merge_and_unload();
  CHECK(torch::allclose(model(x), before, 1e-5, 1e-6));
  CHECK(model->q_proj->named_children().is_empty());
}

TEST_CASE("LoRA: adapter files in PEFT's format, written and read back") {
  test::TempDir dir;
  torch::manual_seed(1);
  Block model;
  peft::LoraConfig config;
  config.r = 3;
  config.lora_alpha = 6;
  config.target_modules = {"q_proj"};
  config.bias = "lora_only";
  auto lora = peft::get_peft_model(model, config);
  {
    torch::NoGradGuard no_grad;
    model->named_parameters()["q_proj.lora_B.weight"].normal_();
  }
  CHECK(model->q_proj->bias.requires_grad());
  CHECK_FALSE(model->v_proj->bias.requires_grad());
  const auto path = (dir.path / "adapter").string();
  lora->save_adapter(path);
  std::ifstream json(path + "/adapter_config.json");
  const auto cfg = nlohmann::json::parse(json);
  CHECK(cfg.at("peft_type") == "LORA");
  CHECK(cfg.at("r") == 3);
  CHECK(cfg.at("lora_alpha") == 6.0);
  CHECK(cfg.at("target_modules") == nlohmann::json::array({"q_proj"}));
  CHECK(cfg.at("bias") == "lora_only");
  const auto file = safetensors::File::open(path + "/adapter_model.safetensors");
  const auto keys = file.names();  // sorted
  CHECK(keys == std::vector<std::string>{"base_model.model.q_proj.bias",
                                         "base_model.model.q_proj.lora_A.weight",
                                         "base_model.model.q_proj.lora_B.weight"});
  // A fresh model of the same architecture, adapted the same way, reads them and computes the same.
  torch::manual_seed(1);
  Block again;
  auto lora2 = peft::get_peft_model(again, config);
  auto x = torch::randn({4, 6});
  {
    torch::NoGradGuard no_grad;
    CHECK_FALSE(torch::allclose(again(x), model(x)));
  }
  lora2->load_adapter(path);
  torch::NoGradGuard no_grad;
  CHECK(torch::equal(again(x), model(x)));
  // Another rank is refused, naming both.
  torch::manual_seed(1);
  Block other;
  auto wrong = config;
  wrong.r = 4;
  auto lora3 = peft::get_peft_model(other, wrong);
  CHECK_THROWS_WITH(lora3->load_adapter(path), Contains("r 3") && Contains("r 4"));
}

TEST_CASE("LoRA: under activation checkpointing the adapters get the gradients of the plain run") {
  // The recomputation in backward runs the adapted layers again: the observer must add the term there too,
  // and LoRA's dropout must draw the masks of the first forward (checkpoint restores the RNG state).
  for (const double dropout : {0.0, 0.3}) {
    INFO("lora_dropout " << dropout);
    auto run = [dropout](bool checkpointed) {
      torch::manual_seed(4);
      Block model;
      auto lora = peft::get_peft_model(model, qv_config(dropout));
      randomize_lora_b(*model);
      torch::manual_seed(9);
      const auto x = torch::randn({5, 6}).requires_grad_(true);
      auto out = checkpointed ? checkpoint([&](const torch::Tensor& t) { return model(t); }, x) : model(x);
      out.pow(2).sum().backward();
      std::vector<torch::Tensor> g{out.detach(), x.grad()};
      for (auto& p : model->named_parameters())
        if (p.value().requires_grad()) g.push_back(p.value().grad());
      return g;
    };
    const auto plain = run(false), ckpt = run(true);
    REQUIRE(plain.size() == 6);  // output, input gradient, 2 x (A, B)
    REQUIRE(ckpt.size() == plain.size());
    for (std::size_t k = 0; k < plain.size(); ++k) {
      INFO("tensor " << k);
      REQUIRE(ckpt[k].defined());
      CHECK(torch::allclose(plain[k], ckpt[k], 1e-6, 1e-7));
    }
  }
}

TEST_CASE("LoRA: modules_to_save are trained in full and written to the adapter file under their own names") {
  test::TempDir dir;
  peft::LoraConfig config;
  config.r = 2;
  config.lora_alpha = 4;
  config.target_modules = {"q_proj"};
  config.modules_to_save = {"norm"};
  config.bias = "all";  // norm.bias is both a bias and in a module to save: written once
  torch::manual_seed(2);
  Block model;
  auto lora = peft::get_peft_model(model, config);
  CHECK(model->norm->weight.requires_grad());
  {
    torch::NoGradGuard no_grad;
    model->named_parameters()["q_proj.lora_B.weight"].normal_();
    model->norm->weight.normal_();
    model->norm->bias.normal_();
  }
  const auto path = (dir.path / "adapter").string();
  lora->save_adapter(path);
  const auto keys = safetensors::File::open(path + "/adapter_model.safetensors").names();
  for (const char* key : {"base_model.model.norm.weight", "base_model.model.norm.bias",
                          "base_model.model.q_proj.lora_A.weight"}) {
    INFO(key);
    CHECK(std::find(keys.begin(), keys.end(), key) != keys.end());
  }
  std::ifstream json(path + "/adapter_config.json");
  CHECK(nlohmann::json::parse(json).at("modules_to_save") == nlohmann::json::array({"norm"}));
  // A fresh model of the same architecture gets the saved LayerNorm back with the adapters.
  torch::manual_seed(2);
  Block again;
  auto lora2 = peft::get_peft_model(again, config);
  lora2->load_adapter(path);
  auto x = torch::randn({3, 6});
  torch::NoGradGuard no_grad;
  CHECK(torch::equal(again->norm->weight, model->norm->weight));
  CHECK(torch::equal(again(x), model(x)));
}

// A causal-LM-like model whose head uses its embedding's weight while tied (accel::llm::CausalLM's layout).
struct TiedLmImpl : torch::nn::Module, peft::TiedEmbeddings {
  TiedLmImpl()
      : embed(register_module("embed", torch::nn::Embedding(10, 6))),
        proj(register_module("proj", torch::nn::Linear(6, 6))) {}
  torch::Tensor forward(const torch::Tensor& ids) {
    const auto h = proj(embed(ids));
    return tied ? torch::linear(h, embed->weight)
                : named_children()["lm_head"]->as<torch::nn::Linear>()->forward(h);
  }
  std::pair<std::string, std::string> tied_embeddings() const override {
    return tied ? std::pair<std::string, std::string>{"lm_head", "embed"}
                : std::pair<std::string, std::string>{};
  }
  void untie_word_embeddings() override {
    torch::nn::Linear head(torch::nn::LinearOptions(6, 10).bias(false));
    torch::NoGradGuard no_grad;
    head->weight.set_data(embed->weight.detach().clone());
    register_module("lm_head", head);
    tied = false;
  }
  torch::nn::Embedding embed;
  torch::nn::Linear proj;
  bool tied = true;
};
TORCH_MODULE(TiedLm);

TEST_CASE(
    "LoRA: a tied embedding in modules_to_save trains apart from the frozen head, or tied with "
    "ensure_weight_tying, as PEFT") {
  test::TempDir dir;
  peft::LoraConfig config;
  config.r = 2;
  config.lora_alpha = 4;
  config.target_modules = {"proj"};
  config.modules_to_save = {"embed"};
  const auto ids = torch::tensor({{1, 4, 7}}, torch::kLong);
  auto step = [&](TiedLm& m) {
    auto loss = m(ids).square().mean();
    loss.backward();
    torch::NoGradGuard no_grad;
    for (auto& p : m->parameters())
      if (p.grad().defined()) p.sub_(p.grad());
  };
  torch::manual_seed(3);
  TiedLm untied;
  const auto before = untied->embed->weight.detach().clone();
  auto lora = peft::get_peft_model(untied, config);  // ensure_weight_tying false: PEFT's default
  REQUIRE(untied->named_parameters().contains("lm_head.weight"));
  const auto head = untied->named_parameters()["lm_head.weight"];
  CHECK_FALSE(untied->tied);
  CHECK_FALSE(head.requires_grad());
  CHECK(untied->embed->weight.requires_grad());
  step(untied);
  CHECK(torch::equal(head, before));                         // the head keeps the original weight
  CHECK_FALSE(torch::equal(untied->embed->weight, before));  // the lookup's weight trained
  const auto path = (dir.path / "untied").string();
  lora->save_adapter(path);
  auto keys = safetensors::File::open(path + "/adapter_model.safetensors").names();
  CHECK(std::count(keys.begin(), keys.end(), "base_model.model.embed.weight") == 1);
  CHECK(std::count(keys.begin(), keys.end(), "base_model.model.lm_head.weight") == 0);
  CHECK(nlohmann::json::parse(std::ifstream(path + "/adapter_config.json")).at("ensure_weight_tying") ==
        false);

  config.ensure_weight_tying = true;
  torch::manual_seed(3);
  TiedLm tied;
  auto lora_tied = peft::get_peft_model(tied, config);
  CHECK(tied->tied);
  CHECK_FALSE(tied->named_parameters().contains("lm_head.weight"));
  step(tied);
  const auto tied_path = (dir.path / "tied").string();
  lora_tied->save_adapter(tied_path);
  keys = safetensors::File::open(tied_path + "/adapter_model.safetensors").names();
  CHECK(std::count(keys.begin(), keys.end(), "base_model.model.lm_head.weight") == 1);  // PEFT writes both
  CHECK(std::count(keys.begin(), keys.end(), "base_model.model.embed.weight") == 1);
  // A fresh tied model reads it back (the head's key onto the tied weight) ...
  torch::manual_seed(3);  // the same base (proj is not in the adapter)
  TiedLm again;
  peft::get_peft_model(again, config)->load_adapter(tied_path);
  {
    torch::NoGradGuard no_grad;
    CHECK(torch::equal(again(ids), tied(ids)));
  }
  // ... and a model adapted with the other semantics refuses it, naming the key.
  config.ensure_weight_tying = false;
  TiedLm other;
  auto lora_other = peft::get_peft_model(other, config);
  CHECK_THROWS_WITH(lora_other->load_adapter(tied_path), Contains("ensure_weight_tying true"));
}

TEST_CASE("LoRA: errors name the targets and the model's Linear layers") {
  Block model;
  peft::LoraConfig config;
  config.target_modules = {"k_proj"};
  CHECK_THROWS_WITH(peft::get_peft_model(model, config),
                    Contains("k_proj") && Contains("q_proj, v_proj, out"));
  config.target_modules = {"norm"};
  CHECK_THROWS_WITH(peft::get_peft_model(model, config), Contains("not a torch::nn::Linear"));
  config.target_modules = {};
  config.target_modules_regex = "(q|v)_proj";
  config.r = 0;
  CHECK_THROWS_WITH(peft::get_peft_model(model, config), Contains("r must be at least 1"));
  config.r = 4;
  auto lora = peft::get_peft_model(model, config);
  CHECK(lora->adapted_modules().size() == 2);
  CHECK_THROWS_WITH(peft::get_peft_model(model, config), Contains("already has LoRA adapters"));
}

// Writes, into $ACCEL_PEFT_EXPORT_DIR, a base model's weights, its LoRA adapter in PEFT's format, an input
// and the adapted model's output, for tests/python/check_peft_adapter.py (Python's PEFT loads the adapter
// onto the same architecture and must give the same output). Hidden: run by that CTest entry only.
TEST_CASE("LoRA: export for Python's PEFT", "[.peft_export]") {
  const char* out = std::getenv("ACCEL_PEFT_EXPORT_DIR");
  REQUIRE(out != nullptr);
  torch::manual_seed(3);
  Block model;
  std::vector<std::pair<std::string, torch::Tensor>> base;
  for (const auto& p : model->named_parameters())
    base.emplace_back(p.key(), p.value().detach().clone());
  for (const auto& b : model->named_buffers())
    base.emplace_back(b.key(), b.value().detach().clone());
  peft::LoraConfig config;
  config.r = 4;
  config.lora_alpha = 8;
  config.target_modules = {"q_proj", "v_proj"};
  config.modules_to_save = {"norm"};  // trained in full; PEFT loads it into its copy of the module
  auto lora = peft::get_peft_model(model, config);
  randomize_lora_b(*model, 0.5);
  {
    torch::NoGradGuard no_grad;
    model->norm->weight.normal_(1, 0.5);
    model->norm->bias.normal_(0, 0.5);
  }
  lora->save_adapter(std::string(out) + "/adapter");
  model->eval();
  auto x = torch::randn({5, 6});
  torch::NoGradGuard no_grad;
  auto y = model(x);
  base.emplace_back("__input__", x);
  base.emplace_back("__output__", y);
  // The base weights (and the probe) as safetensors through the library's writer.
  std::vector<safetensors::TensorView> views;
  for (auto& [name, t] : base) {
    t = t.contiguous();
    views.push_back({name, safetensors::DType::F32, std::vector<int64_t>(t.sizes().begin(), t.sizes().end()),
                     t.data_ptr(), static_cast<std::size_t>(t.nbytes())});
  }
  safetensors::write_file(std::string(out) + "/base.safetensors", views);
}

// Reads the adapter Python's PEFT wrote (check_peft_adapter.py, into $ACCEL_PEFT_EXPORT_DIR/from_peft) onto
// the same base model and must give PEFT's output.
TEST_CASE("LoRA: import of Python PEFT's adapter", "[.peft_import]") {
  const char* dir = std::getenv("ACCEL_PEFT_EXPORT_DIR");
  REQUIRE(dir != nullptr);
  const auto base = safetensors::File::open(std::string(dir) + "/base.safetensors");
  const auto probe = safetensors::File::open(std::string(dir) + "/peft_probe.safetensors");
  auto tensor = [](const safetensors::File& f, const std::string& name) {
    const auto& info = f.info(name);
    return torch::from_blob(const_cast<std::uint8_t*>(f.data(name)), info.shape, torch::kFloat32).clone();
  };
  Block model;
  {
    torch::NoGradGuard no_grad;
    for (auto& p : model->named_parameters())
      p.value().copy_(tensor(base, p.key()));
  }
  peft::LoraConfig config;
  config.r = 4;
  config.lora_alpha = 8;
  config.target_modules = {"q_proj", "v_proj"};
  config.modules_to_save = {"norm"};
  auto lora = peft::get_peft_model(model, config);
  lora->load_adapter(std::string(dir) + "/from_peft");
  model->eval();
  torch::NoGradGuard no_grad;
  const auto got = model(tensor(probe, "__input__"));
  const auto want = tensor(probe, "__output__");
  const double err = (got - want).abs().max().item<double>();
  CHECK(err < 1e-5);
  std::cout << "peft_import: the adapter PEFT wrote gives PEFT's output here, max difference " << err
            << std::endl;
}

// Issue 49: README's snippet calls save_adapter on every rank; two ranks raced on one temporary file and died
// with a raw std::filesystem error. Writers at once (threads here, processes in a job) each leave the
// complete files and nothing else, and a directory that cannot be made is a CheckpointError naming it.
TEST_CASE("LoRA: save_adapter from several writers at once leaves one writer's complete files") {
  test::TempDir dir;
  torch::manual_seed(3);
  Block model;
  const auto config = qv_config();
  auto lora = peft::get_peft_model(model, config);
  {
    torch::NoGradGuard no_grad;
    model->named_parameters()["q_proj.lora_B.weight"].normal_();
  }
  const auto path = (dir.path / "adapter").string();
  std::vector<std::thread> writers;
  std::atomic<int> failures{0};
  std::mutex m;
  std::string first_error;
  for (int w = 0; w < 4; ++w) {
    writers.emplace_back([&] {
      for (int i = 0; i < 10; ++i) {
        try {
          lora->save_adapter(path);
        } catch (const std::exception& e) {
          std::lock_guard<std::mutex> lock(m);
          if (failures++ == 0) first_error = e.what();
        }
      }
    });
  }
  for (auto& t : writers)
    t.join();
  INFO(first_error);
  CHECK(failures.load() == 0);
  std::vector<std::string> left;
  for (const auto& e : std::filesystem::directory_iterator(path))
    left.push_back(e.path().filename().string());
  std::sort(left.begin(), left.end());
  CHECK(left == std::vector<std::string>{"adapter_config.json", "adapter_model.safetensors"});
  torch::manual_seed(3);
  Block again;
  auto lora2 = peft::get_peft_model(again, config);
  lora2->load_adapter(path);
  const auto x = torch::randn({3, 6});
  torch::NoGradGuard no_grad;
  CHECK(torch::equal(again(x), model(x)));

  // A path under a regular file: an accel::CheckpointError naming the directory, never std::filesystem's.
  { std::ofstream(dir.path / "file") << "x"; }
  const auto bad = (dir.path / "file" / "adapter").string();
  CHECK_THROWS_MATCHES(
      lora->save_adapter(bad), CheckpointError,
      Catch::Matchers::Predicate<CheckpointError>(
          [&](const CheckpointError& e) { return std::string(e.what()).find(bad) != std::string::npos; },
          "names the directory"));
}

TEST_CASE("LoRA: the adapters keep applying when the handle get_peft_model returned is dropped") {
  // lora.hpp promises that dropping the handle changes nothing: the adapters live in the model. The layers
  // used to be held by the handle alone, so a dropped handle left lora_A / lora_B registered (trainable,
  // saved) but no longer added to the outputs: silently the base model's outputs.
  torch::manual_seed(0);
  Block model;
  peft::get_peft_model(model, qv_config());  // the handle is dropped at once
  randomize_lora_b(*model);
  auto named = model->named_parameters();
  const auto Aq = named["q_proj.lora_A.weight"], Bq = named["q_proj.lora_B.weight"];
  const auto Av = named["v_proj.lora_A.weight"], Bv = named["v_proj.lora_B.weight"];
  const auto x = torch::randn({5, 6});
  const auto got = model(x);
  torch::Tensor want;
  {
    torch::NoGradGuard no_grad;
    want =
        peft_output(model, x, model->q_proj->weight.clone(), model->v_proj->weight.clone(), Aq, Bq, Av, Bv);
  }
  CHECK(torch::allclose(got, want, 1e-5, 1e-6));
  // And the adapters train: the loss reaches them.
  got.pow(2).sum().backward();
  REQUIRE(Bq.grad().defined());
  CHECK(Bq.grad().abs().sum().item<double>() > 0);
}

TEST_CASE(
    "LoRA: adapters of a bf16 base are float32 (autocast_adapter_dtype), summed into the output as PEFT") {
  // PEFT's get_peft_model(autocast_adapter_dtype=True): adapters drawn in float32, moved to the base's bf16,
  // widened to float32 again; Linear.forward: x cast to float32, (result + B A x * s) rounded once to bf16.
  auto make = [](bool autocast) {
    torch::manual_seed(3);
    auto model = std::make_shared<torch::nn::Module>();
    model->register_module("q_proj", torch::nn::Linear(64, 48));
    model->to(torch::kBFloat16);
    peft::LoraConfig config;
    config.r = 4;
    config.lora_alpha = 12;  // scale 3
    config.target_modules = {"q_proj"};
    config.autocast_adapter_dtype = autocast;
    auto lora = peft::get_peft_model(model, config);
    randomize_lora_b(*model, 0.5);
    return std::make_pair(model, lora);
  };
  const auto x = torch::randn({16, 64}).to(torch::kBFloat16);
  for (const bool autocast : {true, false}) {
    auto [model, lora] = make(autocast);
    auto named = model->named_parameters();
    const auto A = named["q_proj.lora_A.weight"], B = named["q_proj.lora_B.weight"];
    CHECK(A.scalar_type() == (autocast ? torch::kFloat32 : torch::kBFloat16));
    CHECK(B.scalar_type() == A.scalar_type());
    CHECK(torch::equal(A, A.to(torch::kBFloat16).to(A.scalar_type())));  // A's values are bf16's
    auto* q = model->named_modules()["q_proj"]->as<torch::nn::Linear>();
    const auto w = q->weight.detach().clone(), b = q->bias.detach().clone();  // unobserved copies
    const auto y = q->forward(x);
    REQUIRE(y.scalar_type() == torch::kBFloat16);
    const auto base = torch::linear(x, w, b);
    const auto term = torch::linear(torch::linear(x.to(A.scalar_type()), A.detach()), B.detach()) * 3.0;
    // PEFT's `(result + term).to(result.dtype)`: one rounding with float32 adapters.
    CHECK(torch::equal(y, (base + term).to(torch::kBFloat16)));
    if (autocast) {
      // The term rounded to bf16 before the add (two roundings) gives other outputs: the check tells them
      // apart.
      CHECK_FALSE(torch::equal(y, base + term.to(torch::kBFloat16)));
    }
    // Gradients reach the adapters in their dtype.
    y.to(torch::kFloat32).pow(2).sum().backward();
    REQUIRE(A.grad().defined());
    CHECK(A.grad().scalar_type() == A.scalar_type());
    CHECK(B.grad().scalar_type() == B.scalar_type());
  }
  // A float32 base: float32 adapters whatever the flag.
  torch::manual_seed(3);
  auto model = std::make_shared<torch::nn::Module>();
  model->register_module("q_proj", torch::nn::Linear(8, 8));
  peft::LoraConfig config;
  config.target_modules = {"q_proj"};
  config.autocast_adapter_dtype = false;
  peft::get_peft_model(model, config);
  CHECK(model->named_parameters()["q_proj.lora_A.weight"].scalar_type() == torch::kFloat32);
}
