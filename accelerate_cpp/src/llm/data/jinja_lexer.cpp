#include "llm/data/jinja_lexer.hpp"

#include <cctype>
#include <cstdlib>
#include <cstring>

#include "accel/errors.hpp"
#include "llm/data/jinja_value.hpp"

namespace accel::llm::detail::jinja {
namespace {

bool is_ws(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
}
bool starts(const std::string& s, std::size_t pos, const char* lit) {
  return s.compare(pos, std::strlen(lit), lit) == 0;
}
int count_newlines(const std::string& s, std::size_t from, std::size_t to) {
  int n = 0;
  for (std::size_t i = from; i < to && i < s.size(); ++i)
    n += s[i] == '\n';
  return n;
}

// jinja2 reads the template with universal newlines and drops one trailing newline
// (keep_trailing_newline=False).
std::string normalize(const std::string& source) {
  std::string out;
  out.reserve(source.size());
  for (std::size_t i = 0; i < source.size(); ++i) {
    if (source[i] == '\r') {
      out += '\n';
      if (i + 1 < source.size() && source[i + 1] == '\n') ++i;
    } else {
      out += source[i];
    }
  }
  if (!out.empty() && out.back() == '\n') out.pop_back();
  return out;
}

class Lexer {
 public:
  Lexer(std::string src, const std::string& origin) : s_(std::move(src)), origin_(origin) {}

  std::vector<Token> run() {
    bool line_starting = true;
    while (pos_ < s_.size()) {
      const std::size_t idx = next_tag(pos_);
      if (idx == std::string::npos) {
        emit_data(s_.substr(pos_), s_.size());
        break;
      }
      const char kind = s_[idx + 1];
      const char sign = (idx + 2 < s_.size() && (s_[idx + 2] == '-' || s_[idx + 2] == '+')) ? s_[idx + 2] : 0;
      std::string text = s_.substr(pos_, idx - pos_);
      if (sign == '-') {
        text = rstrip_ws(text);
      } else if (sign != '+' && kind != '{') {
        // lstrip_blocks: whitespace alone between the line start and a block or comment tag is removed.
        const std::size_t l_pos = text.rfind('\n') == std::string::npos ? 0 : text.rfind('\n') + 1;
        if ((l_pos > 0 || line_starting) && l_pos < text.size() && only_ws(text, l_pos)) text.resize(l_pos);
      }
      emit_data(text, idx);
      pos_ = idx + 2 + (sign != 0 ? 1 : 0);
      std::size_t end_start = 0;
      if (kind == '#') {
        end_start = skip_comment();
      } else if (kind == '%' && try_raw(line_starting)) {
        continue;
      } else {
        end_start = lex_tag(kind == '%');
      }
      line_starting = pos_ > end_start && s_[pos_ - 1] == '\n';
    }
    tokens_.push_back(Token{Tok::kEof, "", line_, 0, 0});
    return std::move(tokens_);
  }

 private:
  [[noreturn]] void fail(const std::string& what) const {
    throw ConfigError("chat template " + origin_ + " line " + std::to_string(line_) + ": " + what, origin_,
                      line_);
  }

  std::size_t next_tag(std::size_t from) const {
    for (std::size_t i = s_.find('{', from); i != std::string::npos; i = s_.find('{', i + 1)) {
      if (i + 1 < s_.size() && (s_[i + 1] == '{' || s_[i + 1] == '%' || s_[i + 1] == '#')) return i;
    }
    return std::string::npos;
  }

  static std::string rstrip_ws(const std::string& t) {
    // Python's str.rstrip(): every Unicode whitespace character.
    std::u32string u = utf8_decode(t);
    while (!u.empty() && py_isspace(u.back()))
      u.pop_back();
    return utf8_encode(u);
  }
  static bool only_ws(const std::string& t, std::size_t from) {
    for (char32_t c : utf8_decode(t.substr(from))) {
      if (!py_isspace(c)) return false;
    }
    return true;
  }

  // The data before a tag; `raw_end` is where the unstripped text ended (for line counting).
  void emit_data(const std::string& text, std::size_t raw_end) {
    if (!text.empty()) tokens_.push_back(Token{Tok::kData, text, line_, 0, 0});
    line_ += count_newlines(s_, pos_, raw_end);
  }

  std::size_t skip_comment() {
    for (std::size_t i = pos_; i < s_.size(); ++i) {
      if (starts(s_, i, "+#}")) return finish_end(i, 3, false);
      if (starts(s_, i, "-#}")) return finish_end(i, 3, true);
      if (starts(s_, i, "#}")) return finish_trim(i, 2);
    }
    fail("missing end of comment tag `#}`");
  }

  // An end tag at i of length len: `-` consumes all following whitespace, else trim_blocks eats one newline.
  std::size_t finish_end(std::size_t i, std::size_t len, bool strip_after) {
    line_ += count_newlines(s_, pos_, i);
    pos_ = i + len;
    if (strip_after) {
      while (pos_ < s_.size() && is_ws(s_[pos_]))
        line_ += s_[pos_++] == '\n';
    }
    return i;
  }
  std::size_t finish_trim(std::size_t i, std::size_t len) {
    line_ += count_newlines(s_, pos_, i);
    pos_ = i + len;
    if (pos_ < s_.size() && s_[pos_] == '\n') {
      ++pos_;
      ++line_;
    }
    return i;
  }

  // `{% raw %}...{% endraw %}`: the text inside comes back as data, untouched.
  bool try_raw(bool& line_starting) {
    std::size_t p = pos_;
    while (p < s_.size() && is_ws(s_[p]))
      ++p;
    if (!starts(s_, p, "raw")) return false;
    p += 3;
    while (p < s_.size() && is_ws(s_[p]))
      ++p;
    const bool strip = starts(s_, p, "-%}");
    if (!strip && !starts(s_, p, "%}")) return false;
    p += strip ? 3 : 2;
    if (strip) {
      while (p < s_.size() && is_ws(s_[p]))
        ++p;
    }
    for (std::size_t i = s_.find("{%", p); i != std::string::npos; i = s_.find("{%", i + 1)) {
      std::size_t q = i + 2;
      const char sign = (q < s_.size() && (s_[q] == '-' || s_[q] == '+')) ? s_[q] : 0;
      if (sign) ++q;
      while (q < s_.size() && is_ws(s_[q]))
        ++q;
      if (!starts(s_, q, "endraw")) continue;
      q += 6;
      while (q < s_.size() && is_ws(s_[q]))
        ++q;
      std::string text = s_.substr(p, i - p);
      if (sign == '-') text = rstrip_ws(text);
      line_ += count_newlines(s_, pos_, p);
      pos_ = p;
      emit_data(text, i);
      pos_ = q;
      std::size_t end_start = 0;
      if (starts(s_, q, "+%}")) {
        end_start = finish_end(q, 3, false);
      } else if (starts(s_, q, "-%}")) {
        end_start = finish_end(q, 3, true);
      } else if (starts(s_, q, "%}")) {
        end_start = finish_trim(q, 2);
      } else {
        fail("malformed `{% endraw %}`");
      }
      line_starting = pos_ > end_start && s_[pos_ - 1] == '\n';
      return true;
    }
    fail("missing `{% endraw %}`");
  }

  // Tokens of one `{{ ... }}` or `{% ... %}`; returns where its end marker started.
  std::size_t lex_tag(bool block) {
    tokens_.push_back(Token{block ? Tok::kBlockBegin : Tok::kVarBegin, "", line_, 0, 0});
    std::vector<char> balance;
    while (true) {
      if (pos_ >= s_.size())
        fail(block ? "missing end of block tag `%}`" : "missing end of variable tag `}}`");
      if (balance.empty()) {
        const std::size_t at = pos_;
        bool ended = true;
        if (block && starts(s_, pos_, "+%}")) {
          finish_end(pos_, 3, false);
        } else if (block && starts(s_, pos_, "-%}")) {
          finish_end(pos_, 3, true);
        } else if (block && starts(s_, pos_, "%}")) {
          finish_trim(pos_, 2);
        } else if (!block && starts(s_, pos_, "-}}")) {
          finish_end(pos_, 3, true);
        } else if (!block && starts(s_, pos_, "}}")) {
          pos_ += 2;
        } else {
          ended = false;
        }
        if (ended) {
          tokens_.push_back(Token{block ? Tok::kBlockEnd : Tok::kVarEnd, "", line_, 0, 0});
          return at;
        }
      }
      lex_one(balance);
    }
  }

  void lex_one(std::vector<char>& balance) {
    const char c = s_[pos_];
    if (is_ws(c)) {
      line_ += c == '\n';
      ++pos_;
      return;
    }
    if (std::isdigit(static_cast<unsigned char>(c))) return lex_number();
    if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
      std::size_t end = pos_;
      while (end < s_.size() && (std::isalnum(static_cast<unsigned char>(s_[end])) || s_[end] == '_'))
        ++end;
      tokens_.push_back(Token{Tok::kName, s_.substr(pos_, end - pos_), line_, 0, 0});
      pos_ = end;
      return;
    }
    if (c == '\'' || c == '"') return lex_string(c);
    static const char* const kOps[] = {"//", "**", "==", "!=", ">=", "<=", "+", "-", "/", "*", "%", "~", "[",
                                       "]",  "(",  ")",  "{",  "}",  ">",  "<", "=", ".", ":", "|", ",", ";"};
    for (const char* op : kOps) {
      if (!starts(s_, pos_, op)) continue;
      const std::string text(op);
      if (text == "(" || text == "[" || text == "{")
        balance.push_back(text == "(" ? ')' : text == "[" ? ']' : '}');
      if (text == ")" || text == "]" || text == "}") {
        if (balance.empty() || balance.back() != text[0]) fail("unexpected '" + text + "'");
        balance.pop_back();
      }
      tokens_.push_back(Token{Tok::kOp, text, line_, 0, 0});
      pos_ += text.size();
      return;
    }
    fail(std::string("unexpected character '") + c + "'");
  }

  void lex_number() {
    std::size_t end = pos_;
    auto digits = [&](std::size_t& p) {
      const std::size_t start = p;
      while (p < s_.size() && (std::isdigit(static_cast<unsigned char>(s_[p])) || s_[p] == '_'))
        ++p;
      return p > start;
    };
    digits(end);
    bool is_float = false;
    if (end + 1 < s_.size() && s_[end] == '.' && std::isdigit(static_cast<unsigned char>(s_[end + 1]))) {
      ++end;
      digits(end);
      is_float = true;
    }
    if (end < s_.size() && (s_[end] == 'e' || s_[end] == 'E')) {
      std::size_t p = end + 1;
      if (p < s_.size() && (s_[p] == '+' || s_[p] == '-')) ++p;
      if (digits(p)) {
        end = p;
        is_float = true;
      }
    }
    std::string text;
    for (std::size_t i = pos_; i < end; ++i) {
      if (s_[i] != '_') text += s_[i];
    }
    Token t{is_float ? Tok::kFloat : Tok::kInt, text, line_, 0, 0};
    if (is_float) {
      t.fval = std::strtod(text.c_str(), nullptr);
    } else {
      t.ival = std::strtoll(text.c_str(), nullptr, 10);
    }
    tokens_.push_back(t);
    pos_ = end;
  }

  // A string literal, decoded as Python's unicode-escape codec decodes it (what jinja2 does).
  void lex_string(char quote) {
    std::u32string out;
    std::size_t p = pos_ + 1;
    const int start_line = line_;
    while (true) {
      if (p >= s_.size()) fail("unterminated string literal");
      const char c = s_[p];
      if (c == quote) break;
      if (c != '\\') {
        const std::size_t len = utf8_len(p);
        out += utf8_decode(s_.substr(p, len));
        line_ += c == '\n';
        p += len;
        continue;
      }
      p = decode_escape(p, out);
    }
    tokens_.push_back(Token{Tok::kString, utf8_encode(out), start_line, 0, 0});
    pos_ = p + 1;
  }

  std::size_t utf8_len(std::size_t p) const {
    const auto c = static_cast<unsigned char>(s_[p]);
    return c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xe ? 3 : (c >> 3) == 0x1e ? 4 : 1;
  }

  std::size_t decode_escape(std::size_t p, std::u32string& out) {
    if (p + 1 >= s_.size()) fail("unterminated string literal");
    const char e = s_[p + 1];
    auto hex = [&](std::size_t from, int n) {
      if (from + static_cast<std::size_t>(n) > s_.size())
        fail("truncated \\x, \\u or \\U escape in a string");
      const std::string h = s_.substr(from, static_cast<std::size_t>(n));
      for (char ch : h) {
        if (!std::isxdigit(static_cast<unsigned char>(ch)))
          fail("truncated \\x, \\u or \\U escape in a string");
      }
      return static_cast<char32_t>(std::strtoul(h.c_str(), nullptr, 16));
    };
    switch (e) {
      case '\n':
        ++line_;
        return p + 2;
      case '\\':
      case '\'':
      case '"':
        out += static_cast<char32_t>(e);
        return p + 2;
      case 'a':
        out += U'\a';
        return p + 2;
      case 'b':
        out += U'\b';
        return p + 2;
      case 'f':
        out += U'\f';
        return p + 2;
      case 'n':
        out += U'\n';
        return p + 2;
      case 'r':
        out += U'\r';
        return p + 2;
      case 't':
        out += U'\t';
        return p + 2;
      case 'v':
        out += U'\v';
        return p + 2;
      case 'x':
        out += hex(p + 2, 2);
        return p + 4;
      case 'u':
        out += hex(p + 2, 4);
        return p + 6;
      case 'U':
        out += hex(p + 2, 8);
        return p + 10;
      case 'N':
        fail("the \\N{...} escape in a string literal is not supported");
      default:
        break;
    }
    if (e >= '0' && e <= '7') {
      char32_t v = 0;
      std::size_t q = p + 1;
      for (int k = 0; k < 3 && q < s_.size() && s_[q] >= '0' && s_[q] <= '7'; ++k, ++q)
        v = v * 8 + (s_[q] - '0');
      out += v;
      return q;
    }
    out += U'\\';  // an unknown escape keeps its backslash, as in Python
    return p + 1;
  }

  std::string s_;
  const std::string& origin_;
  std::size_t pos_ = 0;
  int line_ = 1;
  std::vector<Token> tokens_;
};

}  // namespace

std::vector<Token> lex(const std::string& source, const std::string& origin) {
  return Lexer(normalize(source), origin).run();
}

}  // namespace accel::llm::detail::jinja
