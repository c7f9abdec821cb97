// accel::llm::fused_linear_cross_entropy and sft_loss's fused path against the unfused computation
// (torch::linear + causal_lm_loss): loss and every gradient, ignore tokens, packing, tied and untied heads,
// bf16 (weights in bf16, or float32 under bf16 autocast as --bf16 true), a LoRA head falling back; peak CPU
// bytes against the unfused loss; and, with ACCEL_LLM_FUSED_REF_DIR (fused_loss_reference.py), transformers'
// loss and gradients. At the end: the decoder layer's fused RMSNorm and rotary embedding against the unfused
// ops.
#include <ATen/Context.h>
#include <ATen/autocast_mode.h>
#include <ATen/record_function.h>
#include <torch/torch.h>
#include <accel/checkpoint/safetensors.hpp>
#include <accel/distributed/communicator.hpp>
#include <accel/distributed/process_state.hpp>
#include <accel/errors.hpp>
#include <accel/llm/models/causal_lm.hpp>
#include <accel/llm/training/fused_linear_cross_entropy.hpp>
#include <accel/llm/training/sft_batches.hpp>
#include <accel/llm/training/vocab_parallel_loss.hpp>
#include <accel/monitor/memory.hpp>
#include <accel/nn/lora.hpp>

#include <catch2/catch.hpp>

#include "llm/llm_test_fixtures.hpp"
#include "llm/models/fused_layer_ops.hpp"

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <string>
#include <string_view>
#include <tuple>

namespace {

namespace fs = std::filesystem;
namespace llm = accel::llm;
using Catch::Matchers::Contains;

double max_diff(const torch::Tensor& a, const torch::Tensor& b) {
  return (a.to(torch::kFloat32) - b.to(torch::kFloat32)).abs().max().item<double>();
}

// Largest difference relative to the reference's largest magnitude.
double rel_diff(const torch::Tensor& got, const torch::Tensor& want) {
  const double scale = want.to(torch::kFloat32).abs().max().item<double>();
  return max_diff(got, want) / (scale > 0 ? scale : 1.0);
}

using llm_test::tiny_qwen2;

llm::CausalLM random_model(const llm::ModelConfig& config) {
  return llm_test::random_model(config, 5);
}

// Labels with ignored tokens: row 0's first 3 (a prompt), row 1's tail (padding).
torch::Tensor labels_for(const torch::Tensor& ids) {
  auto labels = ids.clone();
  labels.index_put_({0, torch::indexing::Slice(0, 3)}, -100);
  labels.index_put_({1, torch::indexing::Slice(ids.size(1) - 6, torch::indexing::None)}, -100);
  return labels;
}

struct Grads {
  torch::Tensor loss;
  std::map<std::string, torch::Tensor> grads;
};

Grads run(llm::CausalLM& model, const llm::SftTensors& batch, std::optional<std::int64_t> items, bool fused,
          std::int64_t chunk = 0) {
  model->zero_grad();
  auto loss = llm::sft_loss(*model, batch, items,
                            llm::SftLossOptions().fused_linear_cross_entropy(fused).chunk_tokens(chunk));
  loss.backward();
  Grads g{loss.detach(), {}};
  for (const auto& p : model->named_parameters())
    if (p.value().grad().defined()) g.grads[p.key()] = p.value().grad().clone();
  return g;
}

void require_equal(const Grads& fused, const Grads& plain, double loss_tol, double grad_tol) {
  INFO("loss fused " << fused.loss.item<double>() << " unfused " << plain.loss.item<double>());
  CHECK(std::abs(fused.loss.item<double>() - plain.loss.item<double>()) <= loss_tol);
  REQUIRE(fused.grads.size() == plain.grads.size());
  for (const auto& [name, g] : plain.grads) {
    INFO("gradient of " << name);
    REQUIRE(fused.grads.count(name) == 1);
    CHECK(fused.grads.at(name).scalar_type() == g.scalar_type());
    CHECK(rel_diff(fused.grads.at(name), g) <= grad_tol);
  }
}

std::string usage_error(const std::function<void()>& f) {
  try {
    f();
  } catch (const accel::UsageError& e) {
    return e.what();
  }
  return "no error";
}

}  // namespace

TEST_CASE("fused_linear_cross_entropy equals linear + causal_lm_loss: loss, hidden and weight gradients",
          "[llm][fused]") {
  torch::manual_seed(1);
  const auto hidden = torch::randn({2, 9, 16}, torch::requires_grad());
  const auto weight = torch::randn({50, 16}, torch::requires_grad());
  auto labels = torch::randint(0, 50, {2, 9}, torch::kInt64);
  labels.index_put_({0, torch::indexing::Slice(0, 4)}, -100);
  labels.index_put_({1, 7}, -100);
  for (const std::optional<std::int64_t> items :
       {std::optional<std::int64_t>(), std::optional<std::int64_t>(23)}) {
    auto ref = llm::causal_lm_loss(torch::linear(hidden, weight), labels, items);
    const auto ref_grads = torch::autograd::grad({ref}, {hidden, weight});
    for (const std::int64_t chunk : {0, 1, 3, 5, 1000}) {
      INFO("num_items " << (items ? *items : -1) << ", chunk " << chunk);
      auto loss = llm::fused_linear_cross_entropy(hidden, weight, labels, items,
                                                  llm::FusedCrossEntropyOptions().chunk_tokens(chunk));
      CHECK(loss.scalar_type() == torch::kFloat32);
      // float32 sums in another order: a few units in the last place of a loss near 10.
      CHECK(std::abs(loss.item<double>() - ref.item<double>()) <=
            1e-6 * std::max(1.0, std::abs(ref.item<double>())));
      const auto grads = torch::autograd::grad({loss * 3.0}, {hidden, weight});  // a grad_output other than 1
      CHECK(max_diff(grads[0], ref_grads[0] * 3.0) <= 1e-6);
      CHECK(max_diff(grads[1], ref_grads[1] * 3.0) <= 1e-6);
    }
  }
  SECTION("no grad: the loss alone, as the unfused one") {
    torch::NoGradGuard no_grad;
    const auto loss = llm::fused_linear_cross_entropy(hidden, weight, labels);
    CHECK(!loss.requires_grad());
    CHECK(std::abs(loss.item<double>() -
                   llm::causal_lm_loss(torch::linear(hidden, weight), labels).item<double>()) <= 1e-6);
  }
  SECTION("every label ignored: NaN (mean) or 0 (sum), as cross_entropy") {
    const auto none = torch::full({2, 9}, -100, torch::kInt64);
    CHECK(std::isnan(llm::fused_linear_cross_entropy(hidden, weight, none).item<double>()));
    CHECK(std::isnan(llm::causal_lm_loss(torch::linear(hidden, weight), none).item<double>()));
    CHECK(llm::fused_linear_cross_entropy(hidden, weight, none, 4).item<double>() == 0.0);
  }
}

// SFT with masked prompts: most shifted labels are -100 and only the counted rows reach the head. The loss
// and both gradients (the ignored rows' hidden-state gradient zero) must equal the unfused loss over every
// position's logits, also with num_items_in_batch, the vocabulary-parallel twin and a whole row ignored.
TEST_CASE("Mostly ignored labels (masked prompts): the fused losses equal the unfused one", "[llm][fused]") {
  auto solo = accel::Communicator::create(accel::ProcessState(), torch::kCPU);
  torch::manual_seed(11);
  const auto hidden = torch::randn({3, 20, 16}, torch::requires_grad());
  const auto weight = (torch::randn({41, 16}) * 0.5).requires_grad_();
  auto labels = torch::randint(0, 41, {3, 20}, torch::kInt64);
  labels.index_put_({0, torch::indexing::Slice(0, 17)}, -100);  // a long prompt, 3 reply tokens
  labels.index_put_({1}, -100);                                 // a row with nothing counted
  labels.index_put_({2, torch::indexing::Slice(0, 12)}, -100);
  labels.index_put_({2, torch::indexing::Slice(15, torch::indexing::None)}, -100);  // padding after the reply
  REQUIRE(labels.slice(1, 1).ne(-100).sum().item<std::int64_t>() == 6);             // of 57 positions
  for (const std::optional<std::int64_t> items :
       {std::optional<std::int64_t>(), std::optional<std::int64_t>(9)}) {
    const auto want = llm::causal_lm_loss(torch::linear(hidden, weight), labels, items);
    const auto want_g = torch::autograd::grad({want}, {hidden, weight});
    for (const std::int64_t chunk : {0, 2}) {
      INFO("num_items " << (items ? *items : -1) << ", chunk " << chunk);
      const auto opts = llm::FusedCrossEntropyOptions().chunk_tokens(chunk);
      const auto fused = llm::fused_linear_cross_entropy(hidden, weight, labels, items, opts);
      const auto parallel =
          llm::vocab_parallel_fused_linear_cross_entropy(hidden, weight, labels, solo, items, opts);
      for (const auto& loss : {fused, parallel}) {
        CHECK(std::abs(loss.item<double>() - want.item<double>()) <=
              1e-6 * std::max(1.0, std::abs(want.item<double>())));
        const auto g = torch::autograd::grad({loss}, {hidden, weight});
        CHECK(max_diff(g[0], want_g[0]) <= 1e-6);
        CHECK(max_diff(g[1], want_g[1]) <= 1e-6);
        CHECK(g[0][1].abs().max().item<double>() == 0.0);  // the ignored row: no gradient at all
      }
    }
  }
}

TEST_CASE("fused_linear_cross_entropy in bf16: logits in bf16 upcast to float32, as transformers",
          "[llm][fused]") {
  torch::manual_seed(2);
  const auto hidden = torch::randn({2, 12, 32}).to(torch::kBFloat16).requires_grad_();
  const auto weight = (torch::randn({64, 32}) * 0.3).to(torch::kBFloat16).requires_grad_();
  auto labels = torch::randint(0, 64, {2, 12}, torch::kInt64);
  labels.index_put_({1, torch::indexing::Slice(0, 5)}, -100);
  auto ref = llm::causal_lm_loss(torch::linear(hidden, weight), labels);
  const auto ref_grads = torch::autograd::grad({ref}, {hidden, weight});
  auto loss = llm::fused_linear_cross_entropy(hidden, weight, labels, std::nullopt,
                                              llm::FusedCrossEntropyOptions().chunk_tokens(4));
  const auto grads = torch::autograd::grad({loss}, {hidden, weight});
  CHECK(loss.scalar_type() == torch::kFloat32);
  CHECK(grads[0].scalar_type() == torch::kBFloat16);
  CHECK(grads[1].scalar_type() == torch::kBFloat16);
  CHECK(std::abs(loss.item<double>() - ref.item<double>()) <= 1e-5);
  CHECK(rel_diff(grads[0], ref_grads[0]) <= 1e-2);  // bf16 rounding of the products
  CHECK(rel_diff(grads[1], ref_grads[1]) <= 1e-2);
}

// `--bf16 true` (mixed_precision bf16): the Accelerator turns the CPU's autocast on with bfloat16 over
// float32 master weights, so the head's matmuls run in bf16 while the hidden states and the weight stay
// float32 (the finetune recipe crashed here: index_copy_ of a bf16 product into the float32 hidden-state
// gradient). The unfused path (transformers: lm_head under autocast, logits.float(), cross_entropy) is the
// reference: the same bf16 logits, so the loss agrees to float32 summation order, and the gradients come back
// in each input's dtype; their values differ by bf16 rounding of the products (the unfused weight gradient is
// one bf16 matmul over all tokens, the fused one sums per-chunk bf16 products in float32), so 1e-2 of the
// largest magnitude (bf16 keeps 8 significant bits: 2^-8 = 3.9e-3 per rounding).
namespace {
struct BF16Autocast {
  bool enabled = at::autocast::is_autocast_enabled(at::kCPU);
  at::ScalarType dtype = at::autocast::get_autocast_dtype(at::kCPU);
  BF16Autocast() {
    at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
    at::autocast::set_autocast_enabled(at::kCPU, true);
  }
  ~BF16Autocast() {
    at::autocast::set_autocast_enabled(at::kCPU, enabled);
    at::autocast::set_autocast_dtype(at::kCPU, dtype);
    at::autocast::clear_cache();
  }
};
}  // namespace

TEST_CASE(
    "Under bf16 autocast (--bf16 true) the fused losses equal the unfused one, gradients in each "
    "input's dtype",
    "[llm][fused]") {
  auto solo = accel::Communicator::create(accel::ProcessState(), torch::kCPU);
  for (const auto dtype : {torch::kFloat32, torch::kBFloat16}) {  // float32 master weights, or a bf16 model
    torch::manual_seed(12);
    const auto hidden = torch::randn({2, 12, 32}).to(dtype).requires_grad_();
    const auto weight = (torch::randn({64, 32}) * 0.3).to(dtype).requires_grad_();
    auto labels = torch::randint(0, 64, {2, 12}, torch::kInt64);
    labels.index_put_({1, torch::indexing::Slice(0, 5)}, -100);
    BF16Autocast autocast;
    const auto ref = llm::causal_lm_loss(torch::linear(hidden, weight), labels);
    const auto ref_grads = torch::autograd::grad({ref}, {hidden, weight});
    REQUIRE(ref_grads[0].scalar_type() == dtype);
    for (const std::int64_t chunk : {0, 5}) {
      const auto opts = llm::FusedCrossEntropyOptions().chunk_tokens(chunk);
      const auto fused = llm::fused_linear_cross_entropy(hidden, weight, labels, std::nullopt, opts);
      const auto parallel =
          llm::vocab_parallel_fused_linear_cross_entropy(hidden, weight, labels, solo, std::nullopt, opts);
      const auto unfused_parallel =
          llm::vocab_parallel_causal_lm_loss(torch::linear(hidden, weight), labels, solo);
      for (const auto& loss : {fused, parallel, unfused_parallel}) {
        INFO(c10::toString(dtype) << ", chunk " << chunk << ", loss " << loss.item<double>() << " unfused "
                                  << ref.item<double>());
        CHECK(loss.scalar_type() == torch::kFloat32);
        // The same bf16 logits upcast: float32 sums in another order.
        CHECK(std::abs(loss.item<double>() - ref.item<double>()) <= 1e-5);
        const auto g = torch::autograd::grad({loss}, {hidden, weight});
        CHECK(g[0].scalar_type() == dtype);
        CHECK(g[1].scalar_type() == dtype);
        CHECK(rel_diff(g[0], ref_grads[0]) <= 1e-2);
        CHECK(rel_diff(g[1], ref_grads[1]) <= 1e-2);
      }
    }
  }
}

TEST_CASE("sft_loss under bf16 autocast (--bf16 true): fused equals unfused on a float32 model",
          "[llm][fused]") {
  for (const bool tied : {true, false}) {
    INFO((tied ? "tied" : "untied"));
    auto model = random_model(tiny_qwen2(tied));
    model->train();
    const auto ids = torch::randint(1, 97, {2, 16}, torch::kInt64);
    const llm::SftTensors batch{ids, labels_for(ids), torch::ones({2, 16}, torch::kInt64),
                                torch::empty({0}, torch::kInt64)};
    BF16Autocast autocast;
    const auto plain = run(model, batch, std::nullopt, false);
    for (const auto& [name, g] : plain.grads)
      CHECK(g.scalar_type() == torch::kFloat32);
    // The rest of the model is the same computation on both sides; the head's bf16 rounding as above.
    require_equal(run(model, batch, std::nullopt, true, 5), plain, 1e-5, 1e-2);
    require_equal(run(model, batch, std::nullopt, true, 0), plain, 1e-5, 1e-2);
  }
}

TEST_CASE(
    "sft_loss fused equals unfused on a model: every parameter's gradient, tied and untied, padded and "
    "packed",
    "[llm][fused]") {
  for (const bool tied : {true, false}) {
    auto model = random_model(tiny_qwen2(tied));
    model->train();
    const auto ids = torch::randint(1, 97, {2, 20}, torch::kInt64);
    auto mask = torch::ones({2, 20}, torch::kInt64);
    mask.index_put_({1, torch::indexing::Slice(14, torch::indexing::None)}, 0);
    const llm::SftTensors padded{ids, labels_for(ids), mask, torch::empty({0}, torch::kInt64)};
    // Padding-free: two documents per row, positions restarting at 0, -100 at each document's first label.
    const auto pos =
        torch::cat({torch::arange(8), torch::arange(12)}).unsqueeze(0).expand({2, 20}).contiguous();
    auto packed_labels = ids.clone();
    packed_labels.index_put_({torch::indexing::Slice(), 0}, -100);
    packed_labels.index_put_({torch::indexing::Slice(), 8}, -100);
    const llm::SftTensors packed{ids, packed_labels, torch::empty({0}, torch::kInt64), pos};
    for (const auto* batch : {&padded, &packed}) {
      for (const std::optional<std::int64_t> items :
           {std::optional<std::int64_t>(), std::optional<std::int64_t>(50)}) {
        INFO((tied ? "tied" : "untied")
             << (batch == &padded ? ", padded" : ", packed") << (items ? ", num_items 50" : ", mean"));
        const auto plain = run(model, *batch, items, false);
        CHECK(plain.grads.size() == model->parameters().size());
        require_equal(run(model, *batch, items, true, 7), plain, 1e-6, 1e-5);
        require_equal(run(model, *batch, items, true, 0), plain, 1e-6, 1e-5);
      }
    }
    CHECK(llm::plain_head_weight(*model).is_same(model->output_weight()));
  }
}

TEST_CASE(
    "sft_loss with LoRA: adapters off the head use the fused loss, a LoRA head falls back to the logits",
    "[llm][fused]") {
  for (const std::string target : {"q_proj", "lm_head"}) {
    INFO("LoRA on " << target);
    auto model = random_model(tiny_qwen2(false));
    const auto lora = llm_test::lora_on(model, target);
    model->train();
    CHECK(llm::plain_head_weight(*model).defined() == (target != "lm_head"));
    const auto ids = torch::randint(1, 97, {2, 16}, torch::kInt64);
    const llm::SftTensors batch{ids, labels_for(ids), torch::ones({2, 16}, torch::kInt64),
                                torch::empty({0}, torch::kInt64)};
    const auto plain = run(model, batch, std::nullopt, false);
    // A and B of v_proj and q_proj in each of 2 layers, or of v_proj's 2 and the head.
    CHECK(plain.grads.size() == (target == "lm_head" ? 6u : 8u));
    require_equal(run(model, batch, std::nullopt, true, 5), plain, 1e-6, 1e-5);
  }
}

// The vocabulary-parallel losses (tensor parallelism with vocab_parallel) over a group of one hold the whole
// head: their arithmetic (global max, sum of exponentials, target logit, softmax - one-hot) must give the
// whole head's loss and gradients. The group of 2 runs in autotp_equivalence.py against one process.
TEST_CASE("vocab_parallel losses over a group of one equal the whole head's loss and gradients",
          "[llm][fused]") {
  auto solo = accel::Communicator::create(accel::ProcessState(), torch::kCPU);
  torch::manual_seed(3);
  const auto hidden = torch::randn({2, 9, 16}).requires_grad_();
  const auto weight = (torch::randn({37, 16}) * 0.5).requires_grad_();
  const auto labels = labels_for(torch::randint(0, 37, {2, 9}));
  for (const std::optional<std::int64_t> items :
       {std::optional<std::int64_t>(), std::optional<std::int64_t>(20)}) {
    const auto grads = [&](const torch::Tensor& loss) {
      return torch::autograd::grad({loss}, {hidden, weight});
    };
    const auto want = llm::causal_lm_loss(torch::linear(hidden, weight), labels, items);
    const auto want_g = grads(want);
    const auto fused = llm::vocab_parallel_fused_linear_cross_entropy(
        hidden, weight, labels, solo, items, llm::FusedCrossEntropyOptions().chunk_tokens(5));
    const auto fused_g = grads(fused);
    const auto unfused =
        llm::vocab_parallel_causal_lm_loss(torch::linear(hidden, weight), labels, solo, items);
    const auto unfused_g = grads(unfused);
    INFO("num_items_in_batch " << (items ? std::to_string(*items) : "none"));
    CHECK(max_diff(fused, want) < 1e-5);
    CHECK(max_diff(unfused, want) < 1e-5);
    for (std::size_t i = 0; i < 2; ++i) {
      CHECK(rel_diff(fused_g[i], want_g[i]) < 1e-5);
      CHECK(rel_diff(unfused_g[i], want_g[i]) < 1e-5);
    }
  }
  const auto ignored = torch::full({2, 9}, -100, torch::kInt64);
  CHECK(
      llm::vocab_parallel_causal_lm_loss(torch::linear(hidden, weight), ignored, solo).isnan().item<bool>());
  auto bad = labels.clone();
  bad.index_put_({0, 5}, 37);
  CHECK_THROWS_WITH(llm::vocab_parallel_fused_linear_cross_entropy(hidden, weight, bad, solo),
                    Contains("label 37 is outside the vocabulary [0, 37)"));
  CHECK_THROWS_WITH(llm::vocab_parallel_causal_lm_loss(torch::linear(hidden, weight), bad, solo),
                    Contains("label 37 is outside the vocabulary [0, 37)"));
  CHECK_THROWS_WITH(llm::vocab_parallel_causal_lm_loss(torch::linear(hidden, weight), labels, nullptr),
                    Contains("tensor-parallel group is null"));
}

TEST_CASE("fused_linear_cross_entropy refuses bad input, naming the value and the fix", "[llm][fused]") {
  const auto hidden = torch::randn({1, 4, 8}, torch::requires_grad());
  const auto weight = torch::randn({10, 8});
  CHECK_THAT(usage_error([&] {
               llm::fused_linear_cross_entropy(hidden, weight, torch::tensor({{1, 2, 10, 3}}));
             }),
             Contains("label 10 is outside the vocabulary [0, 10)"));
  CHECK_THAT(usage_error([&] {
               llm::fused_linear_cross_entropy(hidden, weight.to(torch::kBFloat16),
                                               torch::ones({1, 4}, torch::kInt64));
             }),
             Contains("one floating dtype"));
  CHECK_THAT(usage_error([&] {
               llm::fused_linear_cross_entropy(hidden, weight, torch::ones({1, 5}, torch::kInt64));
             }),
             Contains("shapes do not agree"));
  CHECK_THAT(usage_error([&] {
               llm::fused_linear_cross_entropy(hidden, weight, torch::ones({1, 4}, torch::kInt64),
                                               std::nullopt,
                                               llm::FusedCrossEntropyOptions().chunk_tokens(-1));
             }),
             Contains("chunk_tokens must be 0 (automatic) or positive, got -1"));
  auto loss = llm::fused_linear_cross_entropy(hidden, weight, torch::ones({1, 4}, torch::kInt64));
  loss.backward({}, /*retain_graph=*/true);
  CHECK_THAT(usage_error([&] { loss.backward(); }), Contains("a second time (retain_graph)"));
}

namespace {

// Peak CPU bytes above what is allocated before, of one forward + backward through sft_loss; `seconds` gets
// its wall time.
std::uint64_t peak_bytes(llm::CausalLM& model, const llm::SftTensors& batch, bool fused, std::int64_t chunk,
                         double* seconds) {
  model->zero_grad(/*set_to_none=*/true);
  const auto before = accel::CpuMemoryCounter::current();
  accel::CpuMemoryCounter::reset_peak();
  const auto start = std::chrono::steady_clock::now();
  llm::sft_loss(*model, batch, std::nullopt,
                llm::SftLossOptions().fused_linear_cross_entropy(fused).chunk_tokens(chunk))
      .backward();
  *seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const auto peak = accel::CpuMemoryCounter::peak() - before;
  model->zero_grad(/*set_to_none=*/true);
  return peak;
}

void measure(std::int64_t vocab, std::int64_t hidden, std::int64_t layers, std::int64_t batch,
             std::int64_t length, bool tied, std::int64_t chunk, double* ratio) {
  accel::CpuMemoryCounter::install();
  const auto config = llm::ModelConfig::from_json(
      R"({"model_type": "qwen2", "vocab_size": )" + std::to_string(vocab) + R"(, "hidden_size": )" +
          std::to_string(hidden) + R"(, "intermediate_size": )" + std::to_string(hidden * 2) +
          R"(, "num_hidden_layers": )" + std::to_string(layers) +
          R"(, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 4096,
          "tie_word_embeddings": )" +
          (tied ? "true" : "false") + "}",
      "memory.json");
  auto model = random_model(config);
  model->train();
  const auto ids = torch::randint(0, vocab, {batch, length}, torch::kInt64);
  const llm::SftTensors b{ids, ids, torch::ones({batch, length}, torch::kInt64),
                          torch::empty({0}, torch::kInt64)};
  double t_unfused = 0, t_fused = 0;
  const auto unfused = peak_bytes(model, b, false, 0, &t_unfused);
  const auto fused = peak_bytes(model, b, true, chunk, &t_fused);
  const double mib = 1024.0 * 1024.0;
  std::cout << "fused loss memory: vocab " << vocab << ", hidden " << hidden << ", " << layers << " layers, "
            << (tied ? "tied" : "untied") << ", batch " << batch << " x " << length << " tokens: peak "
            << static_cast<double>(unfused) / mib << " MiB unfused, " << static_cast<double>(fused) / mib
            << " MiB fused (" << static_cast<double>(fused) / static_cast<double>(unfused)
            << "x); logits alone " << static_cast<double>(batch * length * vocab * 4) / mib
            << " MiB; forward + backward " << t_unfused << " s unfused, " << t_fused << " s fused"
            << std::endl;
  *ratio = static_cast<double>(fused) / static_cast<double>(unfused);
}

}  // namespace

TEST_CASE("The fused loss needs a fraction of the unfused loss's peak memory on a large vocabulary",
          "[llm][fused][memory]") {
  // 32,768 tokens of vocabulary, 2 x 256 tokens in chunks of 128 (the automatic size would take them in one):
  // the logits are 64 MiB, their log-softmax and gradient as much.
  double ratio = 1.0;
  measure(32768, 64, 1, 2, 256, /*tied=*/true, /*chunk=*/128, &ratio);
  CHECK(ratio <= 0.5);
}

TEST_CASE("Peak memory of one training step, Qwen2.5-0.5B's head (ACCEL_FUSED_MEMORY_LAYERS, _LENGTH)",
          "[.qwen_memory]") {
  // Qwen2.5-0.5B's vocabulary and width (151,936 x 896, tied), its 24 layers or fewer.
  const char* layers = std::getenv("ACCEL_FUSED_MEMORY_LAYERS");
  const char* length = std::getenv("ACCEL_FUSED_MEMORY_LENGTH");
  double ratio = 1.0;
  measure(151936, 896, layers ? std::atoll(layers) : 2, 1, length ? std::atoll(length) : 2048, true,
          /*chunk=*/0, &ratio);
  CHECK(ratio < 1.0);
}

namespace {

std::map<std::string, torch::Tensor> load_tensors(const std::string& path) {
  return llm_test::load_reference_tensors(path);
}

}  // namespace

TEST_CASE("The fused loss and its gradients equal transformers' (ACCEL_LLM_FUSED_REF_DIR)", "[.hf]") {
  const char* env = std::getenv("ACCEL_LLM_FUSED_REF_DIR");
  REQUIRE(env != nullptr);
  const fs::path root(env);
  std::ifstream list(root / "cases.txt");
  std::string name;
  int cases = 0;
  double worst_loss = 0, worst_grad = 0;
  while (list >> name) {
    INFO("case " << name);
    const auto ref = load_tensors((root / name / "reference.safetensors").string());
    const bool bf16 = name.find("bf16") != std::string::npos;
    auto model = llm::from_pretrained((root / name / "model").string(),
                                      llm::LoadOptions().dtype(bf16 ? torch::kBFloat16 : torch::kFloat32));
    model->train();
    const auto empty = torch::empty({0}, torch::kInt64);
    const llm::SftTensors batch{ref.at("input_ids"), ref.at("labels"),
                                ref.count("attention_mask") ? ref.at("attention_mask") : empty,
                                ref.count("position_ids") ? ref.at("position_ids") : empty};
    std::optional<std::int64_t> items;
    if (ref.count("num_items_in_batch")) items = ref.at("num_items_in_batch").item<std::int64_t>();
    const auto got = run(model, batch, items, true, 5);
    const double dl = std::abs(got.loss.item<double>() - ref.at("loss").item<double>());
    worst_loss = std::max(worst_loss, dl);
    CHECK(dl <= (bf16 ? 2e-2 : 1e-5));
    for (const auto& [key, value] : ref) {
      if (key.rfind("grad.", 0) != 0) continue;
      INFO("gradient of " << key.substr(5));
      REQUIRE(got.grads.count(key.substr(5)) == 1);
      const double d = rel_diff(got.grads.at(key.substr(5)), value);
      if (!bf16) worst_grad = std::max(worst_grad, d);
      CHECK(d <= (bf16 ? 5e-2 : 1e-4));
    }
    ++cases;
  }
  CHECK(cases >= 4);
  std::cout << "hf: " << cases << " cases: fused loss equals transformers' (max |diff| fp32/bf16 "
            << worst_loss << "), every gradient (fp32, max relative diff " << worst_grad << ")" << std::endl;
}

TEST_CASE("Time of the head's loss, fused (chunk sizes) against unfused (ACCEL_FUSED_SPEED_LENGTH)",
          "[.fused_speed]") {
  // Qwen2.5-0.5B's head (151,936 x 896) on one row, weight trained (full fine-tuning) or frozen (LoRA).
  // ACCEL_FUSED_SPEED_MASKED: the fraction of leading labels set to -100 (a masked prompt); the unfused loss
  // still takes every position's logits, the fused one only the counted rows'.
  const char* env = std::getenv("ACCEL_FUSED_SPEED_LENGTH");
  const char* masked_env = std::getenv("ACCEL_FUSED_SPEED_MASKED");
  const std::int64_t length = env ? std::atoll(env) : 1024;
  const double masked = masked_env ? std::atof(masked_env) : 0.0;
  torch::manual_seed(0);
  auto ids = torch::randint(0, 151936, {1, length}, torch::kInt64);
  ids.index_put_({0, torch::indexing::Slice(0, static_cast<std::int64_t>(masked * length))}, -100);
  std::cout << "masked prompt fraction " << masked << std::endl;
  for (const bool train_weight : {true, false}) {
    const auto hidden = torch::randn({1, length, 896}, torch::requires_grad());
    const auto weight = (torch::randn({151936, 896}) * 0.02).requires_grad_(train_weight);
    auto time = [&](const std::function<torch::Tensor()>& loss) {
      const auto c0 = std::clock();
      const auto w0 = std::chrono::steady_clock::now();
      loss().backward();
      const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - w0).count();
      const double cpu = static_cast<double>(std::clock() - c0) / CLOCKS_PER_SEC;
      hidden.mutable_grad() = torch::Tensor();
      if (train_weight) weight.mutable_grad() = torch::Tensor();
      return std::make_pair(wall, cpu);
    };
    const auto unfused = time([&] { return llm::causal_lm_loss(torch::linear(hidden, weight), ids); });
    std::cout << "head loss, " << length << " tokens, weight " << (train_weight ? "trained" : "frozen")
              << ": unfused " << unfused.first << " s wall, " << unfused.second << " s cpu" << std::endl;
    // With a masked prompt: the automatic chunks only.
    const auto chunks =
        masked_env ? std::vector<std::int64_t>{0} : std::vector<std::int64_t>{0, 64, 256, 1024, 2048};
    for (const std::int64_t chunk : chunks) {
      const auto fused = time([&] {
        return llm::fused_linear_cross_entropy(hidden, weight, ids, std::nullopt,
                                               llm::FusedCrossEntropyOptions().chunk_tokens(chunk));
      });
      std::cout << "  fused chunk " << chunk << ": " << fused.first << " s wall, " << fused.second << " s cpu"
                << std::endl;
    }
  }
}

// ---- The decoder layer's fused RMSNorm and rotary embedding (llm/models/fused_layer_ops.hpp) against the
// unfused ops they replace (transformers' Qwen2RMSNorm and apply_rotary_pos_emb, written out here): the same
// forward values, gradients within float32 rounding.

namespace {

namespace fused = accel::llm::detail;

torch::Tensor reference_rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  auto h = x.to(torch::kFloat32);
  h = h * torch::rsqrt(h.pow(2).mean(-1, true) + eps);
  return weight * h.to(x.scalar_type());
}

torch::Tensor reference_rotary(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  const auto half = x.size(-1) / 2;
  return x * cos + torch::cat({-x.slice(-1, half), x.slice(-1, 0, half)}, -1) * sin;
}

// Output and gradients of `f` on `inputs` (those requiring grad) against `reference`, with the same
// upstream gradient.
void compare(const std::function<torch::Tensor()>& f, const std::function<torch::Tensor()>& reference,
             const std::vector<torch::Tensor>& inputs, double grad_tol) {
  const auto got = f(), want = reference();
  REQUIRE(got.sizes() == want.sizes());
  REQUIRE(got.scalar_type() == want.scalar_type());
  CHECK(torch::equal(got, want));  // the same ATen ops forward: bit for bit
  const auto upstream = torch::randn_like(want);
  const auto g = torch::autograd::grad({got}, inputs, {upstream});
  const auto w = torch::autograd::grad({want}, inputs, {upstream});
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    INFO("input " << i);
    REQUIRE(g[i].scalar_type() == w[i].scalar_type());
    CHECK(max_diff(g[i], w[i]) <= grad_tol * std::max(1.0, w[i].abs().max().item<double>()));
  }
}

}  // namespace

TEST_CASE("Fused RMSNorm equals transformers' unfused ops: values, input and weight gradients",
          "[llm][fused]") {
  torch::manual_seed(5);
  SECTION("float32, weight trained; a [B, T, heads, D] input as Qwen3's q_norm") {
    for (const auto& shape : {std::vector<std::int64_t>{2, 7, 48}, std::vector<std::int64_t>{2, 5, 3, 16}}) {
      const auto x = (torch::randn(shape) * 3.0).requires_grad_();
      const auto w = (torch::rand({shape.back()}) + 0.5).requires_grad_();
      compare([&] { return fused::rms_norm(x, w, 1e-6); }, [&] { return reference_rms_norm(x, w, 1e-6); },
              {x, w}, 1e-6);
    }
  }
  SECTION("float32, weight frozen (LoRA): no weight gradient is computed") {
    const auto x = torch::randn({3, 4, 32}).requires_grad_();
    const auto w = torch::rand({32}) + 0.5;
    compare([&] { return fused::rms_norm(x, w, 1e-5); }, [&] { return reference_rms_norm(x, w, 1e-5); }, {x},
            1e-6);
  }
  SECTION("bf16: float32 statistics, the normalized values cast before the weight, as transformers") {
    const auto x = torch::randn({2, 6, 64}).to(torch::kBFloat16).requires_grad_();
    const auto w = (torch::rand({64}) + 0.5).to(torch::kBFloat16).requires_grad_();
    // bf16 gradients: the same float32 math rounded to 8 bits; the weight's sums run in another order.
    compare([&] { return fused::rms_norm(x, w, 1e-6); }, [&] { return reference_rms_norm(x, w, 1e-6); },
            {x, w}, 1e-2);
  }
  SECTION("a second derivative (create_graph) through the closed-form backward") {
    const auto x = torch::randn({2, 3, 16}).requires_grad_();
    const auto w = (torch::rand({16}) + 0.5).requires_grad_();
    auto twice = [&](const torch::Tensor& y) {
      const auto g = torch::autograd::grad({y.pow(2).sum()}, {x, w}, {}, true, true);
      return torch::autograd::grad({g[0].pow(2).sum() + g[1].pow(2).sum()}, {x, w});
    };
    const auto got = twice(fused::rms_norm(x, w, 1e-6)), want = twice(reference_rms_norm(x, w, 1e-6));
    CHECK(max_diff(got[0], want[0]) <= 1e-4 * std::max(1.0, want[0].abs().max().item<double>()));
    CHECK(max_diff(got[1], want[1]) <= 1e-4 * std::max(1.0, want[1].abs().max().item<double>()));
  }
  SECTION("under no_grad: the plain value") {
    torch::NoGradGuard no_grad;
    const auto x = torch::randn({2, 3, 8});
    const auto w = torch::rand({8});
    CHECK(torch::equal(fused::rms_norm(x, w, 1e-6), reference_rms_norm(x, w, 1e-6)));
  }
}

TEST_CASE("Fused rotary embedding equals x * cos + rotate_half(x) * sin and its gradient", "[llm][fused]") {
  torch::manual_seed(6);
  const auto x = torch::randn({2, 5, 3, 8}).transpose(1, 2).requires_grad_();  // [B, heads, T, D], strided
  const auto cos = torch::randn({2, 1, 5, 8}), sin = torch::randn({2, 1, 5, 8});
  compare([&] { return fused::apply_rotary(x, cos, sin); }, [&] { return reference_rotary(x, cos, sin); },
          {x}, 1e-6);
  SECTION("tables that require grad take the unfused ops (their gradient too)") {
    const auto c = cos.clone().requires_grad_();
    compare([&] { return fused::apply_rotary(x, c, sin); }, [&] { return reference_rotary(x, c, sin); },
            {x, c}, 1e-6);
  }
}

// ---- detail::linear's oneDNN products (fused_layer_ops.hpp): the forward, the input gradient g W of its
// backward and of the fused loss (detail::linear_input_grad), within float32 rounding of at::linear's / mm's;
// with oneDNN off (as ACCEL_ONEDNN_LINEAR=0 or torch.backends.mkldnn off) at::linear's and mm's bit for bit.

namespace {

// Counts oneDNN's linear (mkldnn::_linear_pointwise) on this thread while it lives (a CPU backward runs on
// the calling thread).
class OneDnnCounter {
 public:
  OneDnnCounter() {
    count_ = 0;
    handle_ = at::addThreadLocalCallback(
        at::RecordFunctionCallback([](const at::RecordFunction& fn) -> std::unique_ptr<at::ObserverContext> {
          if (std::string_view(fn.name()) == "mkldnn::_linear_pointwise") ++count_;
          return nullptr;
        }).scopes({at::RecordScope::FUNCTION}));
  }
  ~OneDnnCounter() { at::removeCallback(handle_); }
  OneDnnCounter(const OneDnnCounter&) = delete;
  OneDnnCounter& operator=(const OneDnnCounter&) = delete;
  static int count() { return count_; }

 private:
  at::CallbackHandle handle_ = 0;
  static inline std::atomic<int> count_{0};
};

// torch.backends.mkldnn off for its lifetime: detail::linear's fallback, the path ACCEL_ONEDNN_LINEAR=0
// takes.
struct OneDnnOff {
  const bool was = at::globalContext().userEnabledMkldnn();
  OneDnnOff() { at::globalContext().setUserEnabledMkldnn(false); }
  ~OneDnnOff() { at::globalContext().setUserEnabledMkldnn(was); }
  OneDnnOff(const OneDnnOff&) = delete;
  OneDnnOff& operator=(const OneDnnOff&) = delete;
};

bool onednn_available() {
  return at::hasMKLDNN() && at::globalContext().userEnabledMkldnn() &&
         std::getenv("ACCEL_ONEDNN_LINEAR") == nullptr;
}

}  // namespace

TEST_CASE(
    "detail::linear's backward takes the input gradient g W from oneDNN, within float32 rounding of "
    "at::linear's; oneDNN off: at::linear's bit for bit",
    "[llm][fused]") {
  torch::manual_seed(7);
  const auto x = torch::randn({3, 40, 96}, torch::requires_grad());
  const auto w = (torch::randn({200, 96}) * 0.1).requires_grad_();
  const auto b = torch::randn({200}, torch::requires_grad());
  const auto g = torch::randn({3, 40, 200});
  const auto want_y = torch::linear(x, w, b);
  const auto want = torch::autograd::grad({want_y}, {x, w, b}, {g});
  SECTION("oneDNN on: forward and both products of the input gradient on oneDNN, values within rounding") {
    // Without oneDNN (or with ACCEL_ONEDNN_LINEAR set) the next sections still run: no return here.
    const bool on = onednn_available();
    if (!on) WARN("skipped: this LibTorch has no oneDNN, or ACCEL_ONEDNN_LINEAR is set");
    OneDnnCounter counter;
    if (on) {
      const auto y = accel::llm::detail::linear(x, w, b);
      CHECK(OneDnnCounter::count() == 1);
      const auto got = torch::autograd::grad({y}, {x, w, b}, {g});
      CHECK(OneDnnCounter::count() == 2);  // g W by oneDNN; g^T x (MKL's mm) is not counted
      CHECK(rel_diff(y, want_y) <= 1e-6);
      for (std::size_t k = 0; k < want.size(); ++k) {
        INFO("gradient " << k);
        CHECK(rel_diff(got[k], want[k]) <= 1e-6);
      }
      // The input gradient alone, as the fused loss's backward calls it: [N, out] and [..., out] alike.
      CHECK(rel_diff(accel::llm::detail::linear_input_grad(g, w.detach()),
                     g.reshape({-1, 200}).mm(w.detach())) <= 1e-6);
      CHECK(OneDnnCounter::count() == 3);
      // A weight that is a view at an offset (a tensor-parallel row slice of a larger head): oneDNN reads
      // it from its first element, not the storage's (review R2); a column slice is strided: mm, bitwise.
      const auto big = torch::randn({500, 96});
      const auto rows = big.narrow(0, 250, 200);
      CHECK(rel_diff(accel::llm::detail::linear_input_grad(g, rows), g.reshape({-1, 200}).mm(rows)) <= 1e-6);
      CHECK(OneDnnCounter::count() == 4);
      const auto cols = torch::randn({200, 150}).narrow(1, 30, 96);
      CHECK(torch::equal(accel::llm::detail::linear_input_grad(g, cols), g.reshape({-1, 200}).mm(cols)));
      CHECK(OneDnnCounter::count() == 4);
    }
  }
  SECTION("oneDNN off: forward, gradients and linear_input_grad are at::linear's and mm's, bit for bit") {
    OneDnnOff off;
    OneDnnCounter counter;
    const auto y = accel::llm::detail::linear(x, w, b);
    const auto got = torch::autograd::grad({y}, {x, w, b}, {g});
    CHECK(torch::equal(y, want_y));
    for (std::size_t k = 0; k < want.size(); ++k)
      CHECK(torch::equal(got[k], want[k]));
    const auto g2 = g.reshape({-1, 200});
    CHECK(torch::equal(accel::llm::detail::linear_input_grad(g2, w.detach()), g2.mm(w.detach())));
    CHECK(OneDnnCounter::count() == 0);
  }
  SECTION("a second derivative (create_graph) through detail::linear equals at::linear's") {
    // The backward of a backward (gradient penalties, Hessian-vector products): the first backward's g W
    // must stay differentiable in g and W. oneDNN's op has no autograd formula (LibTorch only warns and
    // drops its inputs' gradients), so there the product must be mm's.
    auto twice = [&](const std::function<torch::Tensor()>& f) {
      const auto y = f();
      const auto first = torch::autograd::grad({y.pow(2).sum()}, {x, w}, {}, true, true);
      return torch::autograd::grad({first[0].pow(2).sum() + first[1].pow(2).sum()}, {x, w, b});
    };
    const auto want2 = twice([&] { return torch::linear(x, w, b); });
    const auto got2 = twice([&] { return accel::llm::detail::linear(x, w, b); });
    for (std::size_t k = 0; k < want2.size(); ++k) {
      INFO("second derivative " << k);
      CHECK(rel_diff(got2[k], want2[k]) <= 1e-5);
    }
    // Asked for directly, with a g that requires grad: mm's value (and a graph) wherever oneDNN is on.
    const auto gg = g.reshape({-1, 200}).clone().requires_grad_();
    const auto product = accel::llm::detail::linear_input_grad(gg, w);
    CHECK(product.requires_grad());
    const auto d = torch::autograd::grad({product.sum()}, {gg, w});
    CHECK(rel_diff(d[0], torch::ones_like(product).mm(w.detach().t())) <= 1e-6);
    CHECK(rel_diff(d[1], gg.detach().t().mm(torch::ones_like(product))) <= 1e-6);
  }
  SECTION("a strided g, bf16 and an empty g take mm, bit for bit") {
    OneDnnCounter counter;
    const auto gt = torch::randn({200, 120}).t();  // [120, 200], not contiguous
    CHECK(torch::equal(accel::llm::detail::linear_input_grad(gt, w.detach()), gt.mm(w.detach())));
    const auto gb = g.reshape({-1, 200}).to(torch::kBFloat16);
    const auto wb = w.detach().to(torch::kBFloat16);
    CHECK(torch::equal(accel::llm::detail::linear_input_grad(gb, wb), gb.mm(wb)));
    CHECK(accel::llm::detail::linear_input_grad(torch::zeros({0, 200}), w.detach()).sizes() ==
          torch::IntArrayRef({0, 96}));
    CHECK(OneDnnCounter::count() == 0);
  }
}

TEST_CASE(
    "The fused loss's head products run on oneDNN in float32 (logits and the hidden states' gradient); "
    "oneDNN off: at::linear and mm",
    "[llm][fused]") {
  torch::manual_seed(8);
  const auto hidden = torch::randn({2, 30, 64}, torch::requires_grad());
  const auto weight = (torch::randn({300, 64}) * 0.1).requires_grad_();
  const auto labels = torch::randint(0, 300, {2, 30}, torch::kInt64);
  auto run = [&] {
    OneDnnCounter counter;
    const auto loss = llm::fused_linear_cross_entropy(hidden, weight, labels, std::nullopt,
                                                      llm::FusedCrossEntropyOptions().chunk_tokens(25));
    const auto grads = torch::autograd::grad({loss}, {hidden, weight});
    return std::make_tuple(loss, grads[0], grads[1], OneDnnCounter::count());
  };
  const auto [loss_off, gh_off, gw_off, n_off] = [&] {
    OneDnnOff off;
    return run();
  }();
  CHECK(n_off == 0);
  if (!onednn_available()) {
    WARN("skipped: this LibTorch has no oneDNN, or ACCEL_ONEDNN_LINEAR is set");
    return;
  }
  const auto [loss, gh, gw, n] = run();
  CHECK(n == 2 * 3);  // 58 counted tokens in 3 chunks (balanced: 25, 25, 8): logits and g W per chunk
  CHECK(std::abs(loss.item<double>() - loss_off.item<double>()) <= 1e-6 * std::abs(loss_off.item<double>()));
  CHECK(rel_diff(gh, gh_off) <= 1e-5);
  CHECK(rel_diff(gw, gw_off) <= 1e-5);
}

TEST_CASE("CPU time of the fused RMSNorm and rotary embedding against the unfused ops",
          "[.layer_ops_speed]") {
  // Qwen2.5-0.5B's shapes at 512 tokens: hidden 896, 14 query heads of 64; forward and backward, interleaved.
  torch::manual_seed(0);
  const auto x = torch::randn({1, 512, 896}).requires_grad_();
  const auto w = torch::rand({896}) + 0.5;  // frozen, as under LoRA
  const auto q = torch::randn({1, 512, 14, 64}).transpose(1, 2).requires_grad_();
  const auto cos = torch::randn({1, 1, 512, 64}), sin = torch::randn({1, 1, 512, 64});
  auto cpu = [](const std::function<torch::Tensor()>& f, const torch::Tensor& input) {
    const auto c0 = std::clock();
    for (int i = 0; i < 50; ++i) {
      const auto y = f();
      y.backward(torch::ones_like(y));
      input.mutable_grad() = torch::Tensor();
    }
    return static_cast<double>(std::clock() - c0) / CLOCKS_PER_SEC / 50 * 1e3;
  };
  for (int round = 0; round < 5; ++round) {
    std::cout << "rms_norm fused " << cpu([&] { return fused::rms_norm(x, w, 1e-6); }, x) << " ms, unfused "
              << cpu([&] { return reference_rms_norm(x, w, 1e-6); }, x) << " ms; rotary fused "
              << cpu([&] { return fused::apply_rotary(q, cos, sin); }, q) << " ms, unfused "
              << cpu([&] { return reference_rotary(q, cos, sin); }, q) << " ms (cpu per forward + backward)"
              << std::endl;
  }
}
