// accel::llm::sequence_parallel_sft_loss's fused path (SftLossOptions, as sft_loss): on one process (a group
// of one, shard_sequence's shifted labels and the same code as every rank of a split model) the fused loss
// equals the unfused one and sft_loss, loss and every gradient, tied and untied heads, padded and packed
// rows; the autograd graph shows which path ran (the fused loss's node, or none with fused off or a LoRA
// head). The all-reduce over a real group of 2 runs in sp_equivalence.py (both paths against one process).
#include <torch/torch.h>
#include <accel/llm/models/causal_lm.hpp>
#include <accel/llm/training/sequence_shard.hpp>
#include <accel/llm/training/sft_batches.hpp>
#include <accel/nn/lora.hpp>

#include <catch2/catch.hpp>

#include "llm/llm_test_fixtures.hpp"

#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

namespace {

namespace llm = accel::llm;

using llm_test::tiny_qwen2;

// Whether the autograd graph behind `loss` holds fused_linear_cross_entropy's node.
bool fused_in_graph(const torch::Tensor& loss) {
  std::vector<torch::autograd::Node*> pending{loss.grad_fn().get()};
  std::set<torch::autograd::Node*> seen;
  while (!pending.empty()) {
    auto* node = pending.back();
    pending.pop_back();
    if (node == nullptr || !seen.insert(node).second) continue;
    if (node->name().find("FusedLinearCrossEntropy") != std::string::npos) return true;
    for (const auto& edge : node->next_edges())
      pending.push_back(edge.function.get());
  }
  return false;
}

struct Result {
  torch::Tensor loss;
  bool fused = false;
  std::map<std::string, torch::Tensor> grads;
};

template <class Loss>
Result run(llm::CausalLM& model, Loss&& loss_of) {
  model->zero_grad();
  auto loss = loss_of();
  Result r{loss.detach(), fused_in_graph(loss), {}};
  loss.backward();
  for (const auto& p : model->named_parameters())
    if (p.value().grad().defined()) r.grads[p.key()] = p.value().grad().clone();
  return r;
}

void require_equal(const Result& got, const Result& want) {
  INFO("loss " << got.loss.item<double>() << " against " << want.loss.item<double>());
  CHECK(std::abs(got.loss.item<double>() - want.loss.item<double>()) <= 1e-6);
  REQUIRE(got.grads.size() == want.grads.size());
  for (const auto& [name, g] : want.grads) {
    INFO("gradient of " << name);
    REQUIRE(got.grads.count(name) == 1);
    const double scale = std::max(g.abs().max().item<double>(), 1e-12);
    CHECK((got.grads.at(name) - g).abs().max().item<double>() / scale <= 1e-5);
  }
}

// Row 0: a prompt of 3 ignored labels; row 1: padding after 14 tokens (mask 0, labels -100).
llm::SftTensors padded_batch() {
  const auto ids = torch::randint(1, 97, {2, 20}, torch::kInt64);
  auto labels = ids.clone();
  labels.index_put_({0, torch::indexing::Slice(0, 3)}, -100);
  labels.index_put_({1, torch::indexing::Slice(14, torch::indexing::None)}, -100);
  auto mask = torch::ones({2, 20}, torch::kInt64);
  mask.index_put_({1, torch::indexing::Slice(14, torch::indexing::None)}, 0);
  return {ids, labels, mask, torch::empty({0}, torch::kInt64)};
}

// Padding-free: two documents per row, positions restarting, -100 at each document's first label.
llm::SftTensors packed_batch() {
  const auto ids = torch::randint(1, 97, {2, 19}, torch::kInt64);
  auto labels = ids.clone();
  labels.index_put_({torch::indexing::Slice(), 0}, -100);
  labels.index_put_({torch::indexing::Slice(), 8}, -100);
  const auto pos =
      torch::cat({torch::arange(8), torch::arange(11)}).unsqueeze(0).expand({2, 19}).contiguous();
  return {ids, labels, torch::empty({0}, torch::kInt64), pos};
}

}  // namespace

TEST_CASE("sequence_parallel_sft_loss takes the fused loss by default: equal to unfused and to sft_loss",
          "[llm][sp][fused]") {
  torch::manual_seed(3);
  const auto padded = padded_batch(), packed = packed_batch();
  for (const bool tied : {true, false}) {
    auto model = llm_test::random_model(tiny_qwen2(tied), 11);
    model->train();
    for (const auto* batch : {&padded, &packed}) {
      for (const std::optional<std::int64_t> items :
           {std::optional<std::int64_t>(), std::optional<std::int64_t>(40)}) {
        INFO((tied ? "tied" : "untied")
             << (batch == &padded ? ", padded" : ", packed") << (items ? ", num_items 40" : ", mean"));
        const auto reference = run(model, [&] {
          return llm::sft_loss(*model, *batch, items,
                               llm::SftLossOptions().fused_linear_cross_entropy(false));
        });
        const auto unfused = run(model, [&] {
          return llm::sequence_parallel_sft_loss(*model, *batch, items,
                                                 llm::SftLossOptions().fused_linear_cross_entropy(false));
        });
        const auto fused = run(model, [&] { return llm::sequence_parallel_sft_loss(*model, *batch, items); });
        const auto chunked = run(model, [&] {
          return llm::sequence_parallel_sft_loss(*model, *batch, items,
                                                 llm::SftLossOptions().chunk_tokens(3));
        });
        CHECK_FALSE(reference.fused);
        CHECK_FALSE(unfused.fused);
        CHECK(fused.fused);
        CHECK(chunked.fused);
        CHECK(reference.grads.size() == model->parameters().size());
        require_equal(unfused, reference);
        require_equal(fused, reference);
        require_equal(chunked, reference);
      }
    }
  }
}

TEST_CASE("sequence_parallel_sft_loss with a LoRA head falls back to the logits, as sft_loss",
          "[llm][sp][fused]") {
  for (const std::string target : {"q_proj", "lm_head"}) {
    INFO("LoRA on " << target);
    auto model = llm_test::random_model(tiny_qwen2(false), 11);
    const auto lora = llm_test::lora_on(model, target);
    model->train();
    torch::manual_seed(4);
    const auto batch = padded_batch();
    const auto reference = run(model, [&] {
      return llm::sft_loss(*model, batch, std::nullopt,
                           llm::SftLossOptions().fused_linear_cross_entropy(false));
    });
    const auto got = run(model, [&] { return llm::sequence_parallel_sft_loss(*model, batch); });
    CHECK(got.fused == (target != "lm_head"));
    CHECK(reference.grads.size() == (target == "lm_head" ? 6u : 8u));
    require_equal(got, reference);
  }
}
