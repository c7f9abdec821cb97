#pragma once
/// \file
/// Tokenized supervised fine-tuning examples as TRL's SFTTrainer prepares them (torch-free; trl 1.16's
/// `SFTTrainer._prepare_dataset`, `pack_dataset` and `DataCollatorForLanguageModeling`):
///
/// - text: `eos_token` appended when missing, ids = encode(text, add_special_tokens=true), loss on every
/// token.
/// - prompt-completion: `eos_token` appended to the completion when missing; prompt ids = encode(prompt),
/// full
///   ids = encode(prompt + completion); the completion starts where the two first differ (TRL's
///   common_prefix_length); with completion_only_loss (the default for this form) the prompt's labels are
///   -100.
/// - conversational: the chat template renders `messages` (tokenized with add_special_tokens=false, as
///   apply_chat_template does); with assistant_only_loss only tokens overlapping the template's
///   `{% generation %}` output keep their labels.
/// - conversational prompt-completion: prompt rendered with add_generation_prompt=true, prompt + completion
///   rendered whole; completion_only_loss and assistant_only_loss as above.
/// - max_length: without packing, sequences are cut to their first max_length tokens (truncation_mode
///   "keep_start", TRL's only mode) and examples left without any label are dropped.
/// - packing: "bfd" (TRL's default: best-fit decreasing over chunks of 1000 examples, as datasets' map
/// batches
///   them; a sequence longer than max_length is cut, never split across rows; each row records its documents'
///   lengths so position ids restart per document), "bfd_split" (overflow becomes further documents), or
///   "wrapped" (concatenate and cut every max_length tokens, documents cross rows).
///
/// Tokenization is a callable, so this room does not depend on the tokenizer room: pass
/// `[&](const std::string& t, bool special) { return tokenizer.encode(t, special); }`.

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "accel/llm/data/chat_template.hpp"
#include "accel/llm/data/jsonl_dataset.hpp"

namespace accel::llm {

/// Text -> ids, as `tokenizer(text, add_special_tokens=...)["input_ids"]`.
using EncodeFn = std::function<std::vector<int64_t>(const std::string& text, bool add_special_tokens)>;

/// SFTConfig's data keys (same names and defaults as trl 1.16).
struct SftDataOptions {
  /// Longest sequence (tokens); nullopt: no truncation (then packing is refused, as TRL refuses it).
  std::optional<int64_t> max_length = 1024;
  /// Loss on the completion only; nullopt: true for prompt-completion data, false otherwise (TRL's default).
  std::optional<bool> completion_only_loss;
  /// Loss on assistant output only (conversational data; the template needs `{% generation %}` blocks: pass
  /// training_chat_template's when the model's has none, as SFTTrainer swaps it in).
  bool assistant_only_loss = false;
  bool packing = false;
  /// "bfd" (default), "bfd_split" or "wrapped".
  std::string packing_strategy = "bfd";
  /// Appended to text and completions; empty: the chat template's eos_token.
  std::string eos_token;
  /// Examples packed together at most (datasets' map batch size, which TRL's packing runs under).
  int64_t packing_batch_size = 1000;
};

/// One training row. `labels` is -100 where no loss is taken. `seq_lengths`: the lengths of the documents
/// packed into the row (bfd packing), empty otherwise.
struct SftExample {
  std::vector<int64_t> input_ids;
  std::vector<int64_t> labels;
  std::vector<int64_t> seq_lengths;
};

/// Tokenizes (and, with options.packing, packs) a dataset. `chat_template` may be null for text and
/// prompt-completion data. Throws accel::ConfigError naming the dataset file and line for an example that
/// cannot be prepared (the template raised, no assistant tokens under assistant_only_loss ...), and for
/// options that cannot work (unknown packing strategy, assistant_only_loss without `{% generation %}`
/// blocks).
std::vector<SftExample> prepare_sft_examples(const JsonlDataset& dataset, const ChatTemplate* chat_template,
                                             const EncodeFn& encode, const SftDataOptions& options);

/// TRL's `pack_dataset` on already tokenized examples (each chunk of options.packing_batch_size examples is
/// packed on its own); `seq_length` is max_length.
std::vector<SftExample> pack_examples(const std::vector<SftExample>& examples, int64_t seq_length,
                                      const std::string& strategy, int64_t packing_batch_size = 1000);

/// TRL 1.16's is_chat_template_stop_token_trained, which SFTTrainer checks under assistant_only_loss (a false
/// result is a warning there: "the model may not learn to stop"): renders user / assistant / user ("dummy"
/// each), takes the assistant mask (assistant_mask) and tells whether its last token whose text is not
/// whitespace (`decode(id)` empty after Python's str.strip(), Unicode whitespace included) is in the
/// tokenizer's added vocabulary (`is_added_token`), where end-of-turn tokens are. False when the template
/// attributes the assistant's end-of-turn token to the next message, has no `{% generation %}` blocks, or
/// raises.
bool chat_template_stop_token_trained(const ChatTemplate& chat_template, const EncodeFn& encode,
                                      const std::function<std::string(int64_t)>& decode,
                                      const std::function<bool(int64_t)>& is_added_token);

/// The assistant mask of a rendered chat: 1 for every token overlapping a byte span of `spans`, as
/// transformers' return_assistant_tokens_mask marks them from token offsets. Without offsets, the token
/// boundaries at each span end are found by tokenizing the text before it (exact whenever the tokenizer
/// splits the text there, as it does at the special tokens and newlines that chat templates put around turns;
/// a token straddling the boundary is counted in, as transformers counts it).
std::vector<int64_t> assistant_mask(const std::string& text, const std::vector<int64_t>& ids,
                                    const std::vector<std::pair<std::size_t, std::size_t>>& spans,
                                    const EncodeFn& encode);

}  // namespace accel::llm
