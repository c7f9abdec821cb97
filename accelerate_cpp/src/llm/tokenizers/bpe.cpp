#include "llm/tokenizers/bpe.hpp"

#include "llm/tokenizers/unicode.hpp"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <functional>
#include <mutex>
#include <queue>
#include <stdexcept>

namespace accel::llm::detail {

// ---- StringTable ------------------------------------------------------------------------------------------

uint64_t StringTable::hash(std::string_view key) {
  // FNV-1a over 8-byte words, then a final mix: cheap for the short keys of a vocabulary.
  uint64_t h = 0xcbf29ce484222325ULL ^ key.size();
  std::size_t i = 0;
  for (; i + 8 <= key.size(); i += 8) {
    uint64_t w;
    std::memcpy(&w, key.data() + i, 8);
    h = (h ^ w) * 0x100000001b3ULL;
    h ^= h >> 29;
  }
  for (; i < key.size(); ++i)
    h = (h ^ static_cast<unsigned char>(key[i])) * 0x100000001b3ULL;
  h ^= h >> 32;
  h *= 0xd6e8feb86659fd93ULL;
  h ^= h >> 32;
  return h;
}

void StringTable::grow() {
  std::vector<Slot> old;
  old.swap(slots_);
  slots_.assign(old.empty() ? 64 : old.size() * 2, Slot{});
  const std::size_t mask = slots_.size() - 1;
  for (const auto& s : old) {
    if (!s.used) continue;
    std::size_t i = s.hash & mask;
    while (slots_[i].used)
      i = (i + 1) & mask;
    slots_[i] = s;
  }
}

void StringTable::set(std::string_view key, uint32_t value) {
  if ((count_ + 1) * 2 > slots_.size()) grow();
  const uint64_t h = hash(key);
  const std::size_t mask = slots_.size() - 1;
  std::size_t i = h & mask;
  while (slots_[i].used) {
    const Slot& s = slots_[i];
    if (s.hash == h && std::string_view(arena_.data() + s.offset, s.length) == key) {
      slots_[i].value = value;
      return;
    }
    i = (i + 1) & mask;
  }
  slots_[i] = Slot{h, static_cast<uint32_t>(arena_.size()), static_cast<uint32_t>(key.size()), value, true};
  arena_.append(key.data(), key.size());
  ++count_;
}

std::optional<uint32_t> StringTable::get(std::string_view key) const {
  if (slots_.empty()) return std::nullopt;
  const uint64_t h = hash(key);
  const std::size_t mask = slots_.size() - 1;
  for (std::size_t i = h & mask;; i = (i + 1) & mask) {
    const Slot& s = slots_[i];
    if (!s.used) return std::nullopt;
    if (s.hash == h && s.length == key.size() &&
        std::memcmp(arena_.data() + s.offset, key.data(), key.size()) == 0)
      return s.value;
  }
}

// ---- BpeModel ---------------------------------------------------------------------------------------------

namespace {
constexpr uint64_t kEmptyKey = ~0ULL;
constexpr uint32_t kNoId = ~0U;
uint64_t mix64(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  return x;
}
}  // namespace

BpeModel::BpeModel(std::vector<std::pair<std::string, uint32_t>> vocab,
                   const std::vector<std::pair<std::string, std::string>>& merges, BpeOptions options)
    : options_(std::move(options)) {
  uint32_t max_id = 0;
  for (const auto& [token, id] : vocab) {
    vocab_.set(token, id);
    max_id = std::max(max_id, id);
  }
  id_to_token_.resize(vocab.empty() ? 0 : max_id + 1);
  has_token_.assign(id_to_token_.size(), false);
  for (auto& [token, id] : vocab) {
    id_to_token_[id] = std::move(token);
    has_token_[id] = true;
  }
  std::size_t capacity = 16;
  while (capacity < merges.size() * 2 + 16)
    capacity *= 2;
  merges_.assign(capacity, MergeSlot{kEmptyKey, Merge{0, 0}});
  merge_mask_ = capacity - 1;
  const std::size_t prefix = options_.continuing_subword_prefix.size();
  for (std::size_t rank = 0; rank < merges.size(); ++rank) {
    const auto& [a, b] = merges[rank];
    const auto a_id = vocab_.get(a), b_id = vocab_.get(b);
    if (!a_id)
      throw std::invalid_argument("merge " + std::to_string(rank) + " (\"" + a + " " + b + "\"): \"" + a +
                                  "\" is not in the vocabulary");
    if (!b_id)
      throw std::invalid_argument("merge " + std::to_string(rank) + " (\"" + a + " " + b + "\"): \"" + b +
                                  "\" is not in the vocabulary");
    const std::string merged = a + (b.size() >= prefix ? b.substr(prefix) : b);
    const auto new_id = vocab_.get(merged);
    if (!new_id)
      throw std::invalid_argument("merge " + std::to_string(rank) + " (\"" + a + " " + b +
                                  "\"): the merged token \"" + merged + "\" is not in the vocabulary");
    const uint64_t key = (static_cast<uint64_t>(*a_id) << 32) | *b_id;
    std::size_t i = mix64(key) & merge_mask_;
    while (merges_[i].key != kEmptyKey && merges_[i].key != key)
      i = (i + 1) & merge_mask_;
    // A repeated pair keeps the later rank, as HF's HashMap collect does.
    merges_[i] = MergeSlot{key, Merge{static_cast<uint32_t>(rank), *new_id}};
  }
  if (options_.unk_token) unk_id_ = vocab_.get(*options_.unk_token);
  for (int b = 0; b < 256; ++b) {
    char name[8];
    std::snprintf(name, sizeof name, "<0x%02X>", b);
    const auto id = vocab_.get(name);
    byte_ids_[b] = id ? *id : kNoId;
  }
  build_split_tables();
}

// Every pair of adjacent characters inside a vocabulary token, and the characters that are tokens alone. Two
// neighbouring characters that are both tokens and never adjacent inside a token can never be joined by a
// merge: the symbols on either side always end with the left character and start with the right one, and
// their merge would be a token holding the pair. The word can be cut there and each part merged on its own
// with the same result (merges in different parts do not interact, and the rank order within a part is
// unchanged). Not with a subword prefix or suffix, which depend on the position in the word.
void BpeModel::build_split_tables() {
  if (!options_.continuing_subword_prefix.empty() || !options_.end_of_word_suffix.empty()) return;
  std::vector<uint64_t> pairs;
  single_char_token_.assign(0x30000, false);
  for (uint32_t id = 0; id < id_to_token_.size(); ++id) {
    if (!has_token_[id]) continue;
    const std::string& t = id_to_token_[id];
    if (t.empty()) continue;
    std::size_t pos = 0;
    char32_t prev = next_code_point(t, pos);
    if (pos == t.size() && prev < 0x30000) single_char_token_[prev] = true;
    while (pos < t.size()) {
      const char32_t cp = next_code_point(t, pos);
      pairs.push_back((static_cast<uint64_t>(prev) << 32) | cp);
      prev = cp;
    }
  }
  std::size_t capacity = 16;
  while (capacity < pairs.size() * 2 + 16)
    capacity *= 2;
  bigrams_.assign(capacity, kEmptyKey);
  for (const uint64_t key : pairs) {
    std::size_t i = mix64(key) & (capacity - 1);
    while (bigrams_[i] != kEmptyKey && bigrams_[i] != key)
      i = (i + 1) & (capacity - 1);
    bigrams_[i] = key;
  }
  split_long_words_ = true;
}

bool BpeModel::can_join(char32_t left, char32_t right) const {
  if (left >= 0x30000 || right >= 0x30000 || !single_char_token_[left] || !single_char_token_[right])
    return true;
  const uint64_t key = (static_cast<uint64_t>(left) << 32) | right;
  const std::size_t mask = bigrams_.size() - 1;
  for (std::size_t i = mix64(key) & mask;; i = (i + 1) & mask) {
    if (bigrams_[i] == key) return true;
    if (bigrams_[i] == kEmptyKey) return false;
  }
}

void BpeModel::set_options(const BpeOptions& options) {
  options_.unk_token = options.unk_token;
  options_.fuse_unk = options.fuse_unk;
  options_.byte_fallback = options.byte_fallback;
  options_.ignore_merges = options.ignore_merges;
  unk_id_.reset();
  if (options_.unk_token) unk_id_ = vocab_.get(*options_.unk_token);
}

const std::string* BpeModel::id_to_token(uint32_t id) const {
  return id < id_to_token_.size() && has_token_[id] ? &id_to_token_[id] : nullptr;
}

const BpeModel::Merge* BpeModel::find_merge(uint32_t left, uint32_t right) const {
  const uint64_t key = (static_cast<uint64_t>(left) << 32) | right;
  for (std::size_t i = mix64(key) & merge_mask_;; i = (i + 1) & merge_mask_) {
    if (merges_[i].key == key) return &merges_[i].merge;
    if (merges_[i].key == kEmptyKey) return nullptr;
  }
}

// model.rs merge_word: one symbol per character (prefix on all but the first, suffix on the last), byte
// fallback or unk for characters outside the vocabulary.
void BpeModel::initial_symbols(std::string_view word, std::vector<Symbol>& symbols) const {
  symbols.clear();
  uint32_t pending_unk = kNoId;  // an unk waiting for the next known character (fuse_unk extends it)
  std::string decorated;
  auto add = [&](uint32_t id) {
    const auto n = static_cast<int32_t>(symbols.size());
    symbols.push_back(Symbol{id, n - 1, n + 1});
  };
  const bool decorate = !options_.continuing_subword_prefix.empty() || !options_.end_of_word_suffix.empty();
  for (std::size_t pos = 0; pos < word.size();) {
    const std::size_t begin = pos;
    pos += utf8_length(static_cast<unsigned char>(word[pos]));
    if (pos > word.size()) pos = word.size();
    std::string_view s = word.substr(begin, pos - begin);
    if (decorate) {
      decorated.clear();
      if (begin != 0) decorated += options_.continuing_subword_prefix;
      decorated += s;
      if (pos == word.size()) decorated += options_.end_of_word_suffix;
      s = decorated;
    }
    if (const auto id = vocab_.get(s)) {
      if (pending_unk != kNoId) add(pending_unk);
      pending_unk = kNoId;
      add(*id);
      continue;
    }
    if (options_.byte_fallback) {
      bool all = true;
      for (const char c : s)
        all = all && byte_ids_[static_cast<unsigned char>(c)] != kNoId;
      if (all) {
        for (const char c : s)
          add(byte_ids_[static_cast<unsigned char>(c)]);
        continue;
      }
    }
    if (options_.unk_token) {
      if (!unk_id_)
        throw std::runtime_error("the unk_token \"" + *options_.unk_token + "\" is not in the vocabulary");
      if (pending_unk != kNoId && !options_.fuse_unk) add(pending_unk);
      pending_unk = *unk_id_;
    }
  }
  if (pending_unk != kNoId) add(pending_unk);
  if (!symbols.empty()) symbols.back().next = -1;
}

// word.rs merge_all with its binary heap, for long words: entries (rank, position) popped lowest first; an
// entry whose pair has changed since it was pushed is skipped. HF re-checks that the current pair's merge has
// the entry's new id; comparing the pair's two ids is the same test without a lookup (a symbol's string only
// grows, so a changed pair never makes the same token).
void BpeModel::merge_all_heap(std::vector<Symbol>& symbols) const {
  // (rank << 32 | position) orders the heap with one comparison; the pair's ids identify the merge.
  struct Entry {
    uint64_t order;
    uint32_t left, right;
    bool operator>(const Entry& o) const { return order > o.order; }
  };
  std::vector<Entry> storage;
  storage.reserve(symbols.size() * 2);
  std::priority_queue<Entry, std::vector<Entry>, std::greater<Entry>> queue(std::greater<Entry>(),
                                                                            std::move(storage));
  auto push = [&](int32_t pos, uint32_t left, uint32_t right) {
    if (const Merge* m = find_merge(left, right))
      queue.push(Entry{(static_cast<uint64_t>(m->rank) << 32) | static_cast<uint32_t>(pos), left, right});
  };
  for (std::size_t i = 0; i + 1 < symbols.size(); ++i)
    push(static_cast<int32_t>(i), symbols[i].id, symbols[i + 1].id);
  while (!queue.empty()) {
    const Entry top = queue.top();
    queue.pop();
    const auto pos = static_cast<int32_t>(top.order & 0xFFFFFFFFu);
    Symbol& left = symbols[pos];
    // A merged-away symbol has prev == -2; its id no longer matters.
    if (left.prev == -2 || left.next < 0 || left.id != top.left || symbols[left.next].id != top.right)
      continue;
    const int32_t right = left.next;
    left.id = find_merge(top.left, top.right)->new_id;
    symbols[right].prev = -2;
    left.next = symbols[right].next;
    if (left.next >= 0) symbols[left.next].prev = pos;
    if (left.prev >= 0) push(left.prev, symbols[left.prev].id, left.id);
    if (left.next >= 0) push(pos, left.id, symbols[left.next].id);
  }
}

// word.rs merge_all: repeatedly the pair of lowest rank, leftmost among equal ranks (the heap's order). Short
// words scan the pairs instead of keeping a heap.
void BpeModel::merge_all(std::vector<Symbol>& symbols) const {
  if (symbols.size() < 2) return;
  if (symbols.size() > 48) {
    merge_all_heap(symbols);
    return;
  }
  thread_local std::vector<const Merge*> pair_merge;  // merge of (i, next(i)), or null
  pair_merge.assign(symbols.size(), nullptr);
  for (std::size_t i = 0; i + 1 < symbols.size(); ++i)
    pair_merge[i] = find_merge(symbols[i].id, symbols[i + 1].id);
  for (;;) {
    int32_t best = -1;
    uint32_t best_rank = ~0U;
    for (int32_t i = 0; i >= 0 && i < static_cast<int32_t>(symbols.size()); i = symbols[i].next) {
      const Merge* m = pair_merge[i];
      if (m != nullptr && m->rank < best_rank) {
        best_rank = m->rank;
        best = i;
      }
    }
    if (best < 0) return;
    Symbol& left = symbols[best];
    const int32_t right = left.next;
    left.id = pair_merge[best]->new_id;
    left.next = symbols[right].next;
    if (left.next >= 0) symbols[left.next].prev = best;
    pair_merge[right] = nullptr;
    pair_merge[best] = left.next >= 0 ? find_merge(left.id, symbols[left.next].id) : nullptr;
    if (left.prev >= 0) pair_merge[left.prev] = find_merge(symbols[left.prev].id, left.id);
  }
}

bool BpeModel::cache_get(std::string_view word, std::vector<int64_t>& out) const {
  std::shared_lock<std::shared_mutex> lock(cache_mutex_);
  const auto at = cache_index_.get(word);
  if (!at) return false;
  const uint32_t n = cache_ids_[*at];
  for (uint32_t k = 0; k < n; ++k)
    out.push_back(cache_ids_[*at + 1 + k]);
  return true;
}

void BpeModel::cache_set(std::string_view word, const std::vector<Symbol>& symbols) const {
  std::unique_lock<std::shared_mutex> lock(cache_mutex_, std::try_to_lock);
  if (!lock.owns_lock() || cache_index_.size() >= kCacheCapacity) return;
  const auto at = static_cast<uint32_t>(cache_ids_.size());
  cache_ids_.push_back(0);
  uint32_t n = 0;
  for (int32_t i = symbols.empty() ? -1 : 0; i >= 0; i = symbols[i].next, ++n)
    cache_ids_.push_back(symbols[i].id);
  cache_ids_[at] = n;
  cache_index_.set(word, at);
}

void BpeModel::tokenize(std::string_view word, std::vector<int64_t>& out) const {
  if (word.empty()) return;
  if (options_.ignore_merges) {
    if (const auto id = vocab_.get(word)) {
      out.push_back(*id);
      return;
    }
  }
  if (!split_long_words_ || word.size() < kSplitMinBytes) {
    tokenize_word(word, out);
    return;
  }
  std::size_t start = 0, pos = 0;
  char32_t prev = next_code_point(word, pos);
  while (pos < word.size()) {
    const std::size_t at = pos;
    const char32_t cp = next_code_point(word, pos);
    if (!can_join(prev, cp)) {
      tokenize_word(word.substr(start, at - start), out);
      start = at;
    }
    prev = cp;
  }
  tokenize_word(word.substr(start), out);
}

void BpeModel::tokenize_word(std::string_view word, std::vector<int64_t>& out) const {
  const bool cacheable = word.size() < kCacheMaxWordBytes;
  if (cacheable && cache_get(word, out)) return;
  thread_local std::vector<Symbol> symbols;
  initial_symbols(word, symbols);
  merge_all(symbols);
  for (int32_t i = symbols.empty() ? -1 : 0; i >= 0; i = symbols[i].next)
    out.push_back(symbols[i].id);
  if (cacheable) cache_set(word, symbols);
}

}  // namespace accel::llm::detail
