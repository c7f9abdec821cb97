#include "accel/llm/data/jsonl_dataset.hpp"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>

#include <nlohmann/json.hpp>

#include "accel/errors.hpp"

namespace accel::llm {
namespace fs = std::filesystem;
using ojson = nlohmann::ordered_json;

namespace {

[[noreturn]] void bad_line(const std::string& file, int line, const std::string& field,
                           const std::string& what) {
  throw ConfigError(
      file + " line " + std::to_string(line) + (field.empty() ? "" : ", field '" + field + "'") + ": " + what,
      file, line, field);
}

std::string text_field(const ojson& obj, const char* key, const std::string& file, int line) {
  const ojson& v = obj.at(key);
  if (!v.is_string()) bad_line(file, line, key, std::string("must be a string, got ") + v.type_name());
  return v.get<std::string>();
}

// A message list as TRL's is_conversational sees it: a non-empty array of objects with a string "role".
void check_messages(const ojson& v, const std::string& field, const std::string& file, int line) {
  if (!v.is_array() || v.empty()) bad_line(file, line, field, "must be a non-empty list of messages");
  for (std::size_t i = 0; i < v.size(); ++i) {
    const ojson& m = v[i];
    const std::string where = field + "[" + std::to_string(i) + "]";
    if (!m.is_object()) bad_line(file, line, where, std::string("must be an object, got ") + m.type_name());
    if (!m.contains("role") || !m["role"].is_string())
      bad_line(file, line, where + ".role", "missing or not a string");
    if (m.contains("content") &&
        !(m["content"].is_string() || m["content"].is_array() || m["content"].is_null())) {
      bad_line(file, line, where + ".content",
               std::string("must be a string or a list, got ") + m["content"].type_name());
    }
  }
}

// ShareGPT -> ChatML as TRL's maybe_convert_to_chatml: "from" -> "role", "value" -> "content" (roles kept).
ojson sharegpt_to_chatml(const ojson& conv, const std::string& file, int line) {
  if (!conv.is_array() || conv.empty()) bad_line(file, line, "conversations", "must be a non-empty list");
  ojson out = ojson::array();
  for (const auto& m : conv) {
    if (!m.is_object()) bad_line(file, line, "conversations", "every entry must be an object");
    ojson msg = ojson::object();
    for (auto it = m.begin(); it != m.end(); ++it) {
      const std::string key = it.key() == "from" ? "role" : it.key() == "value" ? "content" : it.key();
      msg[key] = it.value();
    }
    out.push_back(std::move(msg));
  }
  return out;
}

// Alpaca -> conversational prompt-completion, as LLaMA-Factory's AlpacaDatasetConverter builds the turns.
void alpaca(const ojson& obj, Record& r) {
  ojson prompt = ojson::array();
  auto optional_text = [&](const char* key) -> std::string {
    if (!obj.contains(key) || obj[key].is_null()) return {};
    return text_field(obj, key, r.file, r.line);
  };
  const std::string system = optional_text("system");
  if (!system.empty()) prompt.push_back({{"role", "system"}, {"content", system}});
  if (obj.contains("history") && !obj["history"].is_null()) {
    const ojson& h = obj["history"];
    if (!h.is_array()) bad_line(r.file, r.line, "history", "must be a list of [instruction, response] pairs");
    for (const auto& pair : h) {
      if (!pair.is_array() || pair.size() != 2 || !pair[0].is_string() || !pair[1].is_string()) {
        bad_line(r.file, r.line, "history", "every entry must be a pair of strings [instruction, response]");
      }
      prompt.push_back({{"role", "user"}, {"content", pair[0]}});
      prompt.push_back({{"role", "assistant"}, {"content", pair[1]}});
    }
  }
  std::string query = optional_text("instruction");
  const std::string input = optional_text("input");
  if (!input.empty()) query = query.empty() ? input : query + "\n" + input;
  prompt.push_back({{"role", "user"}, {"content", query}});
  const ojson completion =
      ojson::array({{{"role", "assistant"}, {"content", text_field(obj, "output", r.file, r.line)}}});
  r.form = RecordForm::kConversationalPromptCompletion;
  r.prompt = prompt.dump();
  r.completion = completion.dump();
}

void prompt_completion(const ojson& obj, Record& r) {
  const ojson& p = obj["prompt"];
  const ojson& c = obj["completion"];
  if (p.is_string() && c.is_string()) {
    r.form = RecordForm::kPromptCompletion;
    r.prompt = p.get<std::string>();
    r.completion = c.get<std::string>();
    return;
  }
  if (p.is_array() && c.is_array()) {
    check_messages(p, "prompt", r.file, r.line);
    check_messages(c, "completion", r.file, r.line);
    r.form = RecordForm::kConversationalPromptCompletion;
    r.prompt = p.dump();
    r.completion = c.dump();
    return;
  }
  bad_line(r.file, r.line, p.is_string() || p.is_array() ? "completion" : "prompt",
           std::string("prompt and completion must both be strings or both be message lists; got ") +
               p.type_name() + " and " + c.type_name());
}

void extras(const ojson& obj, Record& r) {
  if (obj.contains("tools") && !obj["tools"].is_null()) {
    ojson tools = obj["tools"];
    if (tools.is_string()) {  // TRL json.loads a string column
      try {
        tools = ojson::parse(tools.get<std::string>());
      } catch (const ojson::parse_error& e) {
        bad_line(r.file, r.line, "tools", std::string("is a string but not JSON: ") + e.what());
      }
    }
    if (!tools.is_array()) bad_line(r.file, r.line, "tools", "must be a list of tool schemas");
    r.tools = tools.dump();
  }
  if (obj.contains("chat_template_kwargs") && !obj["chat_template_kwargs"].is_null()) {
    if (!obj["chat_template_kwargs"].is_object())
      bad_line(r.file, r.line, "chat_template_kwargs", "must be an object");
    r.template_kwargs = obj["chat_template_kwargs"].dump();
  }
}

std::vector<std::string> jsonl_files(const std::string& path) {
  if (!fs::exists(path)) throw ConfigError("dataset " + path + " does not exist", path);
  if (!fs::is_directory(path)) return {path};
  std::vector<std::string> files;
  for (const auto& entry : fs::directory_iterator(path)) {
    if (entry.is_regular_file() && entry.path().extension() == ".jsonl")
      files.push_back(entry.path().string());
  }
  std::sort(files.begin(), files.end());
  if (files.empty()) throw ConfigError("dataset directory " + path + " holds no *.jsonl file", path);
  return files;
}

}  // namespace

const char* record_form_name(RecordForm form) {
  switch (form) {
    case RecordForm::kText:
      return "text";
    case RecordForm::kPromptCompletion:
      return "prompt-completion";
    case RecordForm::kConversationalPromptCompletion:
      return "conversational prompt-completion";
    case RecordForm::kConversational:
      return "conversational (messages)";
  }
  return "?";
}

Record JsonlDataset::parse_line(const std::string& text, const std::string& file, int line) {
  ojson obj;
  try {
    obj = ojson::parse(text);
  } catch (const ojson::parse_error& e) {
    bad_line(file, line, "", std::string("not valid JSON: ") + e.what());
  }
  if (!obj.is_object())
    bad_line(file, line, "", std::string("must be a JSON object, got ") + obj.type_name());
  Record r;
  r.file = file;
  r.line = line;
  if (obj.contains("messages")) {
    check_messages(obj["messages"], "messages", file, line);
    r.form = RecordForm::kConversational;
    r.messages = obj["messages"].dump();
  } else if (obj.contains("conversations")) {
    const ojson msgs = sharegpt_to_chatml(obj["conversations"], file, line);
    check_messages(msgs, "conversations", file, line);
    r.form = RecordForm::kConversational;
    r.messages = msgs.dump();
  } else if (obj.contains("prompt") || obj.contains("completion")) {
    if (!obj.contains("completion")) bad_line(file, line, "completion", "missing (the line has a prompt)");
    if (!obj.contains("prompt")) bad_line(file, line, "prompt", "missing (the line has a completion)");
    prompt_completion(obj, r);
  } else if (obj.contains("instruction") || obj.contains("output")) {
    if (!obj.contains("output"))
      bad_line(file, line, "output", "missing (an Alpaca line needs instruction and output)");
    alpaca(obj, r);
  } else if (obj.contains("text")) {
    r.form = RecordForm::kText;
    r.text = text_field(obj, "text", file, line);
  } else {
    bad_line(file, line, "",
             "no field of a known form: expected \"text\", \"prompt\"+\"completion\", \"messages\", "
             "\"conversations\" or \"instruction\"+\"output\"");
  }
  extras(obj, r);
  return r;
}

namespace {

// The top-level elements of a JSON array file (a `.json` dataset as LLaMA-Factory ships them and datasets'
// JSON loader reads them), each with the line it starts on, for parse_line and its messages. The file is
// checked as a whole first, so that a syntax error is nlohmann's, with its line and column.
std::vector<std::pair<int, std::string>> json_array_items(const std::string& text, const std::string& file) {
  try {
    [[maybe_unused]] const auto whole = ojson::parse(text);  // parse's result must be used (-Werror)
  } catch (const ojson::parse_error& e) {
    throw ConfigError(file + ": a JSON array file (it starts with '['), but not valid JSON: " + e.what(),
                      file);
  }
  std::vector<std::pair<int, std::string>> items;
  int line = 1, depth = 0, start_line = 0;
  std::size_t start = std::string::npos;
  bool in_string = false, escaped = false;
  for (std::size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (c == '\n') ++line;
    if (in_string) {
      if (escaped) {
        escaped = false;
      } else if (c == '\\') {
        escaped = true;
      } else if (c == '"') {
        in_string = false;
      }
      continue;
    }
    const bool closes = c == ']' || c == '}';
    if (depth == 1 && start != std::string::npos && (c == ',' || c == ']')) {
      items.emplace_back(start_line, text.substr(start, i - start));
      start = std::string::npos;
    } else if (depth == 1 && start == std::string::npos && c != ',' && !closes &&
               std::string(" \t\r\n").find(c) == std::string::npos) {
      start = i;
      start_line = line;
    }
    if (c == '"') in_string = true;
    if (c == '[' || c == '{') ++depth;
    if (closes) --depth;
  }
  return items;
}

void add_record(JsonlDataset& ds, Record r) {
  if (!ds.records.empty() && r.form != ds.records.front().form) {
    const Record& first = ds.records.front();
    bad_line(r.file, r.line, "",
             std::string("is ") + record_form_name(r.form) + " data, but the dataset started as " +
                 record_form_name(first.form) + " data (" + first.file + " line " +
                 std::to_string(first.line) + "); one dataset holds one form, as TRL's SFTTrainer requires");
  }
  ds.records.push_back(std::move(r));
}

}  // namespace

RecordForm JsonlDataset::form() const {
  if (records.empty()) throw UsageError("JsonlDataset::form: the dataset is empty");
  return records.front().form;
}

JsonlDataset JsonlDataset::read(const std::string& path) {
  JsonlDataset ds;
  for (const std::string& file : jsonl_files(path)) {
    std::ifstream in(file, std::ios::binary);
    if (!in) throw ConfigError("cannot read dataset file " + file, file);
    const std::string all((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const auto first = all.find_first_not_of(" \t\r\n", all.rfind("\xEF\xBB\xBF", 0) == 0 ? 3 : 0);
    if (first != std::string::npos && all[first] == '[') {  // a JSON array of examples, not JSON Lines
      for (const auto& [line, text] : json_array_items(all, file))
        add_record(ds, parse_line(text, file, line));
      continue;
    }
    std::istringstream lines(all);
    std::string text;
    int line = 0;
    while (std::getline(lines, text)) {
      ++line;
      if (!text.empty() && text.back() == '\r') text.pop_back();
      if (text.find_first_not_of(" \t") == std::string::npos) continue;
      add_record(ds, parse_line(text, file, line));
    }
  }
  if (ds.records.empty()) throw ConfigError("dataset " + path + " holds no example", path);
  return ds;
}

}  // namespace accel::llm
