// accel::llm's data room: what the chat-template interpreter refuses and how it reports template errors, the
// JSONL forms and the messages of malformed lines, and TRL's packing and collator on the examples of TRL's
// own docstrings. Renders, ids and labels against transformers and TRL are checked by data_crosscheck.py.
#include <accel/errors.hpp>
#include <accel/llm/data/chat_template.hpp>
#include <accel/llm/data/collator.hpp>
#include <accel/llm/data/jsonl_dataset.hpp>
#include <accel/llm/data/sft_dataset.hpp>

#include "build_paths.hpp"
#include "temp_dir.hpp"

#include <catch2/catch.hpp>

#include <fstream>
#include <map>

namespace {

using accel::ConfigError;
using accel::llm::ChatTemplate;
using accel::llm::JsonlDataset;
using accel::llm::SftExample;
using Catch::Matchers::Contains;

std::string render(const std::string& tpl,
                   const std::string& messages = R"([{"role":"user","content":"hi"}])",
                   const std::string& kwargs = "") {
  accel::llm::ChatRenderOptions o;
  o.template_kwargs_json = kwargs;
  return ChatTemplate::from_string(tpl, "t.jinja").render(messages, o).text;
}

void write(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary) << text;
}

}  // namespace

TEST_CASE("chat templates: constructs outside the subset are refused naming the file, line and construct") {
  const std::map<std::string, std::string> refused = {
      {"{% include 'x.jinja' %}", "the statement `{% include %}`"},
      {"{% extends 'base' %}", "the statement `{% extends %}`"},
      {"{% call m() %}x{% endcall %}", "the statement `{% call %}`"},
      {"line one\n{{ x | wordwrap }}", "the filter 'wordwrap'"},
      {"{{ x is escaped_html }}", "the test 'escaped_html'"},
      {"{% for x in xs recursive %}{% endfor %}", "a recursive for loop"},
      {"{{ f(*args) }}", "`*args` / `**kwargs` in a call"},
  };
  for (const auto& [tpl, construct] : refused) {
    INFO(tpl);
    try {
      ChatTemplate::from_string(tpl, "/models/m/chat_template.jinja");
      FAIL("accepted");
    } catch (const ConfigError& e) {
      CHECK_THAT(e.what(), Contains("chat template /models/m/chat_template.jinja line"));
      CHECK_THAT(e.what(), Contains(construct + " is not supported by accel's chat-template interpreter"));
      CHECK(e.file() == "/models/m/chat_template.jinja");
    }
  }
  // Found while rendering (a method is known only once its object is): refused the same way.
  CHECK_THROWS_WITH(render("{{ messages[0].content.zfill(3) }}"),
                    Contains("line 1: str.zfill() is not supported by accel's chat-template interpreter"));
  CHECK_THROWS_WITH(render("{{ '%s' % 1 }}"), Contains("printf-style string formatting"));
}

TEST_CASE("chat templates: errors jinja2 raises while rendering are ConfigErrors naming the template line") {
  CHECK_THROWS_WITH(
      render("a\nb\n{{ raise_exception('Conversation roles must alternate') }}"),
      Contains("chat template t.jinja line 3: the template raised an exception: Conversation roles "
               "must alternate"));
  CHECK_THROWS_WITH(render("{{ nothing.attr }}"), Contains("'nothing' is undefined"));
  CHECK_THROWS_WITH(render("{{ 'a' + 1 }}"), Contains("unsupported operand type(s) for +: 'str' and 'int'"));
  CHECK_THROWS_WITH(render("{{ messages.append(1) }}"), Contains("list.append() is not allowed"));
  CHECK_THROWS_WITH(render("{% set ns = namespace(_x=1) %}"), Contains("underscore-prefixed"));
  CHECK_THROWS_WITH(render("{{ x"), Contains("line 1: missing end of variable tag"));
  CHECK_THROWS_WITH(render("{% if x %}"),
                    Contains("unexpected end of template, expected one of: elif, else, endif"));
  CHECK_THROWS_AS(ChatTemplate::from_string("{{ x }}", "t").render("{\"role\": \"user\"}"),
                  accel::UsageError);
  CHECK_THROWS_AS(ChatTemplate::from_string("{{ x }}", "t").render("[]"), accel::UsageError);
}

TEST_CASE("chat templates: jinja2 semantics the chat templates rely on") {
  // Scoping: a loop iteration's set is gone after it; namespaces carry state out; if blocks do not scope.
  CHECK(render("{% set x = 1 %}{% for i in [1, 2] %}{{ x }}{% set x = i * 10 %}{% endfor %}{{ x }}") ==
        "111");
  CHECK(render("{% set ns = namespace(n=0) %}{% for i in range(4) %}{% set ns.n = ns.n + i %}{% endfor %}{{ "
               "ns.n }}") == "6");
  CHECK(render("{% if true %}{% set y = 3 %}{% endif %}{{ y }}") == "3");
  // Python values: str() of containers and floats, integer division, slices, string methods.
  CHECK(render("{{ [1, 'a', none, true, 1.5, {'k': [2]}] }}|{{ 1 / 2 }}|{{ 7 // 2 }}|{{ -7 % 3 }}") ==
        "[1, 'a', None, True, 1.5, {'k': [2]}]|0.5|3|2");
  CHECK(
      render("{{ 'héllo'[::-1] }}|{{ 'héllo' | length }}|{{ ' a b '.split() }}|{{ 'x\\n'.rstrip('\\n') }}") ==
      "olléh|5|['a', 'b']|x");
  CHECK(render(
            "{{ {'b': 1, 'a': [1, 2]} | tojson }}|{{ {'a': 1} | tojson(indent=2) }}|{{ 'é\"<' | tojson }}") ==
        "{\"b\": 1, \"a\": [1, 2]}|{\n  \"a\": 1\n}|\"é\\\"<\"");
  CHECK(render("{{ 1e20 }} {{ 0.1 + 0.2 }} {{ 2.0 }} {{ 1e-5 }}") == "1e+20 0.30000000000000004 2.0 1e-05");
  // Whitespace control: trim_blocks and lstrip_blocks as transformers sets them, and the - markers.
  CHECK(render("a\n  {% if true %}\n  b\n  {% endif %}\nc") == "a\n  b\nc");
  CHECK(render("a  {%- if true -%}  b  {%- endif %}") == "ab");
  CHECK(render("{# note #}\nx") == "x");
  // Macros, loop variables, filters over message lists.
  CHECK(render("{% macro m(a, b='B') %}{{ a }}{{ b }}{% endmacro %}{{ m(1) }}{{ m(2, b=3) }}") == "1B23");
  CHECK(render("{% for m in messages %}{{ loop.index0 }}{{ loop.first }}{{ loop.last }}{{ loop.length }}{% "
               "endfor %}",
               R"([{"role":"user","content":"a"},{"role":"assistant","content":"b"}])") ==
        "0TrueFalse21FalseTrue2");
  CHECK(
      render(
          "{{ messages | selectattr('role', 'equalto', 'user') | map(attribute='content') | join(',') }}",
          R"([{"role":"user","content":"a"},{"role":"assistant","content":"b"},{"role":"user","content":"c"}])") ==
      "a,c");
  CHECK(render("{{ enable_thinking is defined and enable_thinking is false }}", R"([{"role":"user"}])",
               R"({"enable_thinking": false})") == "True");
}

TEST_CASE("chat templates: {% generation %} spans, and the templates of the fixtures load from a model dir") {
  accel::test::TempDir dir;
  std::ifstream in(accel::test::test_data_dir() + "/llm/qwen2_5_training.jinja");
  std::stringstream ss;
  ss << in.rdbuf();
  write(dir.file("tokenizer_config.json"), R"({"eos_token": "<|im_end|>", "bos_token": null})");
  write(dir.file("chat_template.jinja"), ss.str());
  const ChatTemplate tpl = ChatTemplate::from_pretrained(dir.path.string());
  CHECK(tpl.has_generation_blocks());
  CHECK(tpl.special_tokens().eos_token == std::optional<std::string>("<|im_end|>"));
  CHECK_FALSE(tpl.special_tokens().bos_token);
  const auto r = tpl.render(R"([{"role":"user","content":"Hi"},{"role":"assistant","content":"Yo"}])");
  REQUIRE(r.generation_spans.size() == 1);
  const auto [b, e] = r.generation_spans[0];
  CHECK(r.text.substr(b, e - b) == "\nYo<|im_end|>\n");
  CHECK(r.text.substr(0, b).size() > 0);
  // Without chat_template.jinja the key of tokenizer_config.json is read; without either, a clear error.
  std::filesystem::remove(dir.file("chat_template.jinja"));
  CHECK_THROWS_WITH(ChatTemplate::from_pretrained(dir.path.string()),
                    Contains("no chat template in " + dir.path.string()));
  // The fix a recipe user can apply (the model directory's file), not only the C++ call.
  CHECK_THROWS_WITH(ChatTemplate::from_pretrained(dir.path.string()),
                    Contains("write the model's template as chat_template.jinja in " + dir.path.string()));
  // Named templates: "tool_use" is rendered when tools are passed, as transformers' get_chat_template picks
  // it.
  write(dir.file("tokenizer_config.json"), R"({"chat_template": [{"name": "default", "template": "D{{ 1 }}"},
                                                                  {"name": "tool_use", "template": "T{{ tools|length }}"}]})");
  const ChatTemplate named = ChatTemplate::from_pretrained(dir.path.string());
  CHECK(named.render(R"([{"role":"user"}])").text == "D1");
  accel::llm::ChatRenderOptions with_tools;
  with_tools.tools_json = R"([{"name": "f"}, {"name": "g"}])";
  CHECK(named.render(R"([{"role":"user"}])", with_tools).text == "T2");
  // Files take priority over the config's key: chat_template.jinja and
  // additional_chat_templates/tool_use.jinja.
  write(dir.file("chat_template.jinja"), "F");
  std::filesystem::create_directory(dir.path / "additional_chat_templates");
  write(dir.file("additional_chat_templates/tool_use.jinja"), "FT");
  const ChatTemplate files = ChatTemplate::from_pretrained(dir.path.string());
  CHECK(files.render(R"([{"role":"user"}])").text == "F");
  CHECK(files.render(R"([{"role":"user"}])", with_tools).text == "FT");
}

TEST_CASE("JSONL: every form, a directory read in name order, Alpaca as LLaMA-Factory converts it") {
  accel::test::TempDir dir;
  const auto alpaca = JsonlDataset::parse_line(
      R"({"instruction": "Add.", "input": "2 and 3", "output": "5", "system": "Be exact.", "history": [["1+1?", "2"]]})",
      "a.jsonl", 1);
  CHECK(alpaca.form == accel::llm::RecordForm::kConversationalPromptCompletion);
  CHECK(
      alpaca.prompt ==
      R"([{"role":"system","content":"Be exact."},{"role":"user","content":"1+1?"},{"role":"assistant","content":"2"},{"role":"user","content":"Add.\n2 and 3"}])");
  CHECK(alpaca.completion == R"([{"role":"assistant","content":"5"}])");
  const auto sharegpt = JsonlDataset::parse_line(
      R"({"conversations": [{"from": "user", "value": "hi"}], "tools": "[]"})", "s", 2);
  CHECK(sharegpt.messages == R"([{"role":"user","content":"hi"}])");
  CHECK(sharegpt.tools == "[]");
  CHECK(JsonlDataset::parse_line(R"({"prompt": "p", "completion": "c"})", "f", 1).form ==
        accel::llm::RecordForm::kPromptCompletion);
  std::filesystem::create_directory(dir.path / "data");
  write(dir.file("data/b.jsonl"), "{\"text\": \"second\"}\n");
  write(dir.file("data/a.jsonl"), "{\"text\": \"first\"}\n\n  \n{\"text\": \"also first\"}\r\n");
  write(dir.file("data/readme.txt"), "not data");
  const auto ds = JsonlDataset::read((dir.path / "data").string());
  REQUIRE(ds.records.size() == 3);
  CHECK(ds.records[0].text == "first");
  CHECK(ds.records[1].line == 4);
  CHECK(ds.records[2].text == "second");
}

TEST_CASE("JSONL: a malformed line names the file, the line number and the field") {
  const std::map<std::string, std::string> bad = {
      {R"({"text": 3})", "d.jsonl line 7, field 'text': must be a string, got number"},
      {R"({"messages": [{"content": "x"}]})",
       "d.jsonl line 7, field 'messages[0].role': missing or not a string"},
      {R"({"messages": []})", "field 'messages': must be a non-empty list of messages"},
      {R"({"prompt": "p"})", "field 'completion': missing (the line has a prompt)"},
      {R"({"prompt": "p", "completion": [{"role": "assistant"}]})",
       "must both be strings or both be message lists"},
      {R"({"instruction": "i"})", "field 'output': missing"},
      {R"({"instruction": "i", "output": "o", "history": [["only one"]]})", "field 'history'"},
      {R"({"text": "t"} trailing)", "d.jsonl line 7: not valid JSON"},
      {R"(["text"])", "must be a JSON object, got array"},
      {R"({"content": "x"})", "no field of a known form"},
      {R"({"text": "t", "tools": "{not json"})", "field 'tools': is a string but not JSON"},
  };
  for (const auto& [line, message] : bad) {
    INFO(line);
    try {
      JsonlDataset::parse_line(line, "d.jsonl", 7);
      FAIL("accepted");
    } catch (const ConfigError& e) {
      CHECK_THAT(e.what(), Contains(message));
      CHECK(e.file() == "d.jsonl");
      CHECK(e.line() == 7);
    }
  }
  accel::test::TempDir dir;
  write(dir.file("mixed.jsonl"), "{\"text\": \"a\"}\n{\"prompt\": \"p\", \"completion\": \"c\"}\n");
  CHECK_THROWS_WITH(
      JsonlDataset::read(dir.file("mixed.jsonl")),
      Contains("mixed.jsonl line 2: is prompt-completion data, but the dataset started as text data"));
  CHECK_THROWS_WITH(JsonlDataset::read(dir.file("none.jsonl")), Contains("does not exist"));
  // A JSON array file (.json, as LLaMA-Factory ships data; datasets' loader reads it): the examples of the
  // array, and an error names the line its example starts on (data_crosscheck.py compares the rows with
  // TRL's).
  write(dir.file("arr.json"),
        "\xEF\xBB\xBF[\n  {\"text\": \"a, [b] {c} \\\"q\\\" \\\\\"},\n  {\n    \"text\": \"d\"\n  }\n]\n");
  const auto arr = JsonlDataset::read(dir.file("arr.json"));
  REQUIRE(arr.records.size() == 2);
  CHECK(arr.records[0].text == "a, [b] {c} \"q\" \\");
  CHECK(arr.records[1].text == "d");
  CHECK(arr.records[1].line == 3);
  write(dir.file("bad.json"), "[\n  {\"text\": \"a\"},\n\n  {\"messages\": [{\"content\": \"x\"}]}\n]");
  CHECK_THROWS_WITH(JsonlDataset::read(dir.file("bad.json")),
                    Contains("bad.json line 4, field 'messages[0].role': missing or not a string"));
  write(dir.file("cut.json"), "[{\"text\": \"a\"},\n {\"text\": ");
  CHECK_THROWS_WITH(JsonlDataset::read(dir.file("cut.json")),
                    Contains("cut.json: a JSON array file (it starts with '['), but not valid JSON"));
}

TEST_CASE(
    "packing: TRL's pack_dataset docstring examples (bfd keeps documents whole, bfd_split splits them)") {
  const std::vector<std::vector<int64_t>> ids = {{1, 2, 3, 4, 5}, {6, 7}, {8, 9, 10}, {11}};
  std::vector<SftExample> examples;
  for (const auto& x : ids)
    examples.push_back(SftExample{x, x, {}});
  const auto bfd = accel::llm::pack_examples(examples, 4, "bfd");
  REQUIRE(bfd.size() == 3);
  CHECK(bfd[0].input_ids == std::vector<int64_t>{1, 2, 3, 4});
  CHECK(bfd[1].input_ids == std::vector<int64_t>{8, 9, 10, 11});
  CHECK(bfd[1].seq_lengths == std::vector<int64_t>{3, 1});
  CHECK(bfd[2].input_ids == std::vector<int64_t>{6, 7});
  const auto split = accel::llm::pack_examples(examples, 4, "bfd_split");
  REQUIRE(split.size() == 3);
  CHECK(split[1].input_ids == std::vector<int64_t>{8, 9, 10, 5});
  CHECK(split[2].input_ids == std::vector<int64_t>{6, 7, 11});
  CHECK(split[2].seq_lengths == std::vector<int64_t>{2, 1});
  CHECK_THROWS_WITH(accel::llm::pack_examples(examples, 4, "greedy"), Contains("packing_strategy 'greedy'"));
}

TEST_CASE("collator: TRL's DataCollatorForLanguageModeling docstring examples (padded and padding-free)") {
  const std::vector<SftExample> examples = {{{1, 2, 3}, {-100, 2, 3}, {}}, {{4, 5}, {-100, 5}, {}}};
  accel::llm::CollatorOptions o;
  const auto padded = accel::llm::collate(examples, o);
  CHECK(padded.rows == 2);
  CHECK(padded.cols == 3);
  CHECK(padded.input_ids == std::vector<int64_t>{1, 2, 3, 4, 5, 0});
  CHECK(padded.attention_mask == std::vector<int64_t>{1, 1, 1, 1, 1, 0});
  CHECK(padded.labels == std::vector<int64_t>{-100, 2, 3, -100, 5, -100});
  o.padding_free = true;
  const auto flat = accel::llm::collate(examples, o);
  CHECK(flat.rows == 1);
  CHECK(flat.input_ids == std::vector<int64_t>{1, 2, 3, 4, 5});
  CHECK(flat.position_ids == std::vector<int64_t>{0, 1, 2, 0, 1});
  CHECK(flat.labels == std::vector<int64_t>{-100, 2, 3, -100, 5});
  CHECK(flat.cu_seq_lens == std::vector<int32_t>{0, 3, 5});
  CHECK(flat.max_seq_len == 3);
  CHECK(flat.seq_idx == std::vector<int32_t>{0, 0, 0, 1, 1});
  CHECK(flat.attention_mask.empty());
}

TEST_CASE("assistant_only_loss: TRL's training variant of a known template, by exact text, else a refusal") {
  accel::test::TempDir dir;
  std::ifstream in(accel::test::test_data_dir() + "/llm/qwen2_5.jinja");
  std::stringstream ss;
  ss << in.rdbuf();
  // Saved with Windows line ends: transformers reads .jinja files with universal newlines, so the text is
  // still TRL's qwen2_5.jinja.
  std::string crlf;
  for (const char c : ss.str())
    crlf += c == '\n' ? std::string("\r\n") : std::string(1, c);
  write(dir.file("tokenizer_config.json"), R"({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"})");
  write(dir.file("chat_template.jinja"), crlf);
  const ChatTemplate model = ChatTemplate::from_pretrained(dir.path.string());
  CHECK(model.source() == ss.str());
  const auto training = accel::llm::training_chat_template(model);
  REQUIRE(training);
  CHECK(training->matched == "qwen2_5.jinja");
  CHECK(training->training == "qwen2_5_training.jinja");
  CHECK(training->chat_template.has_generation_blocks());
  CHECK_THAT(training->chat_template.origin(), Contains("trl/chat_templates/qwen2_5_training.jinja"));
  CHECK(training->chat_template.special_tokens().eos_token == model.special_tokens().eos_token);
  // A template with markers is kept (nullopt), whatever whitespace control the tag has, as TRL's regex.
  CHECK_FALSE(accel::llm::training_chat_template(training->chat_template));
  for (const char* tag : {"{%- generation -%}", "{%generation%}", "{%- generation %}"}) {
    CHECK(accel::llm::has_generation_markers(std::string("a ") + tag + " b"));
  }
  CHECK_FALSE(accel::llm::has_generation_markers("{% generations %}"));
  // One character more and it is not TRL's template: refused naming the file and the fix.
  const auto edited = ChatTemplate::from_string(ss.str() + " ", "model/chat_template.jinja");
  CHECK_THROWS_WITH(
      accel::llm::training_chat_template(edited),
      Contains("model/chat_template.jinja: assistant_only_loss needs") &&
          Contains("not one TRL 1.16 ships a training variant for") &&
          Contains("qwen2_5.jinja, qwen3.jinja") && Contains("save it as chat_template.jinja") &&
          Contains("variants for other architectures, Gemma, Phi-3, Qwen3.5 ..., are not compiled"));
}

TEST_CASE(
    "chat_template_stop_token_trained: trailing blank tokens are skipped as Python's str.strip() does") {
  // One id per byte, except the end-of-turn token <E> (added, 1000) and one id for each of a few non-ASCII
  // characters that str.strip() removes (U+3000, U+00A0, U+2028) or keeps (U+00E9, not whitespace).
  const std::map<std::string, int64_t> words = {
      {"<E>", 1000}, {"\xe3\x80\x80", 2000}, {"\xc2\xa0", 2001}, {"\xe2\x80\xa8", 2002}, {"\xc3\xa9", 2003}};
  const accel::llm::EncodeFn encode = [&words](const std::string& s, bool) {
    std::vector<int64_t> ids;
    for (std::size_t i = 0; i < s.size();) {
      bool matched = false;
      for (const auto& [text, id] : words) {
        if (s.compare(i, text.size(), text) == 0) {
          ids.push_back(id);
          i += text.size();
          matched = true;
          break;
        }
      }
      if (!matched) ids.push_back(static_cast<unsigned char>(s[i++]));
    }
    return ids;
  };
  const auto decode = [&words](int64_t id) {
    for (const auto& [text, i] : words)
      if (i == id) return text;
    return std::string(1, static_cast<char>(id));
  };
  const auto is_added = [](int64_t id) { return id == 1000; };
  const auto trained = [&](const std::string& tail) {
    const auto tpl = ChatTemplate::from_string(
        "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}{{ m.content }}<E>" + tail +
            "{% endgeneration %}{% else %}{{ m.content }}<E>{% endif %}{% endfor %}",
        "stop.jinja");
    return accel::llm::chat_template_stop_token_trained(tpl, encode, decode, is_added);
  };
  CHECK(trained(""));
  CHECK(trained("\n "));
  // Python's str.strip() removes Unicode whitespace too: the end-of-turn token before them is the last one.
  CHECK(trained("\xe3\x80\x80"));
  CHECK(trained("\xc2\xa0\n"));
  CHECK(trained("\xe2\x80\xa8"));
  CHECK_FALSE(trained("\xc3\xa9"));  // content after the end-of-turn token: not trained to stop
}

TEST_CASE("SFT options that cannot work are refused before any example is tokenized") {
  accel::test::TempDir dir;
  write(dir.file("t.jsonl"), "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}]}\n");
  const auto ds = JsonlDataset::read(dir.file("t.jsonl"));
  const auto tpl =
      ChatTemplate::from_string("{% for m in messages %}{{ m.content }}{% endfor %}", "plain.jinja");
  const accel::llm::EncodeFn encode = [](const std::string& s, bool) {
    return std::vector<int64_t>(s.begin(), s.end());
  };
  accel::llm::SftDataOptions o;
  o.assistant_only_loss = true;
  CHECK_THROWS_WITH(accel::llm::prepare_sft_examples(ds, &tpl, encode, o),
                    Contains("plain.jinja has none; pass training_chat_template(template)'s instead"));
  CHECK_THROWS_AS(accel::llm::prepare_sft_examples(ds, nullptr, encode, {}), accel::UsageError);
  o = {};
  o.packing = true;
  o.max_length.reset();
  CHECK_THROWS_WITH(accel::llm::prepare_sft_examples(ds, &tpl, encode, o),
                    Contains("packing needs max_length"));
  o.max_length = 8;
  o.packing_strategy = "first_fit";
  CHECK_THROWS_WITH(accel::llm::prepare_sft_examples(ds, &tpl, encode, o),
                    Contains("packing_strategy 'first_fit'"));
}
