#pragma once
/// \file
/// Supervised fine-tuning data as users bring it (torch-free): a JSONL file, or a directory of `*.jsonl`
/// files read in name order, one example per line, in the forms TRL's SFTTrainer and LLaMA-Factory accept:
///
/// | line                                                        | read as |
/// |-------------------------------------------------------------|-------------------------------------------|
/// | `{"text": "..."}`                                           | language modeling | | `{"prompt": "...",
/// "completion": "..."}`                    | prompt-completion                         | | `{"prompt":
/// [messages], "completion": [messages]}`          | conversational prompt-completion          | |
/// `{"messages": [{"role": ..., "content": ...}, ...]}`        | conversational                            |
/// | `{"conversations": [{"from": ..., "value": ...}, ...]}`     | conversational (TRL's
/// maybe_convert_to_chatml: keys renamed, roles kept) | | `{"instruction", "input"?, "output", "system"?,
/// "history"?}`| Alpaca, as LLaMA-Factory's AlpacaDatasetConverter: user turn `instruction + "\n" + input`
/// (each only when non-empty), `history` pairs before it, `system` first; `output` is the completion |
///
/// Optional per-line `tools` (a JSON array, or a string holding one) and `chat_template_kwargs` (an object)
/// are passed to the chat template, as TRL does. A line that is not one of these forms is an
/// accel::ConfigError naming the file, the line number and the field.

#include <string>
#include <vector>

namespace accel::llm {

/// The form of a record (all records of a dataset share one form, as TRL decides it from the first example).
enum class RecordForm {
  kText,                            ///< language modeling: `text`
  kPromptCompletion,                ///< `prompt` + `completion` strings
  kConversationalPromptCompletion,  ///< `prompt` + `completion` message lists (Alpaca lands here)
  kConversational,                  ///< `messages` (and ShareGPT `conversations`)
};

/// One example. Message lists and tools are kept as JSON text (arrays of objects, key order kept).
struct Record {
  RecordForm form = RecordForm::kText;
  std::string text;             ///< kText
  std::string prompt;           ///< kPromptCompletion: text; kConversationalPromptCompletion: JSON array
  std::string completion;       ///< likewise
  std::string messages;         ///< kConversational: JSON array of messages
  std::string tools;            ///< JSON array, or empty when the line has no tools
  std::string template_kwargs;  ///< JSON object, or empty
  std::string file;             ///< where the line came from (errors name it)
  int line = 0;                 ///< 1-based
};

/// The records of a JSONL file or of every `*.jsonl` file of a directory (sorted by file name).
struct JsonlDataset {
  std::vector<Record> records;
  RecordForm form() const;

  /// Reads `path`. Blank lines are skipped. Throws accel::ConfigError naming the file, line and field for a
  /// malformed line, a line of another form than the first, or an empty dataset.
  static JsonlDataset read(const std::string& path);
  /// Parses one line (exposed for tests and streaming readers).
  static Record parse_line(const std::string& text, const std::string& file, int line);
};

/// The name of a form in messages ("text", "prompt-completion", ...).
const char* record_form_name(RecordForm form);

}  // namespace accel::llm
