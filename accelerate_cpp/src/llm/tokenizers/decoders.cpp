// Decoders (tokenizers/src/decoders): each rewrites the list of token strings; the tokenizer joins the
// result.
#include "llm/tokenizers/decoders.hpp"

#include "llm/tokenizers/normalizers.hpp"
#include "llm/tokenizers/unicode.hpp"

namespace accel::llm::detail {
namespace {

class SequenceDecoder final : public Decoder {
 public:
  explicit SequenceDecoder(std::vector<std::unique_ptr<Decoder>> parts) : parts_(std::move(parts)) {}
  void decode_chain(std::vector<std::string>& tokens) const override {
    for (const auto& part : parts_)
      part->decode_chain(tokens);
  }

 private:
  std::vector<std::unique_ptr<Decoder>> parts_;
};

// ByteLevel: each token's characters back to bytes (a token with a character outside the alphabet, such as an
// added token, keeps its own UTF-8 bytes), then one string, invalid UTF-8 replaced as from_utf8_lossy does.
class ByteLevelDecoder final : public Decoder {
 public:
  void decode_chain(std::vector<std::string>& tokens) const override {
    const ByteLevelAlphabet& alphabet = ByteLevelAlphabet::get();
    std::string bytes;
    std::string token_bytes;
    for (const auto& token : tokens) {
      token_bytes.clear();
      bool all_mapped = true;
      for (std::size_t pos = 0; pos < token.size();) {
        const int b = alphabet.decode(next_code_point(token, pos));
        if (b < 0) {
          all_mapped = false;
          break;
        }
        token_bytes.push_back(static_cast<char>(b));
      }
      bytes += all_mapped ? token_bytes : token;
    }
    tokens.assign(1, utf8_lossy(bytes));
  }
};

class MetaspaceDecoder final : public Decoder {
 public:
  MetaspaceDecoder(std::string replacement, PrependScheme scheme)
      : replacement_(std::move(replacement)), scheme_(scheme) {}
  // Every replacement character becomes a space, except in the first token (prepend_scheme other than never),
  // where they are dropped.
  void decode_chain(std::vector<std::string>& tokens) const override {
    for (std::size_t i = 0; i < tokens.size(); ++i) {
      const bool drop = i == 0 && scheme_ != PrependScheme::kNever;
      replace_literal(tokens[i], replacement_, drop ? std::string() : std::string(" "));
    }
  }

 private:
  std::string replacement_;
  PrependScheme scheme_;
};

class LiteralReplaceDecoder final : public Decoder {
 public:
  LiteralReplaceDecoder(std::string literal, std::string content)
      : literal_(std::move(literal)), content_(std::move(content)) {}
  void decode_chain(std::vector<std::string>& tokens) const override {
    for (auto& token : tokens)
      replace_literal(token, literal_, content_);
  }

 private:
  std::string literal_, content_;
};

class RegexReplaceDecoder final : public Decoder {
 public:
  RegexReplaceDecoder(Regex pattern, std::string content)
      : pattern_(std::move(pattern)), content_(std::move(content)) {}
  void decode_chain(std::vector<std::string>& tokens) const override {
    for (auto& token : tokens)
      replace_regex(token, pattern_, content_);
  }

 private:
  Regex pattern_;
  std::string content_;
};

int hex_digit(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

// The byte of a "<0xAB>" token, or -1 (u8::from_str_radix(.., 16) on the two characters, which takes "+F").
int byte_of_token(const std::string& token) {
  if (token.size() != 6 || token.compare(0, 3, "<0x") != 0 || token[5] != '>') return -1;
  if (token[3] == '+') return hex_digit(token[4]);
  const int hi = hex_digit(token[3]), lo = hex_digit(token[4]);
  return hi < 0 || lo < 0 ? -1 : hi * 16 + lo;
}

// ByteFallback: runs of <0xAB> tokens become their UTF-8 text, or one U+FFFD per byte when not valid UTF-8.
class ByteFallbackDecoder final : public Decoder {
 public:
  void decode_chain(std::vector<std::string>& tokens) const override {
    std::vector<std::string> out;
    out.reserve(tokens.size());
    std::string run;
    auto flush = [&] {
      if (run.empty()) return;
      if (first_invalid_utf8(run) == std::string::npos) {
        out.push_back(run);
      } else {
        for (std::size_t i = 0; i < run.size(); ++i)
          out.emplace_back("\xEF\xBF\xBD");
      }
      run.clear();
    };
    for (auto& token : tokens) {
      const int b = byte_of_token(token);
      if (b >= 0) {
        run.push_back(static_cast<char>(b));
        continue;
      }
      flush();
      out.push_back(std::move(token));
    }
    flush();
    tokens.swap(out);
  }
};

class FuseDecoder final : public Decoder {
 public:
  void decode_chain(std::vector<std::string>& tokens) const override {
    std::string joined;
    for (const auto& token : tokens)
      joined += token;
    tokens.assign(1, std::move(joined));
  }
};

// Strip: up to `start` leading and `stop` trailing `content` characters from each token.
class StripDecoder final : public Decoder {
 public:
  StripDecoder(std::string content, std::size_t start, std::size_t stop)
      : content_(std::move(content)), start_(start), stop_(stop) {}
  void decode_chain(std::vector<std::string>& tokens) const override {
    for (auto& token : tokens) {
      std::vector<std::pair<std::size_t, std::size_t>> chars;  // byte offset, length
      for (std::size_t pos = 0; pos < token.size();) {
        const std::size_t begin = pos;
        next_code_point(token, pos);
        chars.emplace_back(begin, pos - begin);
      }
      auto is_content = [&](std::size_t i) {
        return token.compare(chars[i].first, chars[i].second, content_) == 0;
      };
      std::size_t start_cut = 0, stop_cut = chars.size();
      for (std::size_t i = 0; i < start_ && i < chars.size() && is_content(i); ++i)
        start_cut = i + 1;
      for (std::size_t i = 0; i < stop_ && i < chars.size() && is_content(chars.size() - i - 1); ++i)
        stop_cut = chars.size() - i - 1;
      if (stop_cut <= start_cut) {
        token.clear();
        continue;
      }
      const std::size_t from = chars[start_cut].first;
      const std::size_t to = stop_cut == chars.size() ? token.size() : chars[stop_cut].first;
      token = token.substr(from, to - from);
    }
  }

 private:
  std::string content_;
  std::size_t start_, stop_;
};

}  // namespace

std::unique_ptr<Decoder> make_sequence_decoder(std::vector<std::unique_ptr<Decoder>> parts) {
  return std::make_unique<SequenceDecoder>(std::move(parts));
}
std::unique_ptr<Decoder> make_byte_level_decoder() {
  return std::make_unique<ByteLevelDecoder>();
}
std::unique_ptr<Decoder> make_metaspace_decoder(std::string replacement, PrependScheme scheme) {
  return std::make_unique<MetaspaceDecoder>(std::move(replacement), scheme);
}
std::unique_ptr<Decoder> make_replace_decoder(std::string literal, std::string content) {
  return std::make_unique<LiteralReplaceDecoder>(std::move(literal), std::move(content));
}
std::unique_ptr<Decoder> make_replace_decoder(Regex pattern, std::string content) {
  return std::make_unique<RegexReplaceDecoder>(std::move(pattern), std::move(content));
}
std::unique_ptr<Decoder> make_byte_fallback_decoder() {
  return std::make_unique<ByteFallbackDecoder>();
}
std::unique_ptr<Decoder> make_fuse_decoder() {
  return std::make_unique<FuseDecoder>();
}
std::unique_ptr<Decoder> make_strip_decoder(std::string content, std::size_t start, std::size_t stop) {
  return std::make_unique<StripDecoder>(std::move(content), start, stop);
}

}  // namespace accel::llm::detail
