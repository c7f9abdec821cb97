#pragma once
// UTF-8 helpers and GPT-2's byte-level alphabet, as Hugging Face tokenizers defines them
// (tokenizers/src/pre_tokenizers/byte_level.rs, bytes_char()).

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace accel::llm::detail {

/// Length in bytes of the UTF-8 sequence that starts with `lead` (1 for a stray continuation byte).
inline std::size_t utf8_length(unsigned char lead) {
  if (lead < 0x80) return 1;
  if (lead >= 0xF0) return 4;
  if (lead >= 0xE0) return 3;
  if (lead >= 0xC0) return 2;
  return 1;
}

/// Decodes the code point at `text[pos]` (valid UTF-8 assumed) and advances `pos` past it.
char32_t next_code_point(std::string_view text, std::size_t& pos);
/// Appends the UTF-8 encoding of `cp`.
void append_utf8(std::string& out, char32_t cp);
/// Offset of the first byte that is not valid UTF-8, or npos when `text` is valid.
std::size_t first_invalid_utf8(std::string_view text);
/// Rust's String::from_utf8_lossy: each maximal ill-formed subpart becomes one U+FFFD.
std::string utf8_lossy(std::string_view bytes);

/// Unicode White_Space (Rust's char::is_whitespace, the regex crate's \s).
bool is_white_space(char32_t cp);
/// The regex crate's \w (letters, marks, decimal and letter numbers, connector punctuation).
bool is_word_char(char32_t cp);

/// GPT-2's reversible byte -> printable character mapping.
class ByteLevelAlphabet {
 public:
  static const ByteLevelAlphabet& get();
  /// The UTF-8 text of the character standing for byte `b`.
  std::string_view encode(unsigned char b) const { return {chars_[b].data(), lengths_[b]}; }
  /// The byte a character stands for, or -1 when `cp` is not in the alphabet.
  int decode(char32_t cp) const { return cp < 512 ? bytes_[cp] : -1; }

 private:
  ByteLevelAlphabet();
  std::array<std::array<char, 4>, 256> chars_{};
  std::array<unsigned char, 256> lengths_{};
  std::array<int, 512> bytes_{};
};

}  // namespace accel::llm::detail
