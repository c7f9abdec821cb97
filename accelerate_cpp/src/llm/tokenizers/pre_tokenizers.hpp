#pragma once
// Pre-tokenizers (tokenizers/src/pre_tokenizers): cut the normalized text into the words the model sees.

#include "llm/tokenizers/regex.hpp"

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace accel::llm::detail {

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

/// Splits `text` at `matches` (from Regex::find_all) according to `behavior`, as NormalizedString::split.
void split_by_matches(const Piece& piece, const std::vector<std::pair<std::size_t, std::size_t>>& matches,
                      SplitBehavior behavior, bool invert, std::vector<Piece>& out);

}  // namespace accel::llm::detail
