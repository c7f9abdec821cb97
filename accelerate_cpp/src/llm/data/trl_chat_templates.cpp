// training_chat_template: TRL 1.16's get_training_chat_template as SFTTrainer calls it under
// assistant_only_loss (trl/chat_template_utils.py, trl/trainer/sft_trainer.py).
#include "llm/data/trl_chat_templates.hpp"

#include <regex>

#include "accel/errors.hpp"
#include "llm/data/chat_template_impl.hpp"

namespace accel::llm {
namespace {

// TRL's pairs (get_training_chat_template's `if chat_template == X_chat_template: return
// X_training_chat_template`) whose models accel::llm loads; trl_chat_templates/README.md lists the others.
constexpr const char* kTrainable[] = {"qwen2_5", "qwen3", "qwen3_instruct_2507", "llama3",
                                      "deepseek_r1_distill"};

const detail::EmbeddedChatTemplate& embedded(const std::string& name) {
  for (const auto& t : detail::embedded_chat_templates()) {
    if (name == t.name) return t;
  }
  throw UsageError("accel_llm_data was built without trl_chat_templates/" + name +
                   ".jinja (embed_chat_templates.cmake's list): rebuild from a complete source tree");
}

std::string known_names() {
  std::string names;
  for (const char* n : kTrainable)
    names += std::string(names.empty() ? "" : ", ") + n + ".jinja";
  return names;
}

}  // namespace

bool has_generation_markers(const std::string& source) {
  static const std::regex marker(R"(\{%-?\s*generation\s*-?%\})");
  return std::regex_search(source, marker);
}

std::optional<TrainingChatTemplate> training_chat_template(const ChatTemplate& chat_template) {
  const std::string& source = chat_template.source();
  if (has_generation_markers(source)) return std::nullopt;
  for (const char* name : kTrainable) {
    if (embedded(name).text() != source) continue;
    const std::string training = std::string(name) + "_training";
    const std::string origin =
        "trl/chat_templates/" + training + ".jinja (TRL 1.16.0, compiled into accelerate-cpp)";
    return TrainingChatTemplate{
        ChatTemplate::from_string(embedded(training).text(), origin, chat_template.special_tokens()),
        std::string(name) + ".jinja", training + ".jinja"};
  }
  throw ConfigError(
      chat_template.origin() +
          ": assistant_only_loss needs {% generation %} ... {% endgeneration %} around the assistant output, "
          "and this chat template has none and is not one TRL 1.16 ships a training variant for among the "
          "models accel::llm loads, known by their exact text: " +
          known_names() +
          " (SFTTrainer refuses any template it has no variant for: \"The chat template is not "
          "training-compatible (missing prefix-preservation or `{% generation %}` markers) and patching is "
          "not "
          "supported for this template\"; TRL's variants for other architectures, Gemma, Phi-3, Qwen3.5 ..., "
          "are not compiled in). Modify the chat template for training: wrap what the assistant generates, "
          "its end-of-turn token "
          "included, in {% generation %} ... {% endgeneration %} (TRL's trl/chat_templates/*_training.jinja "
          "show how) and save it as chat_template.jinja in the model directory; or set assistant_only_loss "
          "false",
      chat_template.origin(), 0, "chat_template");
}

}  // namespace accel::llm
