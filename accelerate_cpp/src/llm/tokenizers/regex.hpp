#pragma once
// A compiled PCRE2 pattern (UTF, Unicode properties, JIT) with the matching semantics of the Oniguruma
// regexes Hugging Face tokenizers uses for its patterns (SysRegex): \s, \S, \w, \W as Oniguruma's Unicode
// classes, ^ and $ at line boundaries, and find_iter's rule for empty matches.

#include <cstddef>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace accel::llm::detail {

class Regex {
 public:
  /// Compiles `pattern`; throws std::invalid_argument with PCRE2's message and offset when it cannot.
  explicit Regex(const std::string& pattern);
  /// A regex matching `literal` exactly (tokenizer.json's {"String": ...} patterns).
  static Regex literal(const std::string& literal);
  Regex(Regex&& other) noexcept;
  Regex& operator=(Regex&& other) noexcept;
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;
  ~Regex();

  /// The non-overlapping matches in `text`, left to right, as (start, end) byte offsets. Thread-safe.
  void find_all(std::string_view text, std::vector<std::pair<std::size_t, std::size_t>>& out) const;
  const std::string& pattern() const { return pattern_; }

 private:
  bool search(std::string_view text, std::size_t from, std::size_t& start, std::size_t& end) const;
  std::string pattern_;
  void* code_ = nullptr;  // pcre2_code_8*
  bool jit_ = false;
};

/// Rewrites Oniguruma's Unicode classes (\s \S \w \W) into explicit PCRE2 classes (exposed for tests).
std::string oniguruma_to_pcre2(const std::string& pattern);

}  // namespace accel::llm::detail
