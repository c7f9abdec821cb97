#pragma once
/// \file
/// Chat templates as transformers renders them (torch-free): the model's Jinja `chat_template`, read from
/// `chat_template.jinja` or `tokenizer_config.json`, rendered by a small Jinja interpreter with jinja2's
/// semantics under transformers' settings (ImmutableSandboxedEnvironment, trim_blocks, lstrip_blocks, loop
/// controls, the
/// `{% generation %}` tag, `raise_exception`, `strftime_now`, `tojson` without HTML escaping). A template
/// that uses a construct outside the interpreter's subset is refused with accel::ConfigError naming the file,
/// the line and the construct: a template renders exactly as `tokenizer.apply_chat_template(...,
/// tokenize=False)` or not at all.

#include <cstddef>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace accel::llm {

/// The named special tokens a template sees as variables (transformers' `tokenizer.special_tokens_map`:
/// bos_token, eos_token, unk_token, sep_token, pad_token, cls_token, mask_token; unset ones are undefined).
struct SpecialTokens {
  std::optional<std::string> bos_token;
  std::optional<std::string> eos_token;
  std::optional<std::string> unk_token;
  std::optional<std::string> sep_token;
  std::optional<std::string> pad_token;
  std::optional<std::string> cls_token;
  std::optional<std::string> mask_token;

  /// Reads them from `tokenizer_config.json` (a string or an AddedToken object {"content": ...} each; when
  /// the file has no `added_tokens_decoder`, `special_tokens_map.json` beside it fills the missing ones, as
  /// transformers' legacy loading does). Throws accel::ConfigError naming the file and key.
  static SpecialTokens from_tokenizer_config(const std::string& tokenizer_config_json);
};

/// The arguments of one rendering, as `apply_chat_template` takes them.
struct ChatRenderOptions {
  /// Appends the assistant header (`add_generation_prompt=True`).
  bool add_generation_prompt = false;
  /// `tools`: a JSON array of tool schemas; empty means None (the template sees `tools` as none).
  std::string tools_json;
  /// `documents`: a JSON array of {"title", "text"} objects; empty means None.
  std::string documents_json;
  /// Extra template variables as a JSON object (TRL's `chat_template_kwargs`, e.g. {"enable_thinking":
  /// false}); they override the special tokens of the same name, as transformers' kwargs do.
  std::string template_kwargs_json;
};

/// A rendered conversation.
struct RenderedChat {
  std::string text;
  /// Byte ranges [begin, end) of `text` that `{% generation %}` blocks produced (transformers'
  /// generation_indices, which return_assistant_tokens_mask and TRL's assistant_only_loss use).
  std::vector<std::pair<std::size_t, std::size_t>> generation_spans;
};

/// A parsed chat template. Immutable; render() may be called from several threads at once. Local to a rank.
class ChatTemplate {
 public:
  /// The template of a Hugging Face model or tokenizer directory, as `AutoTokenizer.from_pretrained(dir)`
  /// finds it: `chat_template.jinja` (and `additional_chat_templates/tool_use.jinja`) if present, else the
  /// `chat_template` key of `tokenizer_config.json` (a string, or a list of {"name", "template"}: "default",
  /// and "tool_use", which render() uses instead when tools are passed, as transformers does). Special tokens
  /// from tokenizer_config.json. Throws accel::ConfigError naming the file when there is no template or it
  /// cannot be rendered exactly.
  static ChatTemplate from_pretrained(const std::string& dir);
  /// A template from text; `origin` names it in errors (a file path, say).
  static ChatTemplate from_string(const std::string& source, const std::string& origin,
                                  SpecialTokens special_tokens = {});

  /// Renders `messages_json`, a JSON array of message objects ({"role", "content", ...}; `content` may be a
  /// string or a list of parts; tool_calls, reasoning_content ... pass through). As transformers does, keys
  /// whose value is null are dropped, and `reasoning_content` / `thinking` / `reasoning` are aliased to each
  /// other. Throws accel::ConfigError naming the template, its line and the reason when rendering fails (the
  /// template's raise_exception, an undefined value used, a type error) or reaches an unsupported construct,
  /// and accel::UsageError when an argument is not the JSON it should be.
  RenderedChat render(const std::string& messages_json, const ChatRenderOptions& options = {}) const;

  /// Whether the template marks assistant output with `{% generation %}` (needed for assistant-only loss).
  bool has_generation_blocks() const;
  /// The template text and where it came from.
  const std::string& source() const;
  const std::string& origin() const;
  const SpecialTokens& special_tokens() const;

  ChatTemplate(const ChatTemplate&);
  ChatTemplate& operator=(const ChatTemplate&);
  ChatTemplate(ChatTemplate&&) noexcept;
  ChatTemplate& operator=(ChatTemplate&&) noexcept;
  ~ChatTemplate();

  struct Impl;
  const Impl& impl() const { return *impl_; }

 private:
  explicit ChatTemplate(std::shared_ptr<const Impl> impl);
  std::shared_ptr<const Impl> impl_;
};

/// TRL's has_generation_markers: whether the template text holds `{% generation %}` (or a whitespace-trim
/// variant, `{%- generation -%}`), by TRL's regular expression on the text.
bool has_generation_markers(const std::string& source);

/// A training variant that TRL ships, swapped in for the model's chat template.
struct TrainingChatTemplate {
  /// The training template, with the model template's special tokens; origin() names its TRL file.
  ChatTemplate chat_template;
  /// The TRL file the model's template equals ("qwen2_5.jinja") and its variant ("qwen2_5_training.jinja").
  std::string matched;
  std::string training;
};

/// What TRL 1.16's SFTTrainer renders with under `assistant_only_loss` (`get_training_chat_template`, called
/// when the model's template has no `{% generation %}` markers). Returns nullopt when `chat_template`'s text
/// has the markers (has_generation_markers: it is used as it is). Otherwise, when its text (the "default"
/// template of a named set) equals byte for byte one of the templates TRL ships a training variant for, whose
/// models accel::llm loads (Qwen2.5, Qwen3, Qwen3-Instruct-2507, Llama 3, DeepSeek-R1-Distill: TRL 1.16's
/// files, compiled into the library), returns that variant. Any other template (Llama 3.1 / 3.2 included, for
/// which TRL has none) throws accel::ConfigError naming the template's file and what to do, as TRL raises.
std::optional<TrainingChatTemplate> training_chat_template(const ChatTemplate& chat_template);

}  // namespace accel::llm
