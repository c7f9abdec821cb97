#pragma once
// Reading tokenizer.json (the serde layout of Hugging Face tokenizers) into the pipeline's stages. Everything
// this reader cannot reproduce exactly is refused with an accel::ConfigError naming the file and the key.

#include "llm/tokenizers/added_vocabulary.hpp"
#include "llm/tokenizers/bpe.hpp"
#include "llm/tokenizers/decoders.hpp"
#include "llm/tokenizers/normalizers.hpp"
#include "llm/tokenizers/post_processor.hpp"
#include "llm/tokenizers/pre_tokenizers.hpp"

#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace accel::llm::detail {

struct Pipeline {
  std::unique_ptr<Normalizer> normalizer;
  std::unique_ptr<PreTokenizer> pre_tokenizer;
  std::unique_ptr<BpeModel> model;
  std::unique_ptr<Decoder> decoder;
  std::optional<PostProcessor> post_processor;  // nullopt: "post_processor": null
  std::vector<AddedToken> added_tokens;         // in the file's order
  bool mentions_byte_level = false;  // the file holds "ByteLevel" (transformers' test for Llama files)
};

/// Parses `path` (tokenizer.json). Throws accel::ConfigError.
Pipeline read_tokenizer_json(const std::string& path);

/// The special-token settings of tokenizer_config.json (absent keys stay empty).
struct TokenizerConfig {
  std::string tokenizer_class;  // "Fast" suffix removed
  std::optional<bool> add_prefix_space, legacy;
  std::optional<AddedToken> bos_token, eos_token, pad_token, unk_token;
  /// The named special tokens in transformers' SPECIAL_TOKENS_ATTRIBUTES order (bos, eos, unk, sep, pad, cls,
  /// mask), then extra_special_tokens (or its older name additional_special_tokens).
  std::vector<AddedToken> special_tokens;
  std::vector<std::pair<uint32_t, AddedToken>> added_tokens_decoder;  // sorted by id
};
/// Reads tokenizer_config.json and, when that has no added_tokens_decoder (an older checkpoint) and
/// `special_tokens_map` is not empty, the special tokens of special_tokens_map.json over it, as transformers
/// 5 does. Throws accel::ConfigError (missing file, bad JSON, a key of the wrong type).
TokenizerConfig read_tokenizer_config(const std::string& path, const std::string& special_tokens_map = "");

}  // namespace accel::llm::detail
