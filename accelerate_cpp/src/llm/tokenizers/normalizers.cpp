// Normalizers (tokenizers/src/normalizers): Unicode forms through utf8proc (with tokenizers' older tables:
// unicode_norm.inc), Sequence, Prepend, Replace.
#include "llm/tokenizers/normalizers.hpp"

#include <utf8proc.h>

#include <algorithm>
#include <bitset>
#include <cstdlib>
#include <iterator>
#include <stdexcept>

namespace accel::llm::detail {

void replace_literal(std::string& text, const std::string& literal, const std::string& content) {
  std::size_t pos = text.find(literal);
  if (pos == std::string::npos) return;
  std::string out;
  out.reserve(text.size() + text.size() / 4);
  std::size_t last = 0;
  while (pos != std::string::npos) {
    out.append(text, last, pos - last);
    out += content;
    last = pos + literal.size();
    pos = text.find(literal, last);
  }
  out.append(text, last, std::string::npos);
  text.swap(out);
}

void replace_regex(std::string& text, const Regex& pattern, const std::string& content) {
  thread_local std::vector<std::pair<std::size_t, std::size_t>> matches;
  pattern.find_all(text, matches);
  if (matches.empty()) return;
  std::string out;
  std::size_t last = 0;
  for (const auto& [start, end] : matches) {
    out.append(text, last, start - last);
    out += content;
    last = end;
  }
  out.append(text, last, std::string::npos);
  text.swap(out);
}

namespace {

#include "llm/tokenizers/unicode_norm.inc"

// Hugging Face tokenizers normalizes with older Unicode tables than utf8proc's: the code points of
// kNormalizationUnknown (decomposed, reordered as marks or composed by utf8proc only) are unknown to it. Each
// is given to utf8proc as a surrogate stand-in (0xD800 + its index), which utf8proc leaves alone as
// tokenizers leaves an unknown code point (no decomposition, combining class 0, no composition), and restored
// afterwards.
constexpr char32_t kStandIn = 0xD800;
static_assert(std::size(kNormalizationUnknown) <= 0x800, "the stand-ins must stay surrogates");

// One bit per code point below kUnknownEnd: whether it is in kNormalizationUnknown (utf8proc calls
// to_stand_in for every code point, so the common miss costs one bit test).
constexpr char32_t kUnknownEnd = 0x20000;
static_assert(std::end(kNormalizationUnknown)[-1] < kUnknownEnd, "kNormalizationUnknown: widen kUnknownEnd");

const std::bitset<kUnknownEnd>& unknown_bits() {
  static const std::bitset<kUnknownEnd> bits = [] {
    std::bitset<kUnknownEnd> b;
    for (const char32_t c : kNormalizationUnknown)
      b.set(c);
    return b;
  }();
  return bits;
}

utf8proc_int32_t to_stand_in(utf8proc_int32_t c, void* mapped) {
  const auto u = static_cast<char32_t>(c);
  if (u >= kUnknownEnd || !unknown_bits()[u]) return c;
  const auto* it = std::lower_bound(std::begin(kNormalizationUnknown), std::end(kNormalizationUnknown), u);
  *static_cast<bool*>(mapped) = true;
  return static_cast<utf8proc_int32_t>(kStandIn +
                                       static_cast<char32_t>(it - std::begin(kNormalizationUnknown)));
}

// Replaces the stand-ins (a surrogate's three UTF-8 bytes, ED A0..BF xx, which valid UTF-8 never holds) by
// the code points they stand for.
void restore_stand_ins(std::string& text) {
  std::string out;
  out.reserve(text.size());
  for (std::size_t i = 0; i < text.size(); ++i) {
    const auto b0 = static_cast<unsigned char>(text[i]);
    if (b0 != 0xED || i + 2 >= text.size() || static_cast<unsigned char>(text[i + 1]) < 0xA0) {
      out += text[i];
      continue;
    }
    const char32_t s = ((b0 & 0x0Fu) << 12) | ((static_cast<unsigned char>(text[i + 1]) & 0x3Fu) << 6) |
                       (static_cast<unsigned char>(text[i + 2]) & 0x3Fu);
    utf8proc_uint8_t buf[4];
    const auto n =
        utf8proc_encode_char(static_cast<utf8proc_int32_t>(kNormalizationUnknown[s - kStandIn]), buf);
    out.append(reinterpret_cast<const char*>(buf), static_cast<std::size_t>(n));
    i += 2;
  }
  text.swap(out);
}

class UnicodeNormalizer final : public Normalizer {
 public:
  explicit UnicodeNormalizer(UnicodeForm form) : form_(form) {}
  void normalize(std::string& text) const override {
    // ASCII is unchanged by all four forms, and text below U+0300 by NFC (no character there decomposes
    // canonically into two, nor is the second of a canonical pair): skip the library call for them.
    bool below = true, ascii = true;
    for (const char c : text) {
      const auto b = static_cast<unsigned char>(c);
      ascii = ascii && b < 0x80;
      below = below && b < 0xCC;  // lead bytes up to 0xCB encode code points below U+0300
    }
    if (ascii || (below && form_ == UnicodeForm::kNfc)) return;
    int options = UTF8PROC_STABLE;
    switch (form_) {
      case UnicodeForm::kNfc:
        options |= UTF8PROC_COMPOSE;
        break;
      case UnicodeForm::kNfkc:
        options |= UTF8PROC_COMPOSE | UTF8PROC_COMPAT;
        break;
      case UnicodeForm::kNfd:
        options |= UTF8PROC_DECOMPOSE;
        break;
      case UnicodeForm::kNfkd:
        options |= UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT;
        break;
    }
    utf8proc_uint8_t* out = nullptr;
    bool mapped = false;
    const utf8proc_ssize_t n = utf8proc_map_custom(
        reinterpret_cast<const utf8proc_uint8_t*>(text.data()), static_cast<utf8proc_ssize_t>(text.size()),
        &out, static_cast<utf8proc_option_t>(options), to_stand_in, &mapped);
    if (n < 0) throw std::runtime_error(std::string("Unicode normalization failed: ") + utf8proc_errmsg(n));
    text.assign(reinterpret_cast<const char*>(out), static_cast<std::size_t>(n));
    std::free(out);
    if (mapped) restore_stand_ins(text);
  }

 private:
  UnicodeForm form_;
};

class SequenceNormalizer final : public Normalizer {
 public:
  explicit SequenceNormalizer(std::vector<std::unique_ptr<Normalizer>> parts) : parts_(std::move(parts)) {}
  void normalize(std::string& text) const override {
    for (const auto& part : parts_)
      part->normalize(text);
  }

 private:
  std::vector<std::unique_ptr<Normalizer>> parts_;
};

// Prepend: only to a non-empty text (NormalizedString::prepend on an empty string does nothing).
class PrependNormalizer final : public Normalizer {
 public:
  explicit PrependNormalizer(std::string prepend) : prepend_(std::move(prepend)) {}
  void normalize(std::string& text) const override {
    if (!text.empty()) text.insert(0, prepend_);
  }

 private:
  std::string prepend_;
};

class LiteralReplaceNormalizer final : public Normalizer {
 public:
  LiteralReplaceNormalizer(std::string literal, std::string content)
      : literal_(std::move(literal)), content_(std::move(content)) {}
  void normalize(std::string& text) const override { replace_literal(text, literal_, content_); }

 private:
  std::string literal_, content_;
};

class RegexReplaceNormalizer final : public Normalizer {
 public:
  RegexReplaceNormalizer(Regex pattern, std::string content)
      : pattern_(std::move(pattern)), content_(std::move(content)) {}
  void normalize(std::string& text) const override { replace_regex(text, pattern_, content_); }

 private:
  Regex pattern_;
  std::string content_;
};

}  // namespace

std::unique_ptr<Normalizer> make_unicode_normalizer(UnicodeForm form) {
  return std::make_unique<UnicodeNormalizer>(form);
}
std::unique_ptr<Normalizer> make_sequence_normalizer(std::vector<std::unique_ptr<Normalizer>> parts) {
  return std::make_unique<SequenceNormalizer>(std::move(parts));
}
std::unique_ptr<Normalizer> make_prepend_normalizer(std::string prepend) {
  return std::make_unique<PrependNormalizer>(std::move(prepend));
}
std::unique_ptr<Normalizer> make_replace_normalizer(std::string literal, std::string content) {
  return std::make_unique<LiteralReplaceNormalizer>(std::move(literal), std::move(content));
}
std::unique_ptr<Normalizer> make_replace_normalizer(Regex pattern, std::string content) {
  return std::make_unique<RegexReplaceNormalizer>(std::move(pattern), std::move(content));
}

}  // namespace accel::llm::detail
