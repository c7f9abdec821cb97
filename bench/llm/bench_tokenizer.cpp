// bench_tokenizer: single-thread encoding throughput of accel::llm::Tokenizer (torch-free). Reads a tokenizer
// (a tokenizer.json file or a directory for from_pretrained) and a JSON list of texts, encodes all texts
// --repeat times, and prints one line per pass: texts, tokens, seconds, tokens/s. The Python side,
// bench/llm/tokenizer_bench.py, runs it interleaved with Hugging Face tokenizers on the same texts.
//   bench_tokenizer --tokenizer DIR_OR_JSON --texts texts.json [--repeat 3] [--add_special_tokens 0|1]
#include <accel/llm/tokenizers/tokenizer.hpp>

#include "bench_args.hpp"

#include <nlohmann/json.hpp>

#include <sys/stat.h>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

int main(int argc, char** argv) {
  struct {
    std::string tokenizer, texts;
    int repeat = 3, add_special_tokens = 1;
  } args;
  try {
    bench::Flags()
        .add("--tokenizer", args.tokenizer)
        .add("--texts", args.texts)
        .add("--repeat", args.repeat)
        .add("--add_special_tokens", args.add_special_tokens)
        .parse(argc, argv);
    if (args.tokenizer.empty() || args.texts.empty() || args.repeat < 1)
      throw std::invalid_argument("--tokenizer and --texts are required, --repeat at least 1");
  } catch (const std::invalid_argument& e) {
    std::cerr << "bench_tokenizer: " << e.what() << "\n";
    return 2;
  }
  try {
    struct stat st {};
    const bool dir = ::stat(args.tokenizer.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
    const auto tok = dir ? accel::llm::Tokenizer::from_pretrained(args.tokenizer)
                         : accel::llm::Tokenizer::from_file(args.tokenizer);
    std::ifstream in(args.texts);
    std::stringstream buffer;
    buffer << in.rdbuf();
    const auto texts = nlohmann::json::parse(buffer.str()).get<std::vector<std::string>>();
    std::size_t bytes = 0;
    for (const auto& t : texts)
      bytes += t.size();
    for (int r = 0; r < args.repeat; ++r) {
      const auto t0 = std::chrono::steady_clock::now();
      std::size_t tokens = 0;
      for (const auto& t : texts)
        tokens += tok.encode(t, args.add_special_tokens != 0).size();
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      std::printf("accel-cpp pass %d: %zu texts, %zu bytes, %zu tokens, %.4f s, %.0f tokens/s\n", r,
                  texts.size(), bytes, tokens, s, tokens / s);
    }
  } catch (const std::exception& e) {
    std::cerr << "bench_tokenizer: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
