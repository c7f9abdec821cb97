// The C++ side of tokenizers_hf.py: for each case directory (tokenizer.json, optionally
// tokenizer_config.json, and expected.json written by Hugging Face tokenizers / transformers), encodes and
// decodes every text with accel::llm::Tokenizer and compares id for id and text for text. Prints the counts;
// exits 1 on any mismatch.
#include <accel/errors.hpp>
#include <accel/llm/tokenizers/tokenizer.hpp>

#include <nlohmann/json.hpp>

#include <sys/stat.h>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

namespace {

using accel::llm::Tokenizer;
using nlohmann::json;

struct Counts {
  std::size_t texts = 0, ids = 0, mismatches = 0, decodes = 0;
};

// A JSON-quoted excerpt (a cut through a UTF-8 sequence shows as U+FFFD).
std::string quoted(const std::string& s) {
  return json(s.substr(0, 200)).dump(-1, ' ', false, json::error_handler_t::replace);
}

std::string show_ids(const Tokenizer& tok, const std::vector<int64_t>& ids, std::size_t from) {
  std::string s;
  for (std::size_t i = from; i < ids.size() && i < from + 8; ++i)
    s += std::to_string(ids[i]) + "(" + tok.id_to_token(ids[i]).value_or("?") + ") ";
  return s;
}

void report_ids(const std::string& what, const Tokenizer& tok, const std::string& text,
                const std::vector<int64_t>& ours, const std::vector<int64_t>& theirs, Counts& c) {
  if (ours == theirs) return;
  if (++c.mismatches > 6) return;
  std::size_t i = 0;
  while (i < ours.size() && i < theirs.size() && ours[i] == theirs[i])
    ++i;
  std::cout << "MISMATCH " << what << " text " << quoted(text) << "\n  at id " << i
            << "\n  ours:   " << show_ids(tok, ours, i) << "\n  theirs: " << show_ids(tok, theirs, i) << "\n";
}

void report_text(const std::string& what, const std::string& ours, const std::string& theirs, Counts& c) {
  ++c.decodes;
  if (ours == theirs) return;
  if (++c.mismatches > 6) return;
  std::cout << "MISMATCH " << what << "\n  ours:   " << quoted(ours) << "\n  theirs: " << quoted(theirs)
            << "\n";
}

std::vector<int64_t> ids_of(const json& j) {
  return j.get<std::vector<int64_t>>();
}

Counts check_case(const std::string& dir) {
  struct stat st {};
  const bool pretrained = ::stat((dir + "/tokenizer_config.json").c_str(), &st) == 0;
  const Tokenizer tok =
      pretrained ? Tokenizer::from_pretrained(dir) : Tokenizer::from_file(dir + "/tokenizer.json");
  std::ifstream in(dir + "/expected.json");
  std::stringstream buffer;
  buffer << in.rdbuf();
  const json e = json::parse(buffer.str());
  const auto& texts = e.at("texts");
  Counts c;
  const auto t0 = std::chrono::steady_clock::now();
  for (std::size_t i = 0; i < texts.size(); ++i) {
    const std::string text = texts[i].get<std::string>();
    const auto theirs = ids_of(e.at("ids")[i]);
    const auto ours = tok.encode(text, true);
    report_ids("encode", tok, text, ours, theirs, c);
    if (i % 4 == 0) {  // the Python side writes these for every 4th text
      const std::size_t k = i / 4;
      report_ids("encode(add_special_tokens=false)", tok, text, tok.encode(text, false),
                 ids_of(e.at("ids_plain")[k]), c);
      report_text("decode of text " + std::to_string(i), tok.decode(theirs, false), e.at("decoded")[k], c);
      report_text("decode(skip_special_tokens) of text " + std::to_string(i), tok.decode(theirs, true),
                  e.at("decoded_skip")[k], c);
    }
    ++c.texts;
    c.ids += theirs.size();
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  for (std::size_t i = 0; i < e.at("random_ids").size(); ++i) {
    const auto ids = ids_of(e.at("random_ids")[i]);
    report_text("decode of random ids " + e.at("random_ids")[i].dump(), tok.decode(ids, false),
                e.at("random_decoded")[i], c);
    report_text("decode(skip_special_tokens) of random ids " + e.at("random_ids")[i].dump(),
                tok.decode(ids, true), e.at("random_decoded_skip")[i], c);
  }
  if (tok.size() != e.at("size").get<int64_t>()) {
    ++c.mismatches;
    std::cout << "MISMATCH size(): ours " << tok.size() << ", theirs " << e.at("size") << "\n";
  }
  std::printf("%s%s: %zu texts, %zu ids, %zu decodes, %zu mismatches (%.2f s)\n", dir.c_str(),
              pretrained ? " (from_pretrained)" : "", c.texts, c.ids, c.decodes, c.mismatches, seconds);
  return c;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::cerr << "usage: tokenizer_check CASE_DIR...\n";
    return 2;
  }
  Counts all;
  try {
    for (int i = 1; i < argc; ++i) {
      const Counts c = check_case(argv[i]);
      all.texts += c.texts;
      all.ids += c.ids;
      all.decodes += c.decodes;
      all.mismatches += c.mismatches;
    }
  } catch (const std::exception& e) {
    std::cerr << "tokenizer_check: " << e.what() << "\n";
    return 1;
  }
  std::printf("tokenizers: %d tokenizers, %zu texts, %zu ids, %zu decodes, %zu mismatches\n", argc - 1,
              all.texts, all.ids, all.decodes, all.mismatches);
  return all.mismatches == 0 ? 0 : 1;
}
