#include "llm/tokenizers/regex.hpp"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <stdexcept>

namespace accel::llm::detail {
namespace {

// Unicode White_Space, Oniguruma's \s (PCRE2's \s with UCP leaves out U+0085).
constexpr const char* kSpaceItems =
    "\\t\\n\\x0B\\f\\r\\x20\\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}\\x{202F}\\x{205F}"
    "\\x{3000}";
#include "llm/tokenizers/unicode_classes.inc"

// The code points of Unicode general category `name` that Oniguruma has and PCRE2 lacks (tokenizers'
// Oniguruma knows Unicode 16, Debian's PCRE2 10.42 Unicode 14: CJK extensions H and I, Egyptian hieroglyphs
// extended A, the digits of Kawi, Garay, ...), as class items; empty when none or `name` is no category.
std::string oniguruma_extra(const std::string& name) {
  for (const auto& c : kOnigurumaExtra)
    if (name == c.name) return c.extra;
  return {};
}

// The code points PCRE2 has in category `name` and Oniguruma does not (categories changed since Unicode 14).
std::string oniguruma_missing(const std::string& name) {
  for (const auto& c : kOnigurumaExtra)
    if (name == c.name) return c.missing;
  return {};
}

// Oniguruma's \w: letters, marks, numbers, connector punctuation and the alphabetic symbols (circled
// letters, ...): entry "w" holds what it has beyond PCRE2's letters, marks, decimal numbers and connectors.
std::string word_items() {
  return "\\p{L}\\p{M}\\p{Nd}\\p{Pc}" + oniguruma_extra("w");
}

// `\p{NAME}`, `\p{^NAME}` or `\P{NAME}` at pattern[i] (a backslash): its length, the name and whether it is
// negated; 0 when it is none of those.
std::size_t property_at(const std::string& pattern, std::size_t i, std::string& name, bool& negated) {
  if (i + 2 >= pattern.size() || (pattern[i + 1] != 'p' && pattern[i + 1] != 'P') || pattern[i + 2] != '{')
    return 0;
  const auto close = pattern.find('}', i + 3);
  if (close == std::string::npos) return 0;
  name = pattern.substr(i + 3, close - i - 3);
  negated = pattern[i + 1] == 'P';
  if (!name.empty() && name[0] == '^') {
    negated = !negated;
    name.erase(0, 1);
  }
  return close - i + 1;
}

// Appends a class (Oniguruma's \s, \w, \d or a general category widened to Unicode 16) as PCRE2 has to see
// it: a bracketed class outside [...], its items inside one; a negated class inside [...] stays PCRE2's own
// `original` (its complement cannot be written as items).
void append_class(std::string& out, const std::string& items, bool negated, int class_depth,
                  const std::string& original) {
  if (class_depth == 0) {
    out += negated ? "[^" : "[";
    out += items;
    out += "]";
  } else if (!negated) {
    out += items;
  } else {
    out += original;
  }
}

pcre2_code* as_code(void* p) {
  return static_cast<pcre2_code*>(p);
}

// One match-data block per thread: a compiled Regex is shared by every thread that encodes.
pcre2_match_data* thread_match_data() {
  struct Holder {
    pcre2_match_data* data = pcre2_match_data_create(4, nullptr);
    ~Holder() { pcre2_match_data_free(data); }
  };
  thread_local Holder holder;
  return holder.data;
}

}  // namespace

std::string oniguruma_to_pcre2(const std::string& pattern) {
  std::string out;
  out.reserve(pattern.size() + 64);
  int class_depth = 0;
  for (std::size_t i = 0; i < pattern.size(); ++i) {
    const char c = pattern[i];
    if (c == '\\' && i + 1 < pattern.size()) {
      const char e = pattern[i + 1];
      std::string name;
      bool negated_property = false;
      // A category name starts upper-case (the table's lower-case entries are \w, \d and \s).
      std::size_t length = property_at(pattern, i, name, negated_property);
      if (length > 0 && (name.empty() || name[0] < 'A' || name[0] > 'Z')) length = 0;
      const std::string extra = length > 0 ? oniguruma_extra(name) : std::string();
      const std::string missing = length > 0 ? oniguruma_missing(name) : std::string();
      if (!missing.empty() && class_depth == 0) {  // PCRE2's class without `missing`, plus `extra`
        const std::string items = "\\p{" + name + "}" + extra;
        out += negated_property ? "(?:[" + missing + "]|[^" + items + "])"
                                : "(?:(?![" + missing + "])[" + items + "])";
        i += length - 1;
        continue;
      }
      if (!extra.empty()) {  // inside [...], `missing` cannot be taken out: it stays in (\p{Mn}: U+1171E)
        append_class(out, "\\p{" + name + "}" + extra, negated_property, class_depth,
                     pattern.substr(i, length));
        i += length - 1;
        continue;
      }
      const bool space = e == 's' || e == 'S', word = e == 'w' || e == 'W', digit = e == 'd' || e == 'D';
      if (space || word || digit) {
        // A negated class inside [...] stays PCRE2's own: \S differs on U+0085 only, \W on numbers other
        // than decimal ones, alphabetic symbols and Unicode 15 and 16's additions, \D on the latter.
        const std::string items = space  ? kSpaceItems
                                  : word ? word_items()
                                         : "\\p{Nd}" + oniguruma_extra("d");
        append_class(out, items, e == 'S' || e == 'W' || e == 'D', class_depth, std::string{'\\', e});
      } else {
        out += c;
        out += e;
      }
      ++i;
      continue;
    }
    if (c == '[') {
      ++class_depth;
      out += c;
      // A ']' right after '[' or '[^' is a literal.
      if (i + 1 < pattern.size() && pattern[i + 1] == '^') out += pattern[++i];
      if (i + 1 < pattern.size() && pattern[i + 1] == ']') out += pattern[++i];
      continue;
    }
    if (c == ']' && class_depth > 0) --class_depth;
    out += c;
  }
  return out;
}

Regex::Regex(const std::string& pattern) : pattern_(pattern) {
  const std::string translated = oniguruma_to_pcre2(pattern);
  int error = 0;
  PCRE2_SIZE offset = 0;
  pcre2_code* code =
      pcre2_compile(reinterpret_cast<PCRE2_SPTR>(translated.data()), translated.size(),
                    PCRE2_UTF | PCRE2_UCP | PCRE2_MULTILINE | PCRE2_NO_UTF_CHECK, &error, &offset, nullptr);
  if (code == nullptr) {
    PCRE2_UCHAR message[256];
    pcre2_get_error_message(error, message, sizeof message);
    throw std::invalid_argument(std::string(reinterpret_cast<const char*>(message)) + " at offset " +
                                std::to_string(offset));
  }
  code_ = code;
  jit_ = pcre2_jit_compile(code, PCRE2_JIT_COMPLETE) == 0;
}

Regex Regex::literal(const std::string& literal) {
  std::string quoted;
  for (const char c : literal) {
    if (std::string_view("\\^$.|?*+()[]{}").find(c) != std::string_view::npos) quoted += '\\';
    quoted += c;
  }
  return Regex(quoted);
}

Regex::Regex(Regex&& other) noexcept
    : pattern_(std::move(other.pattern_)), code_(std::exchange(other.code_, nullptr)), jit_(other.jit_) {}

Regex& Regex::operator=(Regex&& other) noexcept {
  if (this != &other) {
    pcre2_code_free(as_code(code_));
    pattern_ = std::move(other.pattern_);
    code_ = std::exchange(other.code_, nullptr);
    jit_ = other.jit_;
  }
  return *this;
}

Regex::~Regex() {
  pcre2_code_free(as_code(code_));
}

bool Regex::search(std::string_view text, std::size_t from, std::size_t& start, std::size_t& end) const {
  pcre2_match_data* data = thread_match_data();
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  const int rc =
      jit_ ? pcre2_jit_match(as_code(code_), subject, text.size(), from, 0, data, nullptr)
           : pcre2_match(as_code(code_), subject, text.size(), from, PCRE2_NO_UTF_CHECK, data, nullptr);
  if (rc == PCRE2_ERROR_NOMATCH) return false;
  if (rc < 0) {
    PCRE2_UCHAR message[256];
    pcre2_get_error_message(rc, message, sizeof message);
    throw std::runtime_error("regex '" + pattern_ + "' failed: " + reinterpret_cast<const char*>(message));
  }
  const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(data);
  start = ovector[0];
  end = ovector[1];
  return true;
}

// The onig crate's find_iter: an empty match right where the previous match ended is skipped by moving one
// character on.
void Regex::find_all(std::string_view text, std::vector<std::pair<std::size_t, std::size_t>>& out) const {
  out.clear();
  std::size_t from = 0;
  bool have_last = false;
  std::size_t last_end = 0;
  while (from <= text.size()) {
    std::size_t start = 0, end = 0;
    if (!search(text, from, start, end)) return;
    if (start == end && have_last && last_end == end) {
      if (from >= text.size()) return;
      std::size_t n = 1;
      while (from + n < text.size() && (static_cast<unsigned char>(text[from + n]) & 0xC0) == 0x80)
        ++n;
      from += n;
      continue;
    }
    from = end;
    have_last = true;
    last_end = end;
    out.emplace_back(start, end);
    if (start == end && end >= text.size()) return;
  }
}

}  // namespace accel::llm::detail
