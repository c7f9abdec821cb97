#include "config/message_text.hpp"

#include <fmt/format.h>

namespace accel::detail {
namespace {

constexpr std::size_t kRun = 200, kRunHead = 160, kRunTail = 20;
constexpr std::size_t kTotal = 4000, kTotalHead = 3000, kTotalTail = 900;

bool is_space(char c) {
  return c == ' ' || c == '\n' || c == '\t';
}

}  // namespace

std::string bounded_message(std::string_view message) {
  std::string escaped;
  escaped.reserve(message.size());
  for (const char c : message) {
    const auto u = static_cast<unsigned char>(c);
    if ((u < 0x20 && c != '\n' && c != '\t') || u == 0x7f) {
      escaped += fmt::format("\\x{:02x}", u);
    } else {
      escaped += c;
    }
  }
  std::string out;
  out.reserve(std::min(escaped.size(), kTotal + 200));
  std::size_t i = 0;
  while (i < escaped.size()) {
    std::size_t j = i;
    while (j < escaped.size() && !is_space(escaped[j]))
      ++j;
    const std::size_t run = j - i;
    if (run > kRun) {
      out.append(escaped, i, kRunHead);
      out += fmt::format("...({} characters)...", run);
      out.append(escaped, j - kRunTail, kRunTail);
    } else {
      out.append(escaped, i, run);
    }
    for (i = j; i < escaped.size() && is_space(escaped[i]); ++i)
      out += escaped[i];
  }
  if (out.size() > kTotal) {
    out = out.substr(0, kTotalHead) +
          fmt::format(" ...({} characters)... ", out.size() - kTotalHead - kTotalTail) +
          out.substr(out.size() - kTotalTail);
  }
  return out;
}

}  // namespace accel::detail
