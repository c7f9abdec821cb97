#pragma once
// Normalizers (tokenizers/src/normalizers): rewrite the text of each piece before pre-tokenization.

#include "llm/tokenizers/regex.hpp"

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace accel::llm::detail {

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

/// Replaces every non-overlapping occurrence of `literal` (non-empty) in `text` by `content`.
void replace_literal(std::string& text, const std::string& literal, const std::string& content);
/// Replaces every match of `pattern` in `text` by `content`.
void replace_regex(std::string& text, const Regex& pattern, const std::string& content);

}  // namespace accel::llm::detail
