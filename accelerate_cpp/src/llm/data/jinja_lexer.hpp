#pragma once
// The chat-template lexer (private): jinja2's lexer with trim_blocks=True and lstrip_blocks=True.

#include <cstdint>
#include <string>
#include <vector>

namespace accel::llm::detail::jinja {

enum class Tok { kData, kVarBegin, kVarEnd, kBlockBegin, kBlockEnd, kName, kString, kInt, kFloat, kOp, kEof };

struct Token {
  Tok type = Tok::kEof;
  std::string text;  // data, name, operator, or the decoded string literal
  int line = 1;
  int64_t ival = 0;
  double fval = 0;
};

/// Splits `source` into tokens; `{% raw %}` sections come back as data. Throws accel::ConfigError naming
/// `origin` and the line on an unterminated tag, comment or string.
std::vector<Token> lex(const std::string& source, const std::string& origin);

}  // namespace accel::llm::detail::jinja
