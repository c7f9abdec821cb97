// accel::llm::Tokenizer: what it refuses (each message names the file, the JSON key and what is wrong) and
// the pieces whose semantics come from Rust (from_utf8_lossy, the byte-level alphabet, Oniguruma's \s). Ids
// against Hugging Face tokenizers are checked by tokenizers_hf.py on a 1 MB corpus.
#include <accel/errors.hpp>
#include <accel/llm/tokenizers/tokenizer.hpp>

#include "llm/tokenizers/regex.hpp"
#include "llm/tokenizers/unicode.hpp"
#include "temp_dir.hpp"

#include <catch2/catch.hpp>

#include <fstream>
#include <random>
#include <thread>

namespace {

using accel::ConfigError;
using accel::llm::Tokenizer;
using Catch::Matchers::Contains;

// A tiny byte-level BPE: "a" "b" "ab" and the merge (a, b); "Ġ" is the byte-level space.
std::string tiny_json(const std::string& model_override = "", const std::string& extra = "") {
  const std::string model =
      model_override.empty()
          ? R"({"type": "BPE", "dropout": null, "unk_token": null, "vocab": {"a": 0, "b": 1,
                                     "ab": 2, "Ġ": 3, "Ġab": 4}, "merges": ["a b", "Ġ ab"]})"
          : model_override;
  return R"({"version": "1.0", "truncation": null, "padding": null,
    "added_tokens": [{"id": 5, "content": "<|end|>", "single_word": false, "lstrip": false, "rstrip": false,
                      "normalized": false, "special": true}],
    "normalizer": null,
    "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
    "post_processor": null, "decoder": {"type": "ByteLevel"}, )" +
         extra + R"( "model": )" + model + "}";
}

std::string write(const accel::test::TempDir& dir, const std::string& name, const std::string& text) {
  const std::string path = dir.file(name);
  std::ofstream(path) << text;
  return path;
}

std::string error_of(const std::string& path) {
  try {
    Tokenizer::from_file(path);
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "(no error)";
}

}  // namespace

TEST_CASE("a tiny byte-level BPE encodes, decodes and matches special tokens", "[tokenizer]") {
  accel::test::TempDir dir;
  const Tokenizer tok = Tokenizer::from_file(write(dir, "tokenizer.json", tiny_json()));
  CHECK(tok.encode("ab ab<|end|>ab") == std::vector<int64_t>{2, 4, 5, 2});
  CHECK(tok.decode({2, 4, 5, 2}) == "ab ab<|end|>ab");
  CHECK(tok.decode({2, 4, 5, 2}, true) == "ab abab");
  CHECK(tok.size() == 6);
  CHECK(tok.token_to_id("<|end|>") == 5);
  CHECK(tok.id_to_token(4) == "Ġab");
  CHECK_FALSE(tok.id_to_token(99).has_value());
  CHECK_FALSE(tok.bos_token_id().has_value());
  CHECK(tok.encode_batch({"ab", "b"}) == std::vector<std::vector<int64_t>>{{2}, {1}});
  CHECK_THROWS_AS(tok.encode(std::string("a\xC3", 2)), accel::UsageError);
}

TEST_CASE("encode from several threads at once gives the single-thread ids", "[tokenizer]") {
  accel::test::TempDir dir;
  const Tokenizer tok = Tokenizer::from_file(write(dir, "tokenizer.json", tiny_json()));
  std::mt19937 rng(5);
  std::vector<std::string> texts(400);
  for (auto& text : texts) {
    for (int w = 0; w < 30; ++w) {  // many distinct words: the threads fill the shared cache together
      for (int c = static_cast<int>(rng() % 12); c >= 0; --c)
        text += "ab"[rng() % 2];
      text += rng() % 7 == 0 ? "<|end|>" : " ";
    }
  }
  std::vector<std::vector<std::vector<int64_t>>> results(4);
  std::vector<std::thread> threads;
  for (auto& r : results)
    threads.emplace_back([&] { r = tok.encode_batch(texts); });
  for (auto& t : threads)
    t.join();
  const Tokenizer fresh = Tokenizer::from_file(dir.file("tokenizer.json"));
  const auto expected = fresh.encode_batch(texts);
  for (const auto& r : results)
    CHECK(r == expected);
}

TEST_CASE("tokenizer.json that cannot be reproduced exactly is refused, naming file and key", "[tokenizer]") {
  accel::test::TempDir dir;
  SECTION("an unsupported model type") {
    const std::string path = write(dir, "t.json", tiny_json(R"({"type": "Unigram", "vocab": []})"));
    const std::string what = error_of(path);
    CHECK_THAT(what, Contains(path) && Contains("model.type") && Contains("Unigram") && Contains("BPE"));
  }
  SECTION("missing merges") {
    const std::string path = write(dir, "t.json", tiny_json(R"({"type": "BPE", "vocab": {"a": 0}})"));
    CHECK_THAT(error_of(path), Contains(path) && Contains("model.merges") && Contains("missing"));
  }
  SECTION("a merge of tokens outside the vocabulary") {
    const std::string path =
        write(dir, "t.json", tiny_json(R"({"type": "BPE", "vocab": {"a": 0, "b": 1}, "merges": ["a b"]})"));
    CHECK_THAT(error_of(path), Contains("model.merges") && Contains("\"ab\" is not in the vocabulary"));
  }
  SECTION("a malformed merge") {
    const std::string path =
        write(dir, "t.json", tiny_json(R"({"type": "BPE", "vocab": {"a": 0}, "merges": ["a"]})"));
    CHECK_THAT(error_of(path), Contains("model.merges[0]") && Contains("left right"));
  }
  SECTION("BPE dropout") {
    const std::string path = write(
        dir, "t.json", tiny_json(R"({"type": "BPE", "dropout": 0.1, "vocab": {"a": 0}, "merges": []})"));
    CHECK_THAT(error_of(path), Contains("model.dropout") && Contains("0.1"));
  }
  SECTION("an unsupported normalizer, nested in a Sequence") {
    std::string json = tiny_json();
    json.replace(
        json.find("\"normalizer\": null"), 18,
        R"("normalizer": {"type": "Sequence", "normalizers": [{"type": "NFC"}, {"type": "Lowercase"}]})");
    const std::string path = write(dir, "t.json", json);
    CHECK_THAT(error_of(path), Contains("normalizer.normalizers[1].type") && Contains("Lowercase"));
  }
  SECTION("a pre-tokenizer regex that does not compile") {
    std::string json = tiny_json();
    const std::string old =
        R"({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true})";
    json.replace(
        json.find(old), old.size(),
        R"({"type": "Split", "pattern": {"Regex": "(unclosed"}, "behavior": "Isolated", "invert": false})");
    const std::string path = write(dir, "t.json", json);
    CHECK_THAT(error_of(path), Contains("pre_tokenizer.pattern.Regex") && Contains("(unclosed"));
  }
  SECTION("truncation set in the file") {
    std::string json = tiny_json();
    json.replace(json.find("\"truncation\": null"), 18, R"("truncation": {"max_length": 8})");
    CHECK_THAT(error_of(write(dir, "t.json", json)), Contains("truncation") && Contains("null"));
  }
  SECTION("bad JSON") {
    const std::string path = write(dir, "t.json", "{\"model\": [1, 2,");
    CHECK_THAT(error_of(path), Contains(path) && Contains("not valid JSON"));
  }
  SECTION("a missing file, and a directory without tokenizer.json") {
    CHECK_THAT(error_of(dir.file("absent.json")), Contains("absent.json") && Contains("cannot open"));
    CHECK_THROWS_WITH(Tokenizer::from_pretrained(dir.path.string()),
                      Contains("tokenizer.json") && Contains("not found"));
  }
}

TEST_CASE("tokenizer_config.json names the special tokens", "[tokenizer]") {
  accel::test::TempDir dir;
  write(dir, "tokenizer.json", tiny_json());
  write(dir, "tokenizer_config.json",
        R"({"bos_token": {"content": "ab", "special": true}, "eos_token": "<|end|>", "pad_token": "<pad>",
            "add_bos_token": true})");
  const Tokenizer tok = Tokenizer::from_pretrained(dir.path.string());
  CHECK(tok.bos_token_id() == 2);
  CHECK(tok.eos_token_id() == 5);
  CHECK(tok.pad_token_id() == 6);  // added after the vocabulary, as transformers does
  CHECK(tok.encode("b<pad>") == std::vector<int64_t>{1, 6});
  CHECK(tok.decode({2, 1, 6}, true) == "b");  // "ab" became a special token
  write(dir, "tokenizer_config.json", R"({"split_special_tokens": true})");
  CHECK_THROWS_WITH(Tokenizer::from_pretrained(dir.path.string()), Contains("split_special_tokens"));
  write(dir, "tokenizer_config.json", R"({"eos_token": 5})");
  CHECK_THROWS_WITH(Tokenizer::from_pretrained(dir.path.string()),
                    Contains("tokenizer_config.json") && Contains("eos_token"));
}

TEST_CASE("Rust's from_utf8_lossy, GPT-2's alphabet and Oniguruma's \\s", "[tokenizer]") {
  using namespace accel::llm::detail;
  CHECK(utf8_lossy("Hello \xF0\x90\x80World") == "Hello \xEF\xBF\xBDWorld");
  CHECK(utf8_lossy("\xC0\xAF") == "\xEF\xBF\xBD\xEF\xBF\xBD");
  CHECK(utf8_lossy("\xED\xA0\x80") == "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD");
  const auto& alphabet = ByteLevelAlphabet::get();
  CHECK(alphabet.encode(' ') == "Ġ");
  CHECK(alphabet.encode('\n') == "Ċ");
  CHECK(alphabet.encode('a') == "a");
  for (int b = 0; b < 256; ++b) {
    std::size_t pos = 0;
    const std::string_view s = alphabet.encode(static_cast<unsigned char>(b));
    CHECK(alphabet.decode(next_code_point(s, pos)) == b);
  }
  std::vector<std::pair<std::size_t, std::size_t>> matches;
  Regex(R"(\s+)").find_all(
      "a\xC2\x85\xE3\x80\x80"
      "b",
      matches);  // NEL and ideographic space
  REQUIRE(matches.size() == 1);
  CHECK(matches[0] == std::make_pair<std::size_t, std::size_t>(1, 6));
  Regex(R"([^\s\p{L}]+)").find_all("a, b", matches);
  REQUIRE(matches.size() == 1);
  CHECK(matches[0].first == 1);
}
