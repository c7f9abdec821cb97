// The language-model scenario of the conformance table (issue 50): a tiny Qwen2-architecture
// accel::llm::CausalLM (tied embeddings, grouped-query attention, q/k/v biases) fine-tuned through the
// Accelerator on every backend row, on batches padded on the right and on the left (attention mask, labels
// -100 on the pads). N ranks with B rows each must equal one process with the N*B rows of each global batch:
// every step's loss and the final weights.
//
// The loss is normalised as transformers' Trainer does it with num_items_in_batch: each rank's summed token
// losses divided by the label tokens of the whole window (every rank's, every micro-batch's), times the
// replicas and the accumulation steps that the backends' averaging and backward() divide by. A per-rank mean
// would weigh a rank's tokens by its own count; the scenario checks that its batches tell the two apart.
#include "dist_common.hpp"

#include <accel/llm/models/causal_lm.hpp>
#include <accel/llm/models/model_config.hpp>
#include <accel/llm/models/pipeline_stages.hpp>
#include <accel/parallel/pipeline.hpp>

#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace dist {
namespace {

using namespace accel;

constexpr std::int64_t kRowsPerRank = 3;
constexpr std::int64_t kLength = 12;
constexpr std::int64_t kVocab = 64;
constexpr std::int64_t kPadId = 0;
constexpr double kLlmTol = 2e-5;

// Qwen2 at toy sizes: q/k/v biases (Qwen2 always has them), 4 query heads over 2 key-value heads, the head
// tied to the embedding (or its own lm_head).
llm::ModelConfig tiny_qwen2(bool tied = true) {
  return llm::ModelConfig::from_json(
      R"({"model_type": "qwen2", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6,
          "max_position_embeddings": 64, "tie_word_embeddings": )" +
          std::string(tied ? "true" : "false") + "}",
      "llm_loops.cpp (tiny Qwen2)");
}

// The model as transformers initialises it (_init_weights: normal with initializer_range 0.02, biases zero,
// norms one): logits near zero at the start, a loss near ln(vocab).
llm::CausalLM tiny_model(std::uint64_t seed, bool tied = true) {
  torch::manual_seed(seed);
  llm::CausalLM model(tiny_qwen2(tied));
  torch::NoGradGuard no_grad;
  for (const auto& item : model->named_parameters()) {
    if (item.key().find("norm") != std::string::npos) continue;
    if (item.value().dim() == 1) {
      item.value().zero_();
    } else {
      item.value().normal_(0.0, 0.02);
    }
  }
  return model;
}

struct Batch {
  torch::Tensor input_ids, attention_mask, labels;
};

// `n` rows of kLength tokens a model can learn: a random first token, then next = (5 * previous + 3) mod 63
// + 1 (never the pad id), so that the loss falls and the gradients are far from zero.
torch::Tensor learnable_rows(at::Generator& gen, std::int64_t n) {
  auto ids = torch::empty({n, kLength}, torch::kInt64);
  ids.select(1, 0).copy_(at::randint(1, kVocab, {n}, gen, torch::kInt64));
  for (std::int64_t t = 1; t < kLength; ++t)
    ids.select(1, t).copy_((ids.select(1, t - 1) * 5 + 3).remainder(kVocab - 1) + 1);
  return ids;
}

// Global batch `index`: kRowsPerRank * replicas rows of kLength positions, each row's real length drawn in
// [3, kLength], padded on the right (even index) or on the left (odd index) with kPadId, labels -100 there.
Batch global_batch(std::int64_t index, int replicas) {
  auto gen = at::detail::createCPUGenerator(1000 + static_cast<std::uint64_t>(index));
  const auto n = kRowsPerRank * replicas;
  const auto ids = learnable_rows(gen, n);
  const auto lengths = at::randint(3, kLength + 1, {n, 1}, gen, torch::kInt64);
  const auto pos = torch::arange(kLength, torch::kInt64).unsqueeze(0);
  const auto mask = index % 2 == 0 ? pos < lengths : pos >= kLength - lengths;
  return {ids.masked_fill(~mask, kPadId), mask.to(torch::kInt64), ids.masked_fill(~mask, -100)};
}

// This process's rows of `b`: a replica's slice with an accelerator (on its device), all rows without.
Batch my_rows(const Batch& b, Accelerator* acc, int rank) {
  if (acc == nullptr) return b;
  const auto take = [&](const torch::Tensor& t) {
    return t.slice(0, rank * kRowsPerRank, (rank + 1) * kRowsPerRank).to(acc->device());
  };
  return {take(b.input_ids), take(b.attention_mask), take(b.labels)};
}

// The label tokens that count in the loss (position t predicts labels[t + 1]: the first column never counts).
std::int64_t label_count(const Batch& b) {
  return b.labels.slice(1, 1).ne(-100).sum().item<std::int64_t>();
}

struct Run {
  std::vector<double> losses;  // per optimizer step: the window's mean loss per label token
  std::vector<torch::Tensor> weights;
};

using MakeOptimizer = std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<torch::Tensor>)>;

// How a rank normalises its loss: by the window's label tokens of every rank (transformers'
// num_items_in_batch: right); wrong, as the controls: by its own micro-batch's (causal_lm_loss's mean: the
// ranks' tokens weigh unequally), or each micro-batch by every rank's tokens of that micro-batch only
// (transformers before num_items_in_batch: the micro-batches of a window weigh unequally).
enum class Normalisation { GlobalItems, PerRankMean, PerMicroBatchItems };

// The whole, current weights in the model's parameter order (by name: zero3 orders its state dict by unit).
std::vector<torch::Tensor> llm_weights(Accelerator* acc, llm::CausalLM& model) {
  std::vector<torch::Tensor> out;
  if (acc == nullptr) {
    for (const auto& p : model->parameters())
      out.push_back(p.detach().clone());
    return out;
  }
  std::map<std::string, torch::Tensor> state;
  for (const auto& [name, t] : acc->get_state_dict(model))
    state[name] = t.cpu().clone();
  for (const auto& name : model->named_parameters().keys()) {
    const auto found = state.find(name);
    CHECK_MSG(found != state.end(), backend_variant << ": get_state_dict lacks " << name);
    out.push_back(found != state.end() ? found->second : torch::Tensor());
  }
  return out;
}

// One micro-batch through the Accelerator, in Accelerate's loop: zero_grad and step are no-ops inside the
// window. Returns the micro-batch's share of the step's loss, summed over the ranks.
double accelerated_micro_step(Accelerator& acc, llm::CausalLM& model, torch::optim::Optimizer& opt,
                              const Batch& b, double window_items, double micro_items, int replicas,
                              int accumulation, Normalisation norm) {
  auto scope = acc.accumulate(model);
  opt.zero_grad();
  const auto logits = model->forward(b.input_ids, b.attention_mask);
  torch::Tensor loss, logged;
  if (norm != Normalisation::PerRankMean) {
    // backward() divides by the accumulation steps and the backends average over the replicas: multiplied
    // back, the gradients are d(sum of every rank's token losses) / window_items, as one process's.
    const double items = norm == Normalisation::GlobalItems ? window_items : micro_items * accumulation;
    logged = llm::causal_lm_loss(logits, b.labels, std::int64_t{1}) / items;
    loss = logged * static_cast<double>(replicas * accumulation);
  } else {
    loss = llm::causal_lm_loss(logits, b.labels);
    logged = loss / static_cast<double>(replicas * accumulation);
  }
  acc.backward(loss);
  opt.step();
  return acc.reduce(logged.detach().to(torch::kFloat64).cpu().reshape({1}), ReduceOp::Sum).item<double>();
}

// `steps` optimizer steps of `accumulation` micro-batches each: on this rank's rows through `acc`, or, with
// acc == nullptr, the one-process reference on every row of the same global batches.
Run train_llm(Accelerator* acc, int replicas, int accumulation, int steps, const MakeOptimizer& make_opt,
              Normalisation norm = Normalisation::GlobalItems) {
  auto model = tiny_model(21);
  auto opt = make_opt(model->parameters());
  if (acc != nullptr) acc->prepare(model, *opt);
  const int rank = acc != nullptr ? acc->data_parallel_group()->rank() : 0;
  Run run;
  for (int s = 0; s < steps; ++s) {
    std::vector<Batch> window;
    std::int64_t window_items = 0;  // every rank's label tokens of the window: num_items_in_batch
    for (int m = 0; m < accumulation; ++m) {
      window.push_back(global_batch(s * accumulation + m, replicas));
      window_items += label_count(window.back());
    }
    double step_loss = 0;
    if (acc == nullptr) opt->zero_grad();
    for (int m = 0; m < accumulation; ++m) {
      const auto b = my_rows(window[m], acc, rank);
      if (acc != nullptr) {
        step_loss +=
            accelerated_micro_step(*acc, model, *opt, b, static_cast<double>(window_items),
                                   static_cast<double>(label_count(window[m])), replicas, accumulation, norm);
        continue;
      }
      const auto summed = llm::causal_lm_loss(model->forward(b.input_ids, b.attention_mask), b.labels, 1);
      const auto per_item = summed / static_cast<double>(window_items);
      per_item.backward();
      step_loss += per_item.item<double>();
    }
    if (acc == nullptr) opt->step();
    run.losses.push_back(step_loss);
  }
  run.weights = llm_weights(acc, model);
  const auto names = model->named_parameters().keys();
  CHECK_MSG(std::find(names.begin(), names.end(), "lm_head.weight") == names.end(),
            "tied embeddings: lm_head.weight must be no parameter of its own");
  return run;
}

// The largest difference of `got`'s weights from `want`'s.
double max_weight_diff(const Run& got, const Run& want) {
  double worst = 0;
  for (std::size_t k = 0; k < std::min(got.weights.size(), want.weights.size()); ++k) {
    if (got.weights[k].defined())
      worst = std::max(worst, (got.weights[k].cpu() - want.weights[k]).abs().max().item<double>());
  }
  return worst;
}

// The ranks against one process; with `control`, also a run with that wrong normalisation, which must NOT
// match (the batches give the ranks and the micro-batches different label counts, so the scenario tells the
// normalisations apart).
void llm_case(const std::string& what, int accumulation, int steps, const MakeOptimizer& make_opt,
              std::optional<Normalisation> control) {
  Run got, naive;
  int replicas = 1;
  bool main = true;
  const auto run_on_ranks = [&](Normalisation norm) {
    Accelerator acc(AcceleratorOptions().config(cpu_config(MixedPrecision::No, accumulation)));
    replicas = acc.data_parallel_group()->world_size();
    main = acc.is_main_process();
    return train_llm(&acc, replicas, accumulation, steps, make_opt, norm);
  };
  got = run_on_ranks(Normalisation::GlobalItems);
  if (control && (replicas > 1 || *control == Normalisation::PerMicroBatchItems))
    naive = run_on_ranks(*control);
  const auto want = train_llm(nullptr, replicas, accumulation, steps, make_opt);
  CHECK_MSG(got.losses.size() == want.losses.size(), what << ": " << got.losses.size() << " steps");
  for (std::size_t s = 0; s < std::min(got.losses.size(), want.losses.size()); ++s) {
    const double diff = std::abs(got.losses[s] - want.losses[s]);
    CHECK_MSG(diff <= kLlmTol * (1 + std::abs(want.losses[s])),
              what << ": step " << s << "'s loss " << got.losses[s] << " differs from one process's "
                   << want.losses[s] << " by " << diff);
  }
  // Training must move the weights far more than the tolerance, or equal weights would prove nothing.
  Run initial;
  for (const auto& p : tiny_model(21)->parameters())
    initial.weights.push_back(p.detach().clone());
  const double moved = max_weight_diff(want, initial);
  CHECK_MSG(moved > 100 * kLlmTol, what << ": one process moved the weights by " << moved << " only");
  CHECK_MSG(got.weights.size() == want.weights.size(), what << ": " << got.weights.size() << " tensors");
  for (std::size_t k = 0; k < std::min(got.weights.size(), want.weights.size()); ++k) {
    if (!got.weights[k].defined()) continue;
    const auto mine = got.weights[k].cpu();
    const double diff = (mine - want.weights[k]).abs().max().item<double>();
    CHECK_MSG(close(mine, want.weights[k], kLlmTol), what << ": parameter " << k
                                                          << " differs from one process by " << diff
                                                          << " (tolerance " << kLlmTol << ")");
  }
  if (!naive.weights.empty()) {
    const double off = max_weight_diff(naive, want);
    CHECK_MSG(off > 10 * kLlmTol, what << ": wrongly normalised, the weights still match one process (max "
                                       << off << "): the batches do not tell the normalisations apart");
    if (main)
      std::cout << backend_variant << " " << what << ": normalised wrongly, the weights end " << off
                << " away from one process's weights (caught)" << std::endl;
  }
  if (main) {
    std::cout << backend_variant << " " << what << ": " << got.losses.size()
              << " steps' losses and the weights match one process (loss " << want.losses.front() << " -> "
              << want.losses.back() << ", weights moved " << moved << ", max difference "
              << max_weight_diff(got, want) << ")" << std::endl;
  }
}

void llm_qwen2_tied() {
  const auto config = tiny_qwen2();
  CHECK_MSG(config.tie_word_embeddings && config.qkv_bias &&
                config.num_key_value_heads < config.num_attention_heads,
            "the tiny model must have tied embeddings, q/k/v biases and grouped-query attention");
  llm_case(
      "Qwen2 (tied, GQA, biases), padded batches, AdamW", 1, 4,
      [](std::vector<torch::Tensor> p) {
        return std::make_unique<torch::optim::AdamW>(p, torch::optim::AdamWOptions(1e-2).weight_decay(0.01));
      },
      /*control=*/Normalisation::PerRankMean);
  llm_case(
      "Qwen2 (tied, GQA, biases), padded batches, gradient accumulation 2, SGD", 2, 2,
      [](std::vector<torch::Tensor> p) {
        return std::make_unique<torch::optim::SGD>(p, torch::optim::SGDOptions(0.1).momentum(0.9));
      },
      /*control=*/Normalisation::PerMicroBatchItems);
}

// The Qwen2 as pipeline stages (llm::pipeline_layers: embedding on the first stage, the blocks spread
// evenly, norm and head on the last), one stage per rank through Accelerator::prepare_pipeline: tied, the
// embedding is held by the first and the last stage, whose copies' gradients the engine sums; every step's
// loss and every stage's parameters equal one process training the CausalLM itself. Batches without padding
// (one tensor crosses the stages: no attention mask).
void llm_pipeline_case(bool tied) {
  auto model = tiny_model(21, tied), reference = tiny_model(21, tied);
  auto layers = llm::pipeline_layers(model);
  auto ref_layers = llm::pipeline_layers(reference);
  const auto blocks = model->config().num_hidden_layers;
  CHECK_MSG(layers->size() == static_cast<std::size_t>(blocks + 2), "pipeline_layers: " << layers->size());
  CHECK_MSG(llm::pipeline_partition(model, 2) == "0,2,4", llm::pipeline_partition(model, 2));
  CHECK_MSG(llm::pipeline_partition(model, 1) == "0,4", llm::pipeline_partition(model, 1));
  std::string refused;
  try {
    llm::pipeline_partition(model, 3);
  } catch (const UsageError& e) {
    refused = e.what();
  }
  CHECK_MSG(refused.find("3 stages for a model of 2 blocks") != std::string::npos, refused);
  auto gen = at::detail::createCPUGenerator(77);
  const auto probe = at::randint(0, kVocab, {2, kLength}, gen, torch::kInt64);
  {
    torch::NoGradGuard no_grad;
    const auto diff = (layers->forward(probe) - model->forward(probe)).abs().max().item<double>();
    CHECK_MSG(diff <= 1e-6, "the pipeline layers' forward differs from CausalLM::forward by " << diff);
  }
  Config config;
  config.backend = "ddp";
  config.use_cpu = true;
  config.collective_timeout_seconds = 60;
  const auto world = std::getenv("WORLD_SIZE") ? std::atoi(std::getenv("WORLD_SIZE")) : 1;
  // 2 stages (1 on one rank): 2 ranks are one pipeline, 4 ranks two data-parallel replicas of it.
  const int stages = world >= 2 ? 2 : 1;
  REQUIRE(world % stages == 0);
  config.num_processes = world;
  config.pipeline.stages = stages;
  config.pipeline.micro_batches = 4;
  config.pipeline.partition = llm::pipeline_partition(model, stages);
  Accelerator acc(AcceleratorOptions().config(config));
  auto& stage = acc.prepare_pipeline(layers);
  const auto head = std::to_string(blocks + 1);
  CHECK_MSG(stages == 1 || !tied
                ? stage.ties().empty()
                : (stage.ties().size() == 1 && stage.ties()[0].stages == std::vector<int>{0, stages - 1} &&
                   stage.ties()[0].names ==
                       std::vector<std::string>{"0.embed_tokens.weight", head + ".embed_tokens.weight"}),
            (tied ? "the tied embedding must be one tie of the first and the last stage"
                  : "an untied model shares no parameter across stages")
                << "; ties: " << stage.ties().size());
  torch::optim::SGD optimizer(stage.parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  torch::optim::SGD ref_optimizer(reference->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  acc.prepare(optimizer);
  auto ref_params = ref_layers->named_parameters();
  for (int step = 0; step < 3; ++step) {
    const auto ids = learnable_rows(gen, 8);
    optimizer.zero_grad();
    ref_optimizer.zero_grad();
    const double loss = acc.pipeline_step(ids, ids, llm::pipeline_loss());
    const auto ref_loss = llm::causal_lm_loss(reference->forward(ids), ids);
    ref_loss.backward();
    CHECK_MSG(std::abs(loss - ref_loss.item<double>()) <= kLlmTol, "step " << step << ": the pipeline's loss "
                                                                           << loss << ", one process's "
                                                                           << ref_loss.item<double>());
    optimizer.step();
    ref_optimizer.step();
    for (const auto& item : stage.named_parameters()) {
      const auto* want = ref_params.find(item.key());
      CHECK_MSG(want != nullptr && close(item.value(), *want, kLlmTol),
                "step " << step << ": stage " << stage.stage() << "'s " << item.key()
                        << " differs from one process's");
    }
  }
  double moved = 0;
  const auto initial = tiny_model(21, tied);
  for (std::size_t k = 0; k < initial->parameters().size(); ++k)
    moved =
        std::max(moved, (reference->parameters()[k] - initial->parameters()[k]).abs().max().item<double>());
  CHECK_MSG(moved > 100 * kLlmTol, "one process moved the weights by " << moved << " only");
  if (acc.is_main_process())
    std::cout << "llm_pipeline" << (tied ? "" : " (untied)") << ": " << stages << " stages x "
              << world / stages << " replica(s) (partition " << config.pipeline.partition
              << (tied ? ", the tied embedding on the first and the last" : ", lm_head on the last")
              << ") match one process over 3 steps (weights moved " << moved << ")" << std::endl;
}

}  // namespace

std::map<std::string, std::function<void()>> llm_scenarios() {
  return {{"llm", llm_qwen2_tied}, {"llm_pipeline", [] {
                                      llm_pipeline_case(/*tied=*/false);
                                      llm_pipeline_case(/*tied=*/true);
                                    }}};
}

}  // namespace dist
