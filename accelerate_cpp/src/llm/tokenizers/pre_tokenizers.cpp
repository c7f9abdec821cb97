// Pre-tokenizers (tokenizers/src/pre_tokenizers): Sequence, Split, ByteLevel, Metaspace, Digits, and the
// splitting rules of NormalizedString::split they share.
#include "llm/tokenizers/pre_tokenizers.hpp"

#include "llm/tokenizers/normalizers.hpp"
#include "llm/tokenizers/unicode.hpp"

#include <algorithm>

namespace accel::llm::detail {
namespace {

using Spans = std::vector<std::pair<std::size_t, std::size_t>>;
struct Span {
  std::size_t start, end;
  bool flag;  // find_matches: "is a match"; after the behavior: "remove"
};

// Pattern::find_matches: the matches and the gaps between them, covering the whole text.
void cover(std::size_t size, const Spans& matches, bool invert, std::vector<Span>& out) {
  out.clear();
  if (size == 0) {
    out.push_back({0, 0, invert});
    return;
  }
  std::size_t prev = 0;
  for (const auto& [start, end] : matches) {
    if (prev != start) out.push_back({prev, start, invert});
    out.push_back({start, end, !invert});
    prev = end;
  }
  if (prev != size) out.push_back({prev, size, invert});
}

// The fold of NormalizedString::split for each behavior: returns (offsets, remove) spans.
void apply_behavior(std::vector<Span>& spans, SplitBehavior behavior) {
  std::vector<Span> out;
  out.reserve(spans.size());
  bool previous_match = false;
  switch (behavior) {
    case SplitBehavior::kIsolated:
      for (auto& s : spans)
        s.flag = false;
      return;
    case SplitBehavior::kRemoved:
      return;
    case SplitBehavior::kContiguous:
      for (const auto& s : spans) {
        if (s.flag == previous_match && !out.empty()) {
          out.back().end = s.end;
        } else {
          out.push_back({s.start, s.end, false});
        }
        previous_match = s.flag;
      }
      break;
    case SplitBehavior::kMergedWithPrevious:
      for (const auto& s : spans) {
        if (s.flag && !previous_match && !out.empty()) {
          out.back().end = s.end;
        } else {
          out.push_back({s.start, s.end, false});
        }
        previous_match = s.flag;
      }
      break;
    case SplitBehavior::kMergedWithNext:
      for (auto it = spans.rbegin(); it != spans.rend(); ++it) {
        if (it->flag && !previous_match && !out.empty()) {
          out.back().start = it->start;
        } else {
          out.push_back({it->start, it->end, false});
        }
        previous_match = it->flag;
      }
      std::reverse(out.begin(), out.end());
      break;
  }
  spans.swap(out);
}

void literal_matches(std::string_view text, std::string_view literal, Spans& out) {
  out.clear();
  for (std::size_t pos = text.find(literal); pos != std::string_view::npos; pos = text.find(literal, pos)) {
    out.emplace_back(pos, pos + literal.size());
    pos += literal.size();
  }
}

class SequencePreTokenizer final : public PreTokenizer {
 public:
  explicit SequencePreTokenizer(std::vector<std::unique_ptr<PreTokenizer>> parts)
      : parts_(std::move(parts)) {}
  void pre_tokenize(std::vector<Piece>& pieces) const override {
    for (const auto& part : parts_)
      part->pre_tokenize(pieces);
  }

 private:
  std::vector<std::unique_ptr<PreTokenizer>> parts_;
};

class SplitPreTokenizer final : public PreTokenizer {
 public:
  SplitPreTokenizer(Regex pattern, SplitBehavior behavior, bool invert)
      : pattern_(std::move(pattern)), behavior_(behavior), invert_(invert) {}
  void pre_tokenize(std::vector<Piece>& pieces) const override {
    thread_local Spans matches;
    std::vector<Piece> out;
    out.reserve(pieces.size() * 4);
    for (const auto& piece : pieces) {
      pattern_.find_all(piece.text, matches);
      split_by_matches(piece, matches, behavior_, invert_, out);
    }
    pieces.swap(out);
  }

 private:
  Regex pattern_;
  SplitBehavior behavior_;
  bool invert_;
};

// GPT-2's pattern, as byte_level.rs compiles it.
const Regex& gpt2_regex() {
  static const Regex regex(R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)");
  return regex;
}

class ByteLevelPreTokenizer final : public PreTokenizer {
 public:
  ByteLevelPreTokenizer(bool add_prefix_space, bool use_regex)
      : add_prefix_space_(add_prefix_space), use_regex_(use_regex) {}
  void pre_tokenize(std::vector<Piece>& pieces) const override {
    if (add_prefix_space_) {
      for (auto& piece : pieces)
        if (!piece.text.empty() && piece.text[0] != ' ') piece.text.insert(0, 1, ' ');
    }
    if (use_regex_) {
      thread_local Spans matches;
      std::vector<Piece> out;
      out.reserve(pieces.size() * 4);
      for (const auto& piece : pieces) {
        gpt2_regex().find_all(piece.text, matches);
        split_by_matches(piece, matches, SplitBehavior::kIsolated, false, out);
      }
      pieces.swap(out);
    }
    const ByteLevelAlphabet& alphabet = ByteLevelAlphabet::get();
    std::string mapped;
    for (auto& piece : pieces) {
      mapped.clear();
      for (const char c : piece.text)
        mapped += alphabet.encode(static_cast<unsigned char>(c));
      piece.text.swap(mapped);
    }
  }

 private:
  bool add_prefix_space_, use_regex_;
};

class MetaspacePreTokenizer final : public PreTokenizer {
 public:
  MetaspacePreTokenizer(std::string replacement, PrependScheme scheme, bool split)
      : replacement_(std::move(replacement)), scheme_(scheme), split_(split) {}
  void pre_tokenize(std::vector<Piece>& pieces) const override {
    std::vector<Piece> out;
    thread_local Spans matches;
    for (auto& piece : pieces) {
      replace_literal(piece.text, " ", replacement_);
      const bool starts = piece.text.compare(0, replacement_.size(), replacement_) == 0;
      if (!starts &&
          (scheme_ == PrependScheme::kAlways || (scheme_ == PrependScheme::kFirst && piece.at_origin)))
        piece.text.insert(0, replacement_);
      if (split_) {
        literal_matches(piece.text, replacement_, matches);
        split_by_matches(piece, matches, SplitBehavior::kMergedWithNext, false, out);
      } else if (!piece.text.empty()) {
        out.push_back(std::move(piece));
      }
    }
    pieces.swap(out);
  }

 private:
  std::string replacement_;
  PrependScheme scheme_;
  bool split_;
};

#include "llm/tokenizers/unicode_numeric.inc"

// Digits: Rust's char::is_numeric (general category N), each digit isolated or runs kept together. Rust's
// tables (Unicode 17 in tokenizers 0.23) are newer than Oniguruma's \p{N}: unicode_numeric.inc adds the rest.
class DigitsPreTokenizer final : public PreTokenizer {
 public:
  explicit DigitsPreTokenizer(bool individual)
      : individual_(individual), numeric_(std::string(R"([\p{N})") + kRustNumericExtra + "]") {}
  void pre_tokenize(std::vector<Piece>& pieces) const override {
    thread_local Spans matches;
    std::vector<Piece> out;
    for (const auto& piece : pieces) {
      numeric_.find_all(piece.text, matches);
      split_by_matches(piece, matches, individual_ ? SplitBehavior::kIsolated : SplitBehavior::kContiguous,
                       false, out);
    }
    pieces.swap(out);
  }

 private:
  bool individual_;
  Regex numeric_;
};

}  // namespace

void split_by_matches(const Piece& piece, const Spans& matches, SplitBehavior behavior, bool invert,
                      std::vector<Piece>& out) {
  thread_local std::vector<Span> spans;
  cover(piece.text.size(), matches, invert, spans);
  apply_behavior(spans, behavior);
  for (const auto& s : spans) {
    if (s.flag || s.end == s.start) continue;
    out.push_back(Piece{piece.text.substr(s.start, s.end - s.start), piece.at_origin && s.start == 0});
  }
}

std::unique_ptr<PreTokenizer> make_sequence_pre_tokenizer(std::vector<std::unique_ptr<PreTokenizer>> parts) {
  return std::make_unique<SequencePreTokenizer>(std::move(parts));
}
std::unique_ptr<PreTokenizer> make_split_pre_tokenizer(Regex pattern, SplitBehavior behavior, bool invert) {
  return std::make_unique<SplitPreTokenizer>(std::move(pattern), behavior, invert);
}
std::unique_ptr<PreTokenizer> make_byte_level_pre_tokenizer(bool add_prefix_space, bool use_regex) {
  return std::make_unique<ByteLevelPreTokenizer>(add_prefix_space, use_regex);
}
std::unique_ptr<PreTokenizer> make_metaspace_pre_tokenizer(std::string replacement, PrependScheme scheme,
                                                           bool split) {
  return std::make_unique<MetaspacePreTokenizer>(std::move(replacement), scheme, split);
}
std::unique_ptr<PreTokenizer> make_digits_pre_tokenizer(bool individual_digits) {
  return std::make_unique<DigitsPreTokenizer>(individual_digits);
}

}  // namespace accel::llm::detail
