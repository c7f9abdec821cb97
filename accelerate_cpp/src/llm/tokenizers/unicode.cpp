#include "llm/tokenizers/unicode.hpp"

#include <utf8proc.h>

namespace accel::llm::detail {

char32_t next_code_point(std::string_view text, std::size_t& pos) {
  const auto* s = reinterpret_cast<const unsigned char*>(text.data());
  const unsigned char c = s[pos];
  if (c < 0x80) {
    ++pos;
    return c;
  }
  const std::size_t n = utf8_length(c);
  char32_t cp = n == 2 ? (c & 0x1F) : n == 3 ? (c & 0x0F) : (c & 0x07);
  for (std::size_t i = 1; i < n && pos + i < text.size(); ++i)
    cp = (cp << 6) | (s[pos + i] & 0x3F);
  pos += n;
  return cp;
}

void append_utf8(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

namespace {

// Length of the longest prefix of `s` (at most `n` bytes) that is a valid start of a UTF-8 sequence, as
// Unicode's Table 3-7 defines well-formed sequences; `complete` tells whether the whole sequence is there.
std::size_t valid_prefix(const unsigned char* s, std::size_t n, bool& complete) {
  complete = false;
  const unsigned char c = s[0];
  if (c < 0x80) {
    complete = true;
    return 1;
  }
  std::size_t need = 0;
  unsigned char lo = 0x80, hi = 0xBF;
  if (c >= 0xC2 && c <= 0xDF) {
    need = 2;
  } else if (c >= 0xE0 && c <= 0xEF) {
    need = 3;
    if (c == 0xE0) lo = 0xA0;
    if (c == 0xED) hi = 0x9F;
  } else if (c >= 0xF0 && c <= 0xF4) {
    need = 4;
    if (c == 0xF0) lo = 0x90;
    if (c == 0xF4) hi = 0x8F;
  } else {
    return 0;
  }
  std::size_t i = 1;
  for (; i < need && i < n; ++i) {
    const unsigned char lo_i = i == 1 ? lo : 0x80, hi_i = i == 1 ? hi : 0xBF;
    if (s[i] < lo_i || s[i] > hi_i) return i;
  }
  complete = i == need;
  return i;
}

}  // namespace

std::size_t first_invalid_utf8(std::string_view text) {
  const auto* s = reinterpret_cast<const unsigned char*>(text.data());
  std::size_t pos = 0;
  while (pos < text.size()) {
    if (s[pos] < 0x80) {
      ++pos;
      continue;
    }
    bool complete = false;
    const std::size_t n = valid_prefix(s + pos, text.size() - pos, complete);
    if (!complete) return pos;
    pos += n;
  }
  return std::string_view::npos;
}

std::string utf8_lossy(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size());
  const auto* s = reinterpret_cast<const unsigned char*>(bytes.data());
  std::size_t pos = 0;
  while (pos < bytes.size()) {
    bool complete = false;
    const std::size_t n = valid_prefix(s + pos, bytes.size() - pos, complete);
    if (complete) {
      out.append(bytes.data() + pos, n);
      pos += n;
    } else {
      out.append("\xEF\xBF\xBD");
      pos += n == 0 ? 1 : n;
    }
  }
  return out;
}

bool is_white_space(char32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || cp == 0x20 || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F ||
         cp == 0x3000;
}

bool is_word_char(char32_t cp) {
  if (cp < 0x80)
    return (cp >= '0' && cp <= '9') || (cp >= 'a' && cp <= 'z') || (cp >= 'A' && cp <= 'Z') || cp == '_';
  switch (utf8proc_category(static_cast<utf8proc_int32_t>(cp))) {
    case UTF8PROC_CATEGORY_LU:
    case UTF8PROC_CATEGORY_LL:
    case UTF8PROC_CATEGORY_LT:
    case UTF8PROC_CATEGORY_LM:
    case UTF8PROC_CATEGORY_LO:
    case UTF8PROC_CATEGORY_MN:
    case UTF8PROC_CATEGORY_MC:
    case UTF8PROC_CATEGORY_ME:
    case UTF8PROC_CATEGORY_ND:
    case UTF8PROC_CATEGORY_NL:
    case UTF8PROC_CATEGORY_PC:
      return true;
    default:
      return cp == 0x200C || cp == 0x200D;  // Join_Control
  }
}

const ByteLevelAlphabet& ByteLevelAlphabet::get() {
  static const ByteLevelAlphabet alphabet;
  return alphabet;
}

// Printable Latin-1 bytes stand for themselves; the others map to 256, 257, ... in byte order.
ByteLevelAlphabet::ByteLevelAlphabet() {
  bytes_.fill(-1);
  int next = 256;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    const char32_t cp = printable ? static_cast<char32_t>(b) : static_cast<char32_t>(next++);
    std::string utf8;
    append_utf8(utf8, cp);
    for (std::size_t i = 0; i < utf8.size(); ++i)
      chars_[b][i] = utf8[i];
    lengths_[b] = static_cast<unsigned char>(utf8.size());
    bytes_[cp] = b;
  }
}

}  // namespace accel::llm::detail
