#pragma once
// Added and special tokens (tokenizers/src/tokenizer/added_vocabulary.rs): matched in the text before the
// model, leftmost and longest first (Aho-Corasick's LeftmostLongest), with lstrip / rstrip / single_word;
// those with normalized=false on the raw text, the others on the normalized pieces.

#include "llm/tokenizers/bpe.hpp"
#include "llm/tokenizers/normalizers.hpp"

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace accel::llm::detail {

struct AddedToken {
  std::string content;
  bool single_word = false, lstrip = false, rstrip = false, normalized = true, special = false;
};

/// A piece of input after the added tokens are taken out: either an added token's id or text for the
/// pre-tokenizer (normalized).
struct Segment {
  std::string text;
  std::optional<uint32_t> id;
  bool at_origin = false;
};

class AddedVocabulary {
 public:
  /// AddedVocabulary::add_tokens: ids from the model's vocabulary when the content is there, else the next
  /// free id after the model's vocabulary and the tokens added before.
  void add_tokens(const std::vector<AddedToken>& tokens, const BpeModel& model, const Normalizer* normalizer);

  /// extract_and_normalize: the segments of `text`, in order.
  void extract_and_normalize(const Normalizer* normalizer, std::string_view text,
                             std::vector<Segment>& out) const;

  std::optional<uint32_t> token_to_id(std::string_view content) const;
  const AddedToken* token_of(uint32_t id) const;
  /// A normalized token's content as the normalizer makes it (tokenizers' id_to_token and decode give it), or
  /// nullptr for a token matched in the raw text.
  const std::string* normalized_content(uint32_t id) const {
    const auto it = normalized_content_.find(id);
    return it == normalized_content_.end() ? nullptr : &it->second;
  }
  bool is_special(std::string_view content) const { return special_set_.count(std::string(content)) != 0; }
  std::size_t size() const { return by_id_.size(); }
  /// Number of added contents that are not tokens of `model` (get_vocab(with_added_tokens) counts them once).
  std::size_t count_outside(const BpeModel& model) const {
    std::size_t n = 0;
    for (const auto& entry : by_content_)
      n += model.token_to_id(entry.first) ? 0 : 1;
    return n;
  }
  /// Largest id in use, if any.
  std::optional<uint32_t> max_id() const;

 private:
  struct Trie {
    struct Node {
      std::vector<std::pair<unsigned char, int32_t>> children;
      int32_t pattern = -1;
    };
    std::vector<Node> nodes{Node{}};
    std::vector<uint32_t> ids;  // pattern -> token id
    bool first_byte[256] = {};
    void add(std::string_view pattern, uint32_t id);
    /// Leftmost-longest match starting at or after `from`: (start, end, id).
    bool find(std::string_view text, std::size_t from, std::size_t& start, std::size_t& end,
              uint32_t& id) const;
  };
  void refresh(const Normalizer* normalizer);
  void find_matches(std::string_view text, const Trie& trie,
                    std::vector<std::pair<std::size_t, std::size_t>>& spans,
                    std::vector<std::optional<uint32_t>>& ids) const;

  std::unordered_map<std::string, uint32_t> by_content_;
  std::unordered_map<uint32_t, AddedToken> by_id_;
  std::vector<AddedToken> classic_, special_;
  std::unordered_set<std::string> special_set_;
  Trie raw_trie_, normalized_trie_;
  std::unordered_map<uint32_t, std::string> normalized_content_;
};

}  // namespace accel::llm::detail
