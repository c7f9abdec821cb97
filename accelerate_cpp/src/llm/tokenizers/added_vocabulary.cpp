#include "llm/tokenizers/added_vocabulary.hpp"

#include "llm/tokenizers/unicode.hpp"

#include <algorithm>

namespace accel::llm::detail {

void AddedVocabulary::Trie::add(std::string_view pattern, uint32_t id) {
  int32_t node = 0;
  for (const char ch : pattern) {
    const auto c = static_cast<unsigned char>(ch);
    auto& children = nodes[node].children;
    auto it = std::find_if(children.begin(), children.end(), [c](const auto& p) { return p.first == c; });
    if (it == children.end()) {
      const auto next = static_cast<int32_t>(nodes.size());
      nodes[node].children.emplace_back(c, next);
      nodes.push_back(Node{});
      node = next;
    } else {
      node = it->second;
    }
  }
  if (pattern.empty() || nodes[node].pattern >= 0) return;
  nodes[node].pattern = static_cast<int32_t>(ids.size());
  ids.push_back(id);
  first_byte[static_cast<unsigned char>(pattern[0])] = true;
}

bool AddedVocabulary::Trie::find(std::string_view text, std::size_t from, std::size_t& start,
                                 std::size_t& end, uint32_t& id) const {
  if (ids.empty()) return false;
  for (std::size_t i = from; i < text.size(); ++i) {
    if (!first_byte[static_cast<unsigned char>(text[i])]) continue;
    int32_t node = 0, best = -1;
    std::size_t best_end = 0;
    for (std::size_t j = i; j < text.size(); ++j) {
      const auto c = static_cast<unsigned char>(text[j]);
      const auto& children = nodes[node].children;
      auto it = std::find_if(children.begin(), children.end(), [c](const auto& p) { return p.first == c; });
      if (it == children.end()) break;
      node = it->second;
      if (nodes[node].pattern >= 0) {
        best = nodes[node].pattern;
        best_end = j + 1;
      }
    }
    if (best >= 0) {
      start = i;
      end = best_end;
      id = ids[best];
      return true;
    }
  }
  return false;
}

void AddedVocabulary::add_tokens(const std::vector<AddedToken>& tokens, const BpeModel& model,
                                 const Normalizer* normalizer) {
  for (const auto& token : tokens) {
    if (token.special && !token.content.empty() && special_set_.insert(token.content).second)
      special_.push_back(token);
  }
  for (const auto& token : tokens) {
    if (token.content.empty()) continue;
    const bool same = std::any_of(by_id_.begin(), by_id_.end(), [&](const auto& p) {
      const AddedToken& t = p.second;
      return t.content == token.content && t.single_word == token.single_word && t.lstrip == token.lstrip &&
             t.rstrip == token.rstrip && t.normalized == token.normalized && t.special == token.special;
    });
    if (same) continue;
    uint32_t id = 0;
    if (const auto existing = token_to_id(token.content)) {
      id = *existing;
    } else if (const auto existing_model = model.token_to_id(token.content)) {
      id = *existing_model;
    } else {
      const auto vocab = static_cast<uint32_t>(model.vocab_size());
      const auto max = max_id();
      id = !max ? vocab : (*max >= vocab || vocab == 0) ? *max + 1 : vocab;
    }
    by_content_[token.content] = id;
    by_id_[id] = token;
    if (special_set_.count(token.content) == 0) classic_.push_back(token);
  }
  refresh(normalizer);
}

void AddedVocabulary::refresh(const Normalizer* normalizer) {
  raw_trie_ = Trie{};
  normalized_trie_ = Trie{};
  normalized_content_.clear();
  auto add = [&](const AddedToken& token) {
    const uint32_t id = *token_to_id(token.content);
    if (!token.normalized) {
      raw_trie_.add(token.content, id);
      return;
    }
    std::string content = token.content;
    if (normalizer != nullptr) normalizer->normalize(content);
    normalized_trie_.add(content, id);
    normalized_content_[id] = content;
  };
  for (const auto& token : special_)
    add(token);
  for (const auto& token : classic_)
    add(token);
}

std::optional<uint32_t> AddedVocabulary::token_to_id(std::string_view content) const {
  const auto it = by_content_.find(std::string(content));
  if (it == by_content_.end()) return std::nullopt;
  return it->second;
}

const AddedToken* AddedVocabulary::token_of(uint32_t id) const {
  const auto it = by_id_.find(id);
  return it == by_id_.end() ? nullptr : &it->second;
}

std::optional<uint32_t> AddedVocabulary::max_id() const {
  std::optional<uint32_t> max;
  for (const auto& entry : by_content_)
    max = max ? std::max(*max, entry.second) : entry.second;
  return max;
}

namespace {

bool ends_with_word(std::string_view s) {
  if (s.empty()) return false;
  std::size_t pos = s.size() - 1;
  while (pos > 0 && (static_cast<unsigned char>(s[pos]) & 0xC0) == 0x80)
    --pos;
  return is_word_char(next_code_point(s, pos));
}

bool starts_with_word(std::string_view s) {
  if (s.empty()) return false;
  std::size_t pos = 0;
  return is_word_char(next_code_point(s, pos));
}

// Start of the trailing white space of `s` (LEFTMOST_SPACE_AT_END).
std::size_t trailing_space_start(std::string_view s) {
  std::size_t start = s.size();
  while (start > 0) {
    std::size_t p = start - 1;
    while (p > 0 && (static_cast<unsigned char>(s[p]) & 0xC0) == 0x80)
      --p;
    std::size_t q = p;
    if (!is_white_space(next_code_point(s, q))) break;
    start = p;
  }
  return start;
}

// Length of the leading white space of `s` (RIGHTMOST_SPACE_AT_START).
std::size_t leading_space_length(std::string_view s) {
  std::size_t pos = 0;
  while (pos < s.size()) {
    std::size_t q = pos;
    if (!is_white_space(next_code_point(s, q))) break;
    pos = q;
  }
  return pos;
}

}  // namespace

void AddedVocabulary::find_matches(std::string_view text, const Trie& trie,
                                   std::vector<std::pair<std::size_t, std::size_t>>& spans,
                                   std::vector<std::optional<uint32_t>>& ids) const {
  spans.clear();
  ids.clear();
  std::size_t start_offset = 0, from = 0, mstart = 0, mend = 0;
  uint32_t id = 0;
  while (trie.find(text, from, mstart, mend, id)) {
    from = mend;
    std::size_t start = mstart, stop = mend;
    const AddedToken& token = by_id_.at(id);
    if (token.single_word) {
      const bool start_space = start == 0 || !ends_with_word(text.substr(0, start));
      const bool stop_space = stop == text.size() || !starts_with_word(text.substr(stop));
      if (!start_space || !stop_space) continue;
    }
    if (token.lstrip) start = std::max(trailing_space_start(text.substr(0, start)), start_offset);
    if (token.rstrip) stop += leading_space_length(text.substr(stop));
    if (start_offset < start) {
      spans.emplace_back(start_offset, start);
      ids.emplace_back(std::nullopt);
    }
    spans.emplace_back(start, stop);
    ids.emplace_back(id);
    start_offset = stop;
  }
  if (start_offset != text.size()) {
    spans.emplace_back(start_offset, text.size());
    ids.emplace_back(std::nullopt);
  }
}

void AddedVocabulary::extract_and_normalize(const Normalizer* normalizer, std::string_view text,
                                            std::vector<Segment>& out) const {
  out.clear();
  std::vector<std::pair<std::size_t, std::size_t>> spans, inner_spans;
  std::vector<std::optional<uint32_t>> ids, inner_ids;
  find_matches(text, raw_trie_, spans, ids);
  for (std::size_t k = 0; k < spans.size(); ++k) {
    const auto [start, end] = spans[k];
    if (end <= start) continue;
    if (ids[k]) {
      out.push_back(Segment{std::string(text.substr(start, end - start)), ids[k], start == 0});
      continue;
    }
    std::string piece(text.substr(start, end - start));
    if (normalizer != nullptr) normalizer->normalize(piece);
    find_matches(piece, normalized_trie_, inner_spans, inner_ids);
    for (std::size_t j = 0; j < inner_spans.size(); ++j) {
      const auto [s, e] = inner_spans[j];
      if (e <= s) continue;
      out.push_back(Segment{piece.substr(s, e - s), inner_ids[j], start == 0 && s == 0});
    }
  }
}

}  // namespace accel::llm::detail
