#pragma once
// ChatTemplate's state and the JSON entry point the rest of the data room uses (private: nlohmann stays out
// of the public headers).

#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "accel/llm/data/chat_template.hpp"
#include "llm/data/jinja_ast.hpp"

namespace accel::llm {

struct ChatTemplate::Impl {
  std::string source;
  std::string origin;
  SpecialTokens special_tokens;
  std::shared_ptr<detail::jinja::Template> tpl;
  /// The named "tool_use" template, which transformers renders instead when tools are passed.
  std::shared_ptr<detail::jinja::Template> tool_use;
};

namespace detail {

using ojson = nlohmann::ordered_json;

/// JSON -> template value (objects keep their key order, as Python dicts do).
jinja::Value to_value(const ojson& j);

/// Renders parsed JSON: `messages` an array of objects, `tools` / `documents` arrays or null, `kwargs` an
/// object or null. Same semantics and errors as ChatTemplate::render.
RenderedChat render_chat(const ChatTemplate& t, const ojson& messages, bool add_generation_prompt,
                         const ojson& tools, const ojson& documents, const ojson& kwargs);

}  // namespace detail
}  // namespace accel::llm
