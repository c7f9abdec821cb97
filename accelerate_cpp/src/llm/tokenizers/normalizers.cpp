// Normalizers (tokenizers/src/normalizers): Unicode forms through utf8proc, Sequence, Prepend, Replace.
#include "llm/tokenizers/normalizers.hpp"

#include <utf8proc.h>

#include <cstdlib>
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
    const utf8proc_ssize_t n = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(text.data()),
                                            static_cast<utf8proc_ssize_t>(text.size()), &out,
                                            static_cast<utf8proc_option_t>(options));
    if (n < 0) throw std::runtime_error(std::string("Unicode normalization failed: ") + utf8proc_errmsg(n));
    text.assign(reinterpret_cast<const char*>(out), static_cast<std::size_t>(n));
    std::free(out);
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
