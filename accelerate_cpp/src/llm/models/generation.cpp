#include "accel/llm/models/generation.hpp"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <algorithm>
#include <filesystem>
#include <limits>
#include <string>

#include <nlohmann/json.hpp>

#include "accel/errors.hpp"
#include "config/small_file.hpp"

namespace accel::llm {
namespace {

void check(const GenerationConfig& g, const std::vector<std::vector<std::int64_t>>& prompts,
           std::int64_t vocab) {
  if (g.max_new_tokens < 0) throw UsageError("accel::llm::generate: max_new_tokens must be >= 0");
  if (g.do_sample && !(g.temperature > 0))
    throw UsageError("accel::llm::generate: temperature must be > 0, got " + std::to_string(g.temperature));
  if (g.do_sample && !(g.top_p > 0 && g.top_p <= 1))
    throw UsageError("accel::llm::generate: top_p must be in (0, 1], got " + std::to_string(g.top_p));
  if (g.top_k < 0) throw UsageError("accel::llm::generate: top_k must be >= 0 (0: no top-k)");
  if (prompts.empty()) throw UsageError("accel::llm::generate: no prompt given");
  for (std::size_t i = 0; i < prompts.size(); ++i) {
    if (prompts[i].empty())
      throw UsageError("accel::llm::generate: prompt " + std::to_string(i) + " is empty");
    for (const auto id : prompts[i])
      if (id < 0 || id >= vocab)
        throw UsageError("accel::llm::generate: prompt " + std::to_string(i) + " holds id " +
                         std::to_string(id) + ", outside the vocabulary of " + std::to_string(vocab));
  }
}

// transformers' TemperatureLogitsWarper, TopKLogitsWarper and TopPLogitsWarper, in that order, then a draw.
torch::Tensor sample(torch::Tensor scores, const GenerationConfig& g, at::Generator& gen) {
  const double inf = std::numeric_limits<double>::infinity();
  if (g.temperature != 1.0) scores = scores / g.temperature;
  if (g.top_k > 0) {
    const auto k = std::min<std::int64_t>(g.top_k, scores.size(-1));
    const auto kth = std::get<0>(scores.topk(k)).slice(-1, k - 1);
    scores = scores.masked_fill(scores < kth, -inf);
  }
  if (g.top_p < 1.0) {
    const auto [sorted, indices] = scores.sort(/*dim=*/-1, /*descending=*/false);
    const auto cumulative = sorted.softmax(-1).cumsum(-1);
    auto remove = cumulative <= (1 - g.top_p);
    remove.slice(-1, -1).fill_(false);  // keep at least one token
    scores = scores.masked_fill(remove.scatter(1, indices, remove), -inf);
  }
  const auto probs = scores.softmax(-1).to(torch::kCPU);
  return torch::multinomial(probs, 1, /*replacement=*/false, gen).squeeze(1);
}

}  // namespace

GenerationConfig generation_config_from_pretrained(const std::string& dir) {
  GenerationConfig g;
  const std::string path = (std::filesystem::path(dir) / "generation_config.json").string();
  if (!std::filesystem::exists(path)) return g;
  const auto file = config_detail::read_small_file(path, 1u << 20);
  if (!file.error.empty()) throw ConfigError("cannot read '" + path + "': " + file.error, path);
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(file.text);
  } catch (const nlohmann::json::exception& e) {
    throw ConfigError(path + ": not valid JSON (" + std::string(e.what()) + ")", path);
  }
  auto fail = [&](const std::string& key, const std::string& what) {
    throw ConfigError(path + ": key \"" + key + "\" is " + j[key].dump() + " but must be " + what, path, 0,
                      key);
  };
  auto id = [&](const nlohmann::json& v, const std::string& key) {
    if (!v.is_number_integer()) fail(key, "an integer id or a list of them");
    return v.get<std::int64_t>();
  };
  auto has = [&](const char* key) { return j.is_object() && j.contains(key) && !j[key].is_null(); };
  if (has("eos_token_id")) {
    if (j["eos_token_id"].is_array()) {
      for (const auto& v : j["eos_token_id"])
        g.eos_token_ids.push_back(id(v, "eos_token_id"));
    } else {
      g.eos_token_ids.push_back(id(j["eos_token_id"], "eos_token_id"));
    }
  }
  if (has("pad_token_id")) g.pad_token_id = id(j["pad_token_id"], "pad_token_id");
  if (has("do_sample")) {
    if (!j["do_sample"].is_boolean()) fail("do_sample", "true or false");
    g.do_sample = j["do_sample"].get<bool>();
  }
  for (const char* key : {"temperature", "top_p"}) {
    if (!has(key)) continue;
    if (!j[key].is_number()) fail(key, "a number");
    (std::string(key) == "temperature" ? g.temperature : g.top_p) = j[key].get<double>();
  }
  if (has("top_k")) g.top_k = id(j["top_k"], "top_k");
  if (has("max_new_tokens")) g.max_new_tokens = id(j["max_new_tokens"], "max_new_tokens");
  return g;
}

std::vector<std::vector<std::int64_t>> generate(CausalLM& model,
                                                const std::vector<std::vector<std::int64_t>>& prompts,
                                                const GenerationConfig& g) {
  const ModelConfig& mc = model->config();
  check(g, prompts, mc.vocab_size);
  std::vector<std::int64_t> stop = g.eos_token_ids.empty() ? mc.eos_token_ids : g.eos_token_ids;
  stop.insert(stop.end(), g.stop_token_ids.begin(), g.stop_token_ids.end());
  const std::int64_t pad = g.pad_token_id    ? *g.pad_token_id
                           : mc.pad_token_id ? *mc.pad_token_id
                           : !stop.empty()   ? stop[0]
                                             : 0;
  const auto batch = static_cast<std::int64_t>(prompts.size());
  std::int64_t longest = 0;
  for (const auto& p : prompts)
    longest = std::max<std::int64_t>(longest, static_cast<std::int64_t>(p.size()));

  // Left padding, as transformers pads decoder-only prompts.
  auto ids = torch::full({batch, longest}, pad, torch::kInt64);
  auto mask = torch::zeros({batch, longest}, torch::kInt64);
  for (std::int64_t b = 0; b < batch; ++b) {
    const auto n = static_cast<std::int64_t>(prompts[b].size());
    ids[b].slice(0, longest - n).copy_(torch::tensor(prompts[b], torch::kInt64));
    mask[b].slice(0, longest - n).fill_(1);
  }
  const auto device = model->model->norm->weight.device();  // embed_tokens may be split (vocab_parallel)
  ids = ids.to(device);
  mask = mask.to(device);
  auto positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0);

  // The caller's training flag comes back however generate ends.
  struct RestoreMode {
    CausalLM& model;
    bool training;
    ~RestoreMode() { model->train(training); }
  } restore{model, model->is_training()};
  model->eval();
  torch::NoGradGuard no_grad;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(g.seed);
  const auto stop_ids = torch::tensor(stop, torch::kInt64).to(device);
  std::vector<std::vector<std::int64_t>> out(prompts.size());
  auto finished = torch::zeros({batch}, torch::TensorOptions().dtype(torch::kBool).device(device));
  KVCache cache;
  auto logits = model->forward(ids, mask, positions, &cache).select(1, -1).to(torch::kFloat32);
  for (std::int64_t step = 0; step < g.max_new_tokens; ++step) {
    auto next = g.do_sample ? sample(logits, g, gen).to(device) : logits.argmax(-1);
    next = torch::where(finished, torch::full_like(next, pad), next);
    const auto next_cpu = next.to(torch::kCPU);
    const auto finished_cpu = finished.to(torch::kCPU);
    for (std::int64_t b = 0; b < batch; ++b)
      if (!finished_cpu[b].item<bool>()) out[b].push_back(next_cpu[b].item<std::int64_t>());
    if (!stop.empty()) finished = finished | torch::isin(next, stop_ids);
    if (finished.all().item<bool>() || step + 1 == g.max_new_tokens) break;
    mask = torch::cat({mask, torch::ones({batch, 1}, mask.options())}, 1);
    positions = positions.slice(1, -1) + 1;
    logits = model->forward(next.view({batch, 1}), mask, positions, &cache).select(1, -1).to(torch::kFloat32);
  }
  return out;
}

}  // namespace accel::llm
