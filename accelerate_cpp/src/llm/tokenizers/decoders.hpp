#pragma once
// Decoders (tokenizers/src/decoders): token strings back to text.

#include "llm/tokenizers/pre_tokenizers.hpp"  // PrependScheme
#include "llm/tokenizers/regex.hpp"

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace accel::llm::detail {

class Decoder {
 public:
  virtual ~Decoder() = default;
  /// decode_chain: rewrites the list of token strings (joined with "" at the end).
  virtual void decode_chain(std::vector<std::string>& tokens) const = 0;
};

std::unique_ptr<Decoder> make_sequence_decoder(std::vector<std::unique_ptr<Decoder>> parts);
std::unique_ptr<Decoder> make_byte_level_decoder();
std::unique_ptr<Decoder> make_metaspace_decoder(std::string replacement, PrependScheme scheme);
std::unique_ptr<Decoder> make_replace_decoder(std::string literal, std::string content);
std::unique_ptr<Decoder> make_replace_decoder(Regex pattern, std::string content);
std::unique_ptr<Decoder> make_byte_fallback_decoder();
std::unique_ptr<Decoder> make_fuse_decoder();
std::unique_ptr<Decoder> make_strip_decoder(std::string content, std::size_t start, std::size_t stop);

}  // namespace accel::llm::detail
