#include "accel/llm/data/sft_dataset.hpp"

#include <algorithm>

#include "accel/errors.hpp"
#include "llm/data/chat_template_impl.hpp"

namespace accel::llm {
using detail::ojson;

namespace {

constexpr int64_t kIgnore = -100;

[[noreturn]] void example_error(const Record& r, const std::string& what) {
  throw ConfigError(r.file + " line " + std::to_string(r.line) + ": " + what, r.file, r.line);
}

// Whether Python's str.strip() leaves nothing of `text` (UTF-8): every code point is whitespace as
// str.isspace() has it (ASCII's \t-\r and space, \x1c-\x1f, U+0085, U+00A0, U+1680, U+2000-U+200A, U+2028,
// U+2029, U+202F, U+205F, U+3000). A byte that is not valid UTF-8 is not blank (transformers' decode makes it
// U+FFFD).
bool python_blank(const std::string& text) {
  for (std::size_t i = 0; i < text.size();) {
    const auto b = static_cast<unsigned char>(text[i]);
    const int len = b < 0x80 ? 1 : (b >> 5) == 0x6 ? 2 : (b >> 4) == 0xe ? 3 : (b >> 3) == 0x1e ? 4 : 0;
    if (len == 0 || i + static_cast<std::size_t>(len) > text.size()) return false;
    char32_t c = len == 1 ? b : len == 2 ? (b & 0x1f) : len == 3 ? (b & 0x0f) : (b & 0x07);
    for (int k = 1; k < len; ++k) {
      const auto cont = static_cast<unsigned char>(text[i + static_cast<std::size_t>(k)]);
      if ((cont >> 6) != 0x2) return false;
      c = (c << 6) | (cont & 0x3f);
    }
    i += static_cast<std::size_t>(len);
    const bool space = (c >= 0x09 && c <= 0x0d) || (c >= 0x1c && c <= 0x20) || c == 0x85 || c == 0xa0 ||
                       c == 0x1680 || (c >= 0x2000 && c <= 0x200a) || c == 0x2028 || c == 0x2029 ||
                       c == 0x202f || c == 0x205f || c == 0x3000;
    if (!space) return false;
  }
  return true;
}

std::size_t common_prefix_length(const std::vector<int64_t>& a, const std::vector<int64_t>& b) {
  std::size_t n = 0;
  while (n < a.size() && n < b.size() && a[n] == b[n])
    ++n;
  return n;
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

struct Tokenized {
  std::vector<int64_t> ids;
  std::vector<int64_t> completion_mask;  // empty: none
  std::vector<int64_t> assistant_mask;   // empty: none
};

ojson parse_or_null(const std::string& s) {
  return s.empty() ? ojson(nullptr) : ojson::parse(s);
}

// apply_chat_template(messages, tokenize=True): render, then encode without special tokens.
Tokenized render_and_encode(const ChatTemplate& tpl, const ojson& messages, bool add_generation_prompt,
                            bool assistant_mask_wanted, const Record& r, const EncodeFn& encode) {
  RenderedChat chat;
  try {
    chat = detail::render_chat(tpl, messages, add_generation_prompt, parse_or_null(r.tools), nullptr,
                               parse_or_null(r.template_kwargs));
  } catch (const Error& e) {
    example_error(r, std::string("the chat template cannot render this example: ") + e.what());
  }
  Tokenized t;
  t.ids = encode(chat.text, false);
  if (assistant_mask_wanted)
    t.assistant_mask = assistant_mask(chat.text, t.ids, chat.generation_spans, encode);
  return t;
}

Tokenized tokenize_record(const Record& r, const ChatTemplate* tpl, const EncodeFn& encode,
                          bool assistant_only, const std::string& eos) {
  Tokenized t;
  switch (r.form) {
    case RecordForm::kText:
      t.ids = encode(ends_with(r.text, eos) ? r.text : r.text + eos, true);
      return t;
    case RecordForm::kPromptCompletion: {
      const std::string completion = ends_with(r.completion, eos) ? r.completion : r.completion + eos;
      const std::vector<int64_t> prompt_ids = encode(r.prompt, true);
      t.ids = encode(r.prompt + completion, true);
      const std::size_t prompt_len = common_prefix_length(prompt_ids, t.ids);
      t.completion_mask.assign(t.ids.size(), 1);
      std::fill(t.completion_mask.begin(),
                t.completion_mask.begin() + static_cast<std::ptrdiff_t>(prompt_len), 0);
      return t;
    }
    case RecordForm::kConversational:
      return render_and_encode(*tpl, ojson::parse(r.messages), false, assistant_only, r, encode);
    case RecordForm::kConversationalPromptCompletion: {
      const ojson prompt = ojson::parse(r.prompt);
      ojson full = prompt;
      for (const auto& m : ojson::parse(r.completion))
        full.push_back(m);
      const Tokenized p = render_and_encode(*tpl, prompt, true, false, r, encode);
      t = render_and_encode(*tpl, full, false, assistant_only, r, encode);
      const std::size_t prompt_len = common_prefix_length(p.ids, t.ids);
      t.completion_mask.assign(t.ids.size(), 1);
      std::fill(t.completion_mask.begin(),
                t.completion_mask.begin() + static_cast<std::ptrdiff_t>(prompt_len), 0);
      return t;
    }
  }
  return t;
}

void check_options(const JsonlDataset& ds, const ChatTemplate* tpl, const SftDataOptions& o) {
  const RecordForm form = ds.form();
  const bool conversational =
      form == RecordForm::kConversational || form == RecordForm::kConversationalPromptCompletion;
  if (conversational && tpl == nullptr) {
    throw UsageError("prepare_sft_examples: " + std::string(record_form_name(form)) +
                     " data needs a chat template (ChatTemplate::from_pretrained(model_dir))");
  }
  if (o.assistant_only_loss && !conversational) {
    throw ConfigError("assistant_only_loss needs conversational data, but " + ds.records.front().file +
                      " holds " + record_form_name(form) + " data");
  }
  if (o.assistant_only_loss && !tpl->has_generation_blocks()) {
    throw ConfigError(
        "assistant_only_loss needs a chat template with {% generation %} ... {% endgeneration %} "
        "around assistant output, and " +
            tpl->origin() +
            " has none; pass training_chat_template(template)'s instead (TRL's training variant of a "
            "known template, which SFTTrainer swaps in; finetune does), or a template with the markers",
        tpl->origin());
  }
  if (o.packing && !o.max_length) throw ConfigError("packing needs max_length (the packed row length)");
  if (o.max_length && *o.max_length <= 0) {
    throw ConfigError("max_length must be positive, got " + std::to_string(*o.max_length));
  }
  const std::string& s = o.packing_strategy;
  if (o.packing && s != "bfd" && s != "bfd_split" && s != "wrapped") {
    throw ConfigError("packing_strategy '" + s + "' is unknown: use bfd, bfd_split or wrapped", "", 0,
                      "packing_strategy");
  }
}

}  // namespace

std::vector<int64_t> assistant_mask(const std::string& text, const std::vector<int64_t>& ids,
                                    const std::vector<std::pair<std::size_t, std::size_t>>& spans,
                                    const EncodeFn& encode) {
  std::vector<int64_t> mask(ids.size(), 0);
  for (const auto& [begin, end] : spans) {
    if (end <= begin) continue;
    // Tokens that end at or before `begin` are those of text[:begin]: the first token overlapping the span is
    // where encode(text[:begin]) stops matching ids.
    const std::size_t first = common_prefix_length(encode(text.substr(0, begin), false), ids);
    // Tokens that start before `end`: all of encode(text[:end]) when it is a prefix of ids, else the matching
    // part plus the token straddling `end`.
    const std::vector<int64_t> upto = encode(text.substr(0, end), false);
    std::size_t last = common_prefix_length(upto, ids);
    if (last < upto.size()) last = std::min(last + 1, ids.size());
    for (std::size_t i = first; i < last; ++i)
      mask[i] = 1;
  }
  return mask;
}

bool chat_template_stop_token_trained(const ChatTemplate& chat_template, const EncodeFn& encode,
                                      const std::function<std::string(int64_t)>& decode,
                                      const std::function<bool(int64_t)>& is_added_token) {
  const ojson messages = ojson::parse(
      R"([{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "dummy"},
          {"role": "user", "content": "dummy"}])");
  RenderedChat chat;
  try {
    chat = detail::render_chat(chat_template, messages, false, nullptr, nullptr, nullptr);
  } catch (const Error&) {
    return false;  // TRL: TemplateError, TypeError, ValueError -> False
  }
  const std::vector<int64_t> ids = encode(chat.text, false);
  const std::vector<int64_t> mask = assistant_mask(chat.text, ids, chat.generation_spans, encode);
  for (std::size_t i = ids.size(); i-- > 0;) {
    if (mask[i] == 0) continue;
    // TRL: `tokenizer.decode([id]).strip() == ""` skips the token (Unicode whitespace included).
    if (python_blank(decode(ids[i]))) continue;
    return is_added_token(ids[i]);
  }
  return false;
}

std::vector<SftExample> prepare_sft_examples(const JsonlDataset& ds, const ChatTemplate* tpl,
                                             const EncodeFn& encode, const SftDataOptions& o) {
  check_options(ds, tpl, o);
  const RecordForm form = ds.form();
  const bool completion_only = o.completion_only_loss.value_or(
      form == RecordForm::kPromptCompletion || form == RecordForm::kConversationalPromptCompletion);
  std::string eos = o.eos_token;
  if (eos.empty() && tpl != nullptr && tpl->special_tokens().eos_token)
    eos = *tpl->special_tokens().eos_token;
  if (eos.empty() && (form == RecordForm::kText || form == RecordForm::kPromptCompletion)) {
    throw UsageError(
        "prepare_sft_examples: text and prompt-completion data need an eos_token (set "
        "SftDataOptions::eos_token, or pass the model's chat template, which carries it)");
  }
  std::vector<SftExample> out;
  out.reserve(ds.records.size());
  for (const Record& r : ds.records) {
    const Tokenized t = tokenize_record(r, tpl, encode, o.assistant_only_loss, eos);
    if (o.assistant_only_loss &&
        std::find(t.assistant_mask.begin(), t.assistant_mask.end(), 1) == t.assistant_mask.end()) {
      example_error(
          r,
          "assistant_only_loss is set but this example has no assistant tokens (the chat template's "
          "{% generation %} blocks produced no token)");
    }
    SftExample ex;
    ex.input_ids = t.ids;
    ex.labels.resize(t.ids.size());
    for (std::size_t i = 0; i < t.ids.size(); ++i) {
      bool keep = true;
      if (completion_only && !t.completion_mask.empty()) keep = keep && t.completion_mask[i] != 0;
      if (!t.assistant_mask.empty()) keep = keep && t.assistant_mask[i] != 0;
      ex.labels[i] = keep ? t.ids[i] : kIgnore;
    }
    if (o.max_length && !o.packing) {
      const auto n = static_cast<std::size_t>(*o.max_length);
      if (ex.input_ids.size() > n) {
        ex.input_ids.resize(n);
        ex.labels.resize(n);
      }
      // TRL drops examples that truncation left without any label.
      if (std::all_of(ex.labels.begin(), ex.labels.end(), [](int64_t l) { return l == kIgnore; })) continue;
    }
    out.push_back(std::move(ex));
  }
  if (o.packing) return pack_examples(out, *o.max_length, o.packing_strategy, o.packing_batch_size);
  return out;
}

}  // namespace accel::llm
