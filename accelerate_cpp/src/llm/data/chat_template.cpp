#include "accel/llm/data/chat_template.hpp"

#include <filesystem>
#include <fstream>
#include <sstream>

#include "accel/errors.hpp"
#include "llm/data/chat_template_impl.hpp"
#include "llm/data/jinja_interp.hpp"

namespace accel::llm {
namespace fs = std::filesystem;
using detail::ojson;
namespace jinja = detail::jinja;

namespace {

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw ConfigError("cannot read " + path + ": the file does not exist or is not readable", path);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// A .jinja file as transformers reads it: open(path, encoding="utf-8").read(), whose universal newlines turn
// "\r\n" and a lone "\r" into "\n" (a template saved with Windows line ends renders, and compares with TRL's
// templates, as transformers has it).
std::string read_template_file(const std::string& path) {
  const std::string raw = read_text(path);
  std::string text;
  text.reserve(raw.size());
  for (std::size_t i = 0; i < raw.size(); ++i) {
    if (raw[i] != '\r') {
      text += raw[i];
      continue;
    }
    text += '\n';
    if (i + 1 < raw.size() && raw[i + 1] == '\n') ++i;
  }
  return text;
}

ojson read_json(const std::string& path) {
  try {
    return ojson::parse(read_text(path));
  } catch (const ojson::parse_error& e) {
    throw ConfigError(path + " is not valid JSON: " + e.what(), path);
  }
}

// A special token as tokenizer_config.json writes it: a string, an AddedToken object, or null.
std::optional<std::string> token_text(const ojson& v, const std::string& file, const std::string& key) {
  if (v.is_null()) return std::nullopt;
  if (v.is_string()) return v.get<std::string>();
  if (v.is_object() && v.contains("content") && v["content"].is_string())
    return v["content"].get<std::string>();
  throw ConfigError(
      file + ": key '" + key + "' must be a string, an object with \"content\", or null; got " + v.dump(),
      file, 0, key);
}

ojson parse_argument(const std::string& text, const char* what, bool want_array) {
  if (text.empty()) return nullptr;
  ojson j;
  try {
    j = ojson::parse(text);
  } catch (const ojson::parse_error& e) {
    throw UsageError(std::string("ChatTemplate::render: ") + what + " is not valid JSON: " + e.what());
  }
  if (want_array ? !j.is_array() : !j.is_object()) {
    throw UsageError(std::string("ChatTemplate::render: ") + what + " must be a JSON " +
                     (want_array ? "array" : "object") + ", got " + j.type_name());
  }
  return j;
}

// transformers' _normalize_chat_messages (null-valued keys dropped) and _alias_reasoning_fields.
ojson normalize_messages(const ojson& messages) {
  if (!messages.is_array()) {
    throw UsageError(std::string("ChatTemplate::render: messages must be a JSON array, got ") +
                     messages.type_name());
  }
  if (messages.empty()) {
    throw UsageError("ChatTemplate::render: cannot apply a chat template to an empty conversation");
  }
  ojson out = ojson::array();
  for (const auto& m : messages) {
    if (!m.is_object()) {
      throw UsageError("ChatTemplate::render: chat messages must be JSON objects, got " + m.dump());
    }
    ojson msg = ojson::object();
    for (auto it = m.begin(); it != m.end(); ++it) {
      if (!it.value().is_null()) msg[it.key()] = it.value();
    }
    const ojson* reasoning = nullptr;
    for (const char* key : {"reasoning_content", "thinking", "reasoning"}) {
      if (msg.contains(key)) {
        reasoning = &msg[key];
        break;
      }
    }
    if (reasoning != nullptr) {
      const ojson r = *reasoning;
      ojson aliased = ojson::object();
      aliased["thinking"] = r;  // {"thinking": r, **message, "reasoning_content": r}
      for (auto it = msg.begin(); it != msg.end(); ++it)
        aliased[it.key()] = it.value();
      aliased["thinking"] = msg.contains("thinking") ? msg["thinking"] : r;
      aliased["reasoning_content"] = r;
      msg = std::move(aliased);
    }
    out.push_back(std::move(msg));
  }
  return out;
}

}  // namespace

SpecialTokens SpecialTokens::from_tokenizer_config(const std::string& path) {
  const ojson config = read_json(path);
  if (!config.is_object()) throw ConfigError(path + " must hold a JSON object", path);
  ojson legacy = ojson::object();
  const std::string legacy_path = (fs::path(path).parent_path() / "special_tokens_map.json").string();
  if (!config.contains("added_tokens_decoder") && fs::exists(legacy_path)) legacy = read_json(legacy_path);
  SpecialTokens t;
  const std::pair<const char*, std::optional<std::string>*> fields[] = {
      {"bos_token", &t.bos_token},  {"eos_token", &t.eos_token}, {"unk_token", &t.unk_token},
      {"sep_token", &t.sep_token},  {"pad_token", &t.pad_token}, {"cls_token", &t.cls_token},
      {"mask_token", &t.mask_token}};
  for (const auto& [key, slot] : fields) {
    if (config.contains(key)) *slot = token_text(config[key], path, key);
    if (!*slot && legacy.is_object() && legacy.contains(key))
      *slot = token_text(legacy[key], legacy_path, key);
  }
  return t;
}

ChatTemplate::ChatTemplate(std::shared_ptr<const Impl> impl) : impl_(std::move(impl)) {}
ChatTemplate::ChatTemplate(const ChatTemplate&) = default;
ChatTemplate& ChatTemplate::operator=(const ChatTemplate&) = default;
ChatTemplate::ChatTemplate(ChatTemplate&&) noexcept = default;
ChatTemplate& ChatTemplate::operator=(ChatTemplate&&) noexcept = default;
ChatTemplate::~ChatTemplate() = default;

ChatTemplate ChatTemplate::from_string(const std::string& source, const std::string& origin,
                                       SpecialTokens special_tokens) {
  auto impl = std::make_shared<Impl>();
  impl->source = source;
  impl->origin = origin;
  impl->special_tokens = std::move(special_tokens);
  impl->tpl = jinja::parse_template(source, origin);
  return ChatTemplate(std::move(impl));
}

namespace {

struct NamedTemplates {
  std::optional<std::pair<std::string, std::string>> default_;  // (source, origin)
  std::optional<std::pair<std::string, std::string>> tool_use;
};

// transformers 5: chat_template.jinja and additional_chat_templates/NAME.jinja take priority over the
// tokenizer_config.json key.
NamedTemplates template_files(const std::string& dir) {
  NamedTemplates t;
  const fs::path jinja = fs::path(dir) / "chat_template.jinja";
  const fs::path tool_use = fs::path(dir) / "additional_chat_templates" / "tool_use.jinja";
  if (fs::exists(jinja)) t.default_ = std::make_pair(read_template_file(jinja.string()), jinja.string());
  if (fs::exists(tool_use))
    t.tool_use = std::make_pair(read_template_file(tool_use.string()), tool_use.string());
  return t;
}

NamedTemplates config_templates(const ojson& config, const std::string& path) {
  NamedTemplates t;
  const ojson* tpl =
      config.is_object() && config.contains("chat_template") ? &config["chat_template"] : nullptr;
  if (tpl == nullptr || tpl->is_null()) return t;
  if (tpl->is_string()) {
    t.default_ = std::make_pair(tpl->get<std::string>(), path);
    return t;
  }
  if (!tpl->is_array()) {
    throw ConfigError(path + ": \"chat_template\" must be a string or a list of {name, template}", path, 0,
                      "chat_template");
  }
  for (const auto& named : *tpl) {
    if (!named.is_object() || !named.contains("template") || !named["template"].is_string()) continue;
    const std::string name = named.value("name", "");
    auto entry = std::make_pair(named["template"].get<std::string>(), path + " (template \"" + name + "\")");
    if (name == "default") t.default_ = entry;
    if (name == "tool_use") t.tool_use = entry;
  }
  return t;
}

}  // namespace

ChatTemplate ChatTemplate::from_pretrained(const std::string& dir) {
  const std::string config_path = (fs::path(dir) / "tokenizer_config.json").string();
  SpecialTokens tokens;
  if (fs::exists(config_path)) tokens = SpecialTokens::from_tokenizer_config(config_path);
  NamedTemplates named = template_files(dir);
  if (!named.default_ && !named.tool_use && fs::exists(config_path)) {
    named = config_templates(read_json(config_path), config_path);
  }
  if (!named.default_) {
    if (named.tool_use) {
      throw ConfigError(named.tool_use->second + " is a \"tool_use\" chat template without a \"default\" one",
                        named.tool_use->second, 0, "chat_template");
    }
    throw ConfigError("no chat template in " + dir +
                          ": neither chat_template.jinja nor a \"chat_template\" in "
                          "tokenizer_config.json; conversational data needs one: write the model's template "
                          "as chat_template.jinja in " +
                          dir +
                          " (TRL ships common ones in trl/chat_templates/), or use text or prompt-completion "
                          "data (in code: ChatTemplate::from_string)",
                      dir, 0, "chat_template");
  }
  ChatTemplate t = from_string(named.default_->first, named.default_->second, tokens);
  if (named.tool_use) {
    auto impl = std::make_shared<Impl>(*t.impl_);
    impl->tool_use = jinja::parse_template(named.tool_use->first, named.tool_use->second);
    t.impl_ = std::move(impl);
  }
  return t;
}

RenderedChat ChatTemplate::render(const std::string& messages_json, const ChatRenderOptions& options) const {
  ojson messages;
  try {
    messages = ojson::parse(messages_json);
  } catch (const ojson::parse_error& e) {
    throw UsageError(std::string("ChatTemplate::render: the messages are not valid JSON: ") + e.what());
  }
  return detail::render_chat(*this, messages, options.add_generation_prompt,
                             parse_argument(options.tools_json, "tools_json", true),
                             parse_argument(options.documents_json, "documents_json", true),
                             parse_argument(options.template_kwargs_json, "template_kwargs_json", false));
}

bool ChatTemplate::has_generation_blocks() const {
  return impl_->tpl->has_generation;
}
const std::string& ChatTemplate::source() const {
  return impl_->source;
}
const std::string& ChatTemplate::origin() const {
  return impl_->origin;
}
const SpecialTokens& ChatTemplate::special_tokens() const {
  return impl_->special_tokens;
}

namespace detail {

jinja::Value to_value(const ojson& j) {
  switch (j.type()) {
    case ojson::value_t::null:
      return jinja::Value::none();
    case ojson::value_t::boolean:
      return jinja::Value::boolean(j.get<bool>());
    case ojson::value_t::number_integer:
      return jinja::Value::integer(j.get<int64_t>());
    case ojson::value_t::number_unsigned:
      return jinja::Value::integer(static_cast<int64_t>(j.get<uint64_t>()));
    case ojson::value_t::number_float:
      return jinja::Value::floating(j.get<double>());
    case ojson::value_t::string:
      return jinja::Value::string(j.get<std::string>());
    case ojson::value_t::array: {
      jinja::List items;
      for (const auto& x : j)
        items.push_back(to_value(x));
      return jinja::Value::list(std::move(items));
    }
    case ojson::value_t::object: {
      auto d = std::make_shared<jinja::Dict>();
      for (auto it = j.begin(); it != j.end(); ++it)
        d->entries.emplace_back(it.key(), to_value(it.value()));
      return jinja::Value::dict(d);
    }
    default:
      throw UsageError("ChatTemplate::render: unsupported JSON value " + j.dump());
  }
}

RenderedChat render_chat(const ChatTemplate& t, const ojson& messages, bool add_generation_prompt,
                         const ojson& tools, const ojson& documents, const ojson& kwargs) {
  const ChatTemplate::Impl& impl = t.impl();
  auto context = std::make_shared<jinja::Dict>();
  jinja::install_globals(*context);
  const SpecialTokens& st = impl.special_tokens;
  const std::pair<const char*, const std::optional<std::string>*> tokens[] = {
      {"bos_token", &st.bos_token},  {"eos_token", &st.eos_token}, {"unk_token", &st.unk_token},
      {"sep_token", &st.sep_token},  {"pad_token", &st.pad_token}, {"cls_token", &st.cls_token},
      {"mask_token", &st.mask_token}};
  for (const auto& [name, value] : tokens) {
    if (*value) context->set(name, jinja::Value::string(**value));
  }
  if (kwargs.is_object()) {
    for (auto it = kwargs.begin(); it != kwargs.end(); ++it)
      context->set(it.key(), to_value(it.value()));
  }
  context->set("messages", to_value(normalize_messages(messages)));
  context->set("tools", to_value(tools));
  context->set("documents", to_value(documents));
  context->set("add_generation_prompt", jinja::Value::boolean(add_generation_prompt));
  // transformers' get_chat_template: the "tool_use" template when tools are passed and the model has one.
  const jinja::Template& tpl = (!tools.is_null() && impl.tool_use) ? *impl.tool_use : *impl.tpl;
  jinja::Interpreter interpreter(tpl, context);
  RenderedChat out;
  out.text = interpreter.render(&out.generation_spans);
  return out;
}

}  // namespace detail
}  // namespace accel::llm
