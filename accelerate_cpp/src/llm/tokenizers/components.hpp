#pragma once
// The stages of a Hugging Face tokenizer pipeline (tokenizers/src/{normalizers,pre_tokenizers,processors,
// decoders}): each an interface with the implementations tokenizer.json names, built by tokenizer_json.cpp.

#include "llm/tokenizers/regex.hpp"

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace accel::llm::detail {

// ---- normalizers ------------------------------------------------------------------------------------------

class Normalizer {
 public:
  virtual ~Normalizer() = default;
  /// Rewrites `text` in place.
  virtual void normalize(std::string& text) const = 0;
};

enum class UnicodeForm { kNfc, kNfkc, kNfd, kNfkd };
std::unique_ptr<Normalizer> make_unicode_normalizer(UnicodeForm form);
std::unique_ptr<Normalizer> make_sequence_normalizer(std::vector<std::unique_ptr<Normalizer>> parts);
std::unique_ptr<Normalizer> make_prepend_normalizer(std::string prepend);
/// Replace: every match of `pattern` becomes `content` (a {"String": ...} pattern or a {"Regex": ...} one).
std::unique_ptr<Normalizer> make_replace_normalizer(std::string literal, std::string content);
std::unique_ptr<Normalizer> make_replace_normalizer(Regex pattern, std::string content);

// ---- pre-tokenizers ---------------------------------------------------------------------------------------

/// A piece of the text on its way to the model. `at_origin`: the piece starts at offset 0 of the input
/// (Metaspace's prepend_scheme "first" looks at it).
struct Piece {
  std::string text;
  bool at_origin = false;
};

class PreTokenizer {
 public:
  virtual ~PreTokenizer() = default;
  /// Splits or rewrites `pieces` (empty pieces are dropped, as PreTokenizedString::split does).
  virtual void pre_tokenize(std::vector<Piece>& pieces) const = 0;
};

enum class SplitBehavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };
std::unique_ptr<PreTokenizer> make_sequence_pre_tokenizer(std::vector<std::unique_ptr<PreTokenizer>> parts);
std::unique_ptr<PreTokenizer> make_split_pre_tokenizer(Regex pattern, SplitBehavior behavior, bool invert);
std::unique_ptr<PreTokenizer> make_byte_level_pre_tokenizer(bool add_prefix_space, bool use_regex);
enum class PrependScheme { kAlways, kFirst, kNever };
std::unique_ptr<PreTokenizer> make_metaspace_pre_tokenizer(std::string replacement, PrependScheme scheme,
                                                           bool split);
std::unique_ptr<PreTokenizer> make_digits_pre_tokenizer(bool individual_digits);

// ---- decoders ---------------------------------------------------------------------------------------------

class Decoder {
 public:
  virtual ~Decoder() = default;
  /// decode_chain: rewrites the list of token strings (joined with "" at the end).
  virtual void decode_chain(std::vector<std::string>& tokens) const = 0;
};

std::unique_ptr<Decoder> make_sequence_decoder(std::vector<std::unique_ptr<Decoder>> parts);
std::unique_ptr<Decoder> make_byte_level_decoder();
std::unique_ptr<Decoder> make_metaspace_decoder(std::string replacement, PrependScheme scheme);
std::unique_ptr<Decoder> make_replace_decoder(std::string literal, std::string content);
std::unique_ptr<Decoder> make_replace_decoder(Regex pattern, std::string content);
std::unique_ptr<Decoder> make_byte_fallback_decoder();
std::unique_ptr<Decoder> make_fuse_decoder();
std::unique_ptr<Decoder> make_strip_decoder(std::string content, std::size_t start, std::size_t stop);

// ---- post-processor ---------------------------------------------------------------------------------------

/// What the post-processor adds around a single sequence when add_special_tokens is true
/// (TemplateProcessing's `single`, applied in order for a Sequence of processors; ByteLevel adds nothing).
struct PostProcessor {
  std::vector<int64_t> prefix;
  std::vector<int64_t> suffix;
};

/// Replaces every non-overlapping occurrence of `literal` (non-empty) in `text` by `content`.
void replace_literal(std::string& text, const std::string& literal, const std::string& content);
/// Replaces every match of `pattern` in `text` by `content`.
void replace_regex(std::string& text, const Regex& pattern, const std::string& content);

/// Splits `text` at `matches` (from Regex::find_all) according to `behavior`, as NormalizedString::split.
void split_by_matches(const Piece& piece, const std::vector<std::pair<std::size_t, std::size_t>>& matches,
                      SplitBehavior behavior, bool invert, std::vector<Piece>& out);

}  // namespace accel::llm::detail
