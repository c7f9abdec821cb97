// `llm_data_tool prepare REQUEST.json`: prepares an SFT dataset with accel::llm and prints the examples and
// the collated batches as one JSON object. Tokenization is either the real accel::llm::Tokenizer (request key
// "tokenizer_dir", when the tokenizers room is built) or a table of texts the Python side encoded ("table":
// {"0" or "1" + text: ids}, the digit being add_special_tokens): texts missing from the table are printed as
// {"missing": [[text, add_special_tokens], ...]} for the script to encode and ask again.

#include "llm_data_tool_prepare.hpp"

#include <chrono>
#include <fstream>
#include <iostream>
#include <set>

#include <nlohmann/json.hpp>

#include "accel/errors.hpp"
#include "accel/llm/data/collator.hpp"
#include "accel/llm/data/sft_dataset.hpp"
#ifdef ACCEL_TEST_HAVE_TOKENIZERS
#include "accel/llm/tokenizers/tokenizer.hpp"
#endif

namespace accel::test {
namespace {

using json = nlohmann::ordered_json;

json batch_json(const llm::SftBatch& b) {
  json j = json::object();
  j["rows"] = b.rows;
  j["cols"] = b.cols;
  j["input_ids"] = b.input_ids;
  j["labels"] = b.labels;
  if (!b.attention_mask.empty()) j["attention_mask"] = b.attention_mask;
  if (!b.position_ids.empty()) j["position_ids"] = b.position_ids;
  if (!b.cu_seq_lens.empty()) {
    j["cu_seq_lens"] = b.cu_seq_lens;
    j["max_length"] = b.max_seq_len;
    j["seq_idx"] = b.seq_idx;
  }
  return j;
}

llm::SftDataOptions data_options(const json& o) {
  llm::SftDataOptions opt;
  if (o.contains("max_length")) {
    opt.max_length =
        o["max_length"].is_null() ? std::nullopt : std::optional<int64_t>(o["max_length"].get<int64_t>());
  }
  if (o.contains("completion_only_loss") && !o["completion_only_loss"].is_null()) {
    opt.completion_only_loss = o["completion_only_loss"].get<bool>();
  }
  opt.assistant_only_loss = o.value("assistant_only_loss", false);
  opt.packing = o.value("packing", false);
  opt.packing_strategy = o.value("packing_strategy", std::string("bfd"));
  opt.eos_token = o.value("eos_token", std::string());
  return opt;
}

// TRL's is_chat_template_stop_token_trained with the tokenizer's added vocabulary (tokenizer.json's
// added_tokens, transformers' get_added_vocab for a fast tokenizer) and decode.
bool stop_token_trained(const llm::ChatTemplate& tpl, const llm::EncodeFn& encode, const std::string& dir) {
#ifdef ACCEL_TEST_HAVE_TOKENIZERS
  const auto tokenizer = llm::Tokenizer::from_pretrained(dir);
  std::set<int64_t> added;
  std::ifstream in(dir + "/tokenizer.json");
  for (const auto& t : json::parse(in).value("added_tokens", json::array()))
    added.insert(t["id"].get<int64_t>());
  return llm::chat_template_stop_token_trained(
      tpl, encode, [&](int64_t id) { return tokenizer.decode({id}); },
      [&](int64_t id) { return added.count(id) != 0; });
#else
  (void)tpl, (void)encode, (void)dir;
  return false;
#endif
}

}  // namespace

int prepare_command(const std::string& request_path) {
  std::ifstream in(request_path);
  const json req = json::parse(in);
  std::set<std::pair<std::string, bool>> missing;
  const json table = req.value("table", json::object());
  llm::EncodeFn encode;
#ifdef ACCEL_TEST_HAVE_TOKENIZERS
  std::optional<llm::Tokenizer> tokenizer;
  if (req.contains("tokenizer_dir")) {
    tokenizer = llm::Tokenizer::from_pretrained(req["tokenizer_dir"].get<std::string>());
    encode = [&](const std::string& text, bool special) { return tokenizer->encode(text, special); };
  }
#endif
  if (!encode) {
    if (req.contains("tokenizer_dir")) {
      std::cout << json{{"error", "this build has no accel_llm_tokenizers"}}.dump() << "\n";
      return 3;
    }
    encode = [&](const std::string& text, bool special) {
      const std::string key = (special ? "1" : "0") + text;
      if (table.contains(key)) return table[key].get<std::vector<int64_t>>();
      missing.emplace(text, special);
      // Stand-in ids (one per byte: prefixes of a text stay prefixes of its ids) let this pass reach every
      // example, so one pass lists all the texts.
      return std::vector<int64_t>(text.begin(), text.end());
    };
  }
  json out = json::object();
  try {
    const auto ds = llm::JsonlDataset::read(req["dataset"].get<std::string>());
    std::optional<llm::ChatTemplate> tpl;
    if (req.contains("template_dir"))
      tpl = llm::ChatTemplate::from_pretrained(req["template_dir"].get<std::string>());
    // As finetune and TRL's SFTTrainer: under assistant_only_loss a template without {% generation %}
    // markers is swapped for TRL's training variant (or refused); the output names the variant.
    if (tpl && req["options"].value("assistant_only_loss", false)) {
      if (auto training = llm::training_chat_template(*tpl)) {
        out["training_template"] = training->training;
        tpl = std::move(training->chat_template);
      }
    }
    const auto start = std::chrono::steady_clock::now();
    const auto examples =
        llm::prepare_sft_examples(ds, tpl ? &*tpl : nullptr, encode, data_options(req["options"]));
    const std::chrono::duration<double> seconds = std::chrono::steady_clock::now() - start;
    if (req.value("time_only", false)) {  // for timing runs: no JSON of the rows
      int64_t tokens = 0;
      for (const auto& e : examples)
        tokens += static_cast<int64_t>(e.input_ids.size());
      std::cout << json{{"seconds", seconds.count()}, {"rows", examples.size()}, {"tokens", tokens}}.dump()
                << "\n";
      return 0;
    }
    json ex = json::array();
    for (const auto& e : examples) {
      ex.push_back(json{{"input_ids", e.input_ids}, {"labels", e.labels}, {"seq_lengths", e.seq_lengths}});
    }
    out["examples"] = ex;
    if (tpl && req.value("stop_token_check", false) && req.contains("tokenizer_dir")) {
      out["stop_token_trained"] = stop_token_trained(*tpl, encode, req["tokenizer_dir"].get<std::string>());
    }
    const json& c = req["collator"];
    // The collator TRL chose must be the one sft_collator_options chooses.
    const llm::SftDataOptions opt = data_options(req["options"]);
    llm::CollatorOptions co = llm::sft_collator_options(opt, c["pad_token_id"].get<int64_t>());
    if (co.padding_free != c.value("padding_free", false)) {
      std::cout << json{{"error", "sft_collator_options chose padding_free=" +
                                      std::to_string(co.padding_free) + ", TRL did not"}}
                       .dump()
                << "\n";
      return 0;
    }
    if (c.contains("pad_to_multiple_of") && !c["pad_to_multiple_of"].is_null()) {
      co.pad_to_multiple_of = c["pad_to_multiple_of"].get<int64_t>();
    }
    const auto batch_size = c["batch_size"].get<std::size_t>();
    json batches = json::array();
    for (std::size_t at = 0; at < examples.size(); at += batch_size) {
      const std::vector<llm::SftExample> part(
          examples.begin() + static_cast<std::ptrdiff_t>(at),
          examples.begin() + static_cast<std::ptrdiff_t>(std::min(at + batch_size, examples.size())));
      batches.push_back(batch_json(llm::collate(part, co)));
    }
    out["batches"] = batches;
  } catch (const accel::Error& e) {
    out = json{{"error", e.what()}};
  }
  if (!missing.empty()) {  // a table pass: errors come from the empty ids of texts not yet encoded
    json m = json::array();
    for (const auto& [text, special] : missing)
      m.push_back(json::array({text, special}));
    out = json{{"missing", m}};
  }
  std::cout << out.dump() << "\n";
  return 0;
}

}  // namespace accel::test
