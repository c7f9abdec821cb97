#pragma once
// The BPE model (tokenizers/src/models/bpe/{model.rs,word.rs}): a word's characters to vocabulary ids (with
// continuing_subword_prefix, end_of_word_suffix, byte_fallback, unk and fuse_unk), then merges applied by
// rank, lowest first and leftmost among equals; merged words are cached.

#include <cstdint>
#include <memory>
#include <optional>
#include <shared_mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace accel::llm::detail {

/// An insert-only open-addressing map from strings to 32-bit values (keys kept in one arena).
class StringTable {
 public:
  /// Inserts or overwrites.
  void set(std::string_view key, uint32_t value);
  /// The value of `key`, if present.
  std::optional<uint32_t> get(std::string_view key) const;
  std::size_t size() const { return count_; }
  static uint64_t hash(std::string_view key);

 private:
  struct Slot {
    uint64_t hash = 0;
    uint32_t offset = 0, length = 0, value = 0;
    bool used = false;
  };
  void grow();
  std::vector<Slot> slots_;
  std::string arena_;
  std::size_t count_ = 0;
};

struct BpeOptions {
  std::optional<std::string> unk_token;
  std::string continuing_subword_prefix;  // empty: none
  std::string end_of_word_suffix;         // empty: none
  bool fuse_unk = false;
  bool byte_fallback = false;
  bool ignore_merges = false;
};

class BpeModel {
 public:
  /// `vocab[i]` is the token of id `vocab_ids[i]`; merges are (left, right) token pairs in rank order.
  /// Throws std::invalid_argument naming a merge whose tokens are not in the vocabulary.
  BpeModel(std::vector<std::pair<std::string, uint32_t>> vocab,
           const std::vector<std::pair<std::string, std::string>>& merges, BpeOptions options);

  /// Replaces the options that do not change the merges (unk_token, fuse_unk, byte_fallback, ignore_merges);
  /// for transformers' tokenizer classes that rebuild the model. Call before the first tokenize().
  void set_options(const BpeOptions& options);
  const BpeOptions& options() const { return options_; }

  /// Appends the ids of one pre-tokenized word.
  void tokenize(std::string_view word, std::vector<int64_t>& out) const;

  std::optional<uint32_t> token_to_id(std::string_view token) const { return vocab_.get(token); }
  const std::string* id_to_token(uint32_t id) const;
  /// Number of vocabulary entries (the model's get_vocab_size()).
  std::size_t vocab_size() const { return vocab_.size(); }

 private:
  struct Symbol {
    uint32_t id;
    int32_t prev, next;
  };
  struct Merge {
    uint32_t rank, new_id;
  };
  void build_split_tables();
  void initial_symbols(std::string_view word, std::vector<Symbol>& symbols) const;
  void merge_all(std::vector<Symbol>& symbols) const;
  void merge_all_heap(std::vector<Symbol>& symbols) const;
  const Merge* find_merge(uint32_t left, uint32_t right) const;
  bool cache_get(std::string_view word, std::vector<int64_t>& out) const;
  void cache_set(std::string_view word, const std::vector<Symbol>& symbols) const;

  StringTable vocab_;
  std::vector<std::string> id_to_token_;
  std::vector<bool> has_token_;
  // Merges: an open-addressing table keyed by (left << 32 | right).
  struct MergeSlot {
    uint64_t key;  // left << 32 | right; kEmptyKey when free
    Merge merge;
  };
  std::vector<MergeSlot> merges_;  // key and value side by side: one cache line per probe
  uint64_t merge_mask_ = 0;
  BpeOptions options_;
  std::optional<uint32_t> unk_id_;
  uint32_t byte_ids_[256] = {};
  // Long words are cut where no merge can ever join the two characters (see split_points); the pieces are
  // short, so they are cached. Empty when the model has a subword prefix or suffix (position-dependent).
  void tokenize_word(std::string_view word, std::vector<int64_t>& out) const;
  bool can_join(char32_t left, char32_t right) const;
  std::vector<uint64_t> bigrams_;        // open-addressing set of (left << 32 | right) code-point pairs
  std::vector<bool> single_char_token_;  // code points below 0x30000 that are tokens by themselves
  bool split_long_words_ = false;
  static constexpr std::size_t kSplitMinBytes = 64;

  // Word -> ids cache, shared by the threads that encode (readers share the lock).
  mutable std::shared_mutex cache_mutex_;
  mutable StringTable cache_index_;
  mutable std::vector<uint32_t> cache_ids_;  // [count, ids...] runs
  static constexpr std::size_t kCacheCapacity = 1 << 18;
  static constexpr std::size_t kCacheMaxWordBytes = 256;
};

}  // namespace accel::llm::detail
