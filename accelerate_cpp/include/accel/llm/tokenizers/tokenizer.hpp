#pragma once
/// \file
/// Hugging Face `tokenizer.json` tokenizers (torch-free): byte-level BPE (GPT-2, Qwen2, Llama 3) and the
/// SentencePiece-style BPE of Llama 2 (Metaspace, byte fallback). Ids equal Hugging Face `tokenizers`' on the
/// same file; a file this reader cannot reproduce exactly is refused naming the file and what it lacks.

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace accel::llm {

/// A tokenizer read from a Hugging Face `tokenizer.json` (plus, with from_pretrained, the special-token
/// settings of `tokenizer_config.json` beside it). Immutable after construction; encode and decode may be
/// called from several threads at once. Local to a rank: no collective.
class Tokenizer {
 public:
  /// Reads `tokenizer.json`. Throws accel::ConfigError naming the file and the key it cannot honour.
  static Tokenizer from_file(const std::string& tokenizer_json);
  /// Reads `dir/tokenizer.json` and, when present, `dir/tokenizer_config.json` (bos/eos/pad/unk/... tokens,
  /// extra_special_tokens, added_tokens_decoder), as transformers 5's AutoTokenizer.from_pretrained(dir)
  /// does. Like transformers 5, add_bos_token / add_eos_token are not read when tokenizer.json exists (its
  /// post-processor decides), and tokenizer_class LlamaTokenizer (on a file without ByteLevel) or
  /// Qwen2Tokenizer rebuilds the pipeline around the file's vocabulary and merges as those classes do
  /// (add_prefix_space, legacy).
  static Tokenizer from_pretrained(const std::string& dir);

  /// The ids of `text`; with add_special_tokens the post-processor's tokens (BOS of Llama) are added, as
  /// `tokenizer(text)["input_ids"]` does. Throws accel::UsageError when `text` is not valid UTF-8.
  std::vector<int64_t> encode(const std::string& text, bool add_special_tokens = true) const;
  /// encode() of each text in turn, on the calling thread.
  std::vector<std::vector<int64_t>> encode_batch(const std::vector<std::string>& texts,
                                                 bool add_special_tokens = true) const;
  /// The text of `ids`, as `tokenizer.decode(ids, skip_special_tokens=...)`.
  std::string decode(const std::vector<int64_t>& ids, bool skip_special_tokens = false) const;

  /// The id of a token (vocabulary or added token), if it has one.
  std::optional<int64_t> token_to_id(const std::string& token) const;
  /// The token of an id, if the id exists.
  std::optional<std::string> id_to_token(int64_t id) const;
  /// Vocabulary size including added tokens (`len(tokenizer)`).
  int64_t size() const;

  /// Special tokens as tokenizer_config.json names them (empty when the file does not set them).
  std::optional<int64_t> bos_token_id() const;
  std::optional<int64_t> eos_token_id() const;
  std::optional<int64_t> pad_token_id() const;

  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;
  ~Tokenizer();

  struct Impl;

 private:
  explicit Tokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace accel::llm
