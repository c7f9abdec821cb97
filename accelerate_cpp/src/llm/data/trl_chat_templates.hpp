#pragma once
// TRL 1.16's chat templates compiled into the library (trl_chat_templates/, embed_chat_templates.cmake): the
// generated source defines embedded_chat_templates().

#include <cstddef>
#include <string>
#include <vector>

namespace accel::llm::detail {

struct EmbeddedChatTemplate {
  const char* name;  // the file name without ".jinja", e.g. "qwen2_5_training"
  const char* data;  // the file's bytes, exactly (not NUL-terminated)
  std::size_t size;
  std::string text() const { return std::string(data, size); }
};

/// Every file of trl_chat_templates/, in the order the build lists them.
const std::vector<EmbeddedChatTemplate>& embedded_chat_templates();

}  // namespace accel::llm::detail
