#pragma once
/// \file generation.hpp
/// Text generation with a KV cache (transformers' `generate` for decoder-only models): greedy, or sampling
/// with temperature, top-k and top-p from a seeded generator; prompts of different lengths in one batch,
/// left-padded with an attention mask and position ids counted from each prompt's first token, as
/// transformers pads them.
///
///   accel::llm::GenerationConfig gen;
///   gen.max_new_tokens = 32;
///   auto out = accel::llm::generate(model, {tokenizer.encode("Hello")}, gen);   // out[0]: the new ids
///
/// Local to a rank: no collective.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "accel/llm/models/causal_lm.hpp"

namespace accel::llm {

/// What generate does (transformers' GenerationConfig names).
struct GenerationConfig {
  /// Tokens generated at most per prompt.
  std::int64_t max_new_tokens = 20;
  /// Sample from the (warped) distribution instead of taking the most likely token.
  bool do_sample = false;
  /// Sampling: logits are divided by it (> 0).
  double temperature = 1.0;
  /// Sampling: keep the k most likely tokens (0: all). transformers' default is 50.
  std::int64_t top_k = 50;
  /// Sampling: keep the smallest set of most likely tokens whose probability reaches top_p (1.0: all).
  double top_p = 1.0;
  /// Sampling: seed of the generator (the same seed, model and prompts give the same tokens).
  std::uint64_t seed = 0;
  /// A prompt ends when it generates one of these (the token is kept). Empty: the config's eos_token_id.
  std::vector<std::int64_t> eos_token_ids;
  /// Further ids that end a prompt, as eos ids do.
  std::vector<std::int64_t> stop_token_ids;
  /// The id used for left padding and after a prompt has ended (default: pad_token_id, else the first eos
  /// id, else 0). Only the model sees it: the returned ids carry no padding.
  std::optional<std::int64_t> pad_token_id;
};

/// The defaults a checkpoint directory's `generation_config.json` gives transformers' `generate`:
/// `eos_token_id` (one id or a list), `pad_token_id`, `do_sample`, `temperature`, `top_k`, `top_p`,
/// `max_new_tokens`; the rest of GenerationConfig's defaults otherwise, and all of them when the file is
/// absent. Throws accel::ConfigError naming the file and the key on a value of the wrong type.
GenerationConfig generation_config_from_pretrained(const std::string& dir);

/// Generates a continuation of every prompt (each a list of ids, non-empty) in one batch with a KV cache.
/// Returns, per prompt, the new ids (ending with the eos / stop id when one was generated). The model runs in
/// inference mode; its training flag is restored. Throws UsageError on an empty prompt or a bad config.
std::vector<std::vector<std::int64_t>> generate(CausalLM& model,
                                                const std::vector<std::vector<std::int64_t>>& prompts,
                                                const GenerationConfig& config = {});

}  // namespace accel::llm
