#pragma once
// The corpus-driven fuzzer shared by the parser fuzz tests (tests/fault/*_fuzz_test.cpp): mutations of seed
// files, an address-space cap, and the rule every mutant must obey (parse, or be refused with an accel::
// error whose message is bounded and printable). ACCEL_FUZZ_ITERATIONS and ACCEL_FUZZ_SEED change the run.

#include "accel/errors.hpp"
#include "damage.hpp"
#include "temp_dir.hpp"

#include <catch2/catch.hpp>

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace accel_fuzz {

namespace fs = std::filesystem;

inline std::string read(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

inline void write(const fs::path& p, const std::string& bytes) {
  accel_fault::write_bytes(p, bytes);
}

inline std::size_t env_number(const char* name, std::size_t fallback) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? static_cast<std::size_t>(std::stoull(v)) : fallback;
}

// One mutation of `s`, chosen by `rng`.
inline std::string mutate(std::string s, std::mt19937_64& rng) {
  auto pick = [&](std::size_t n) { return n == 0 ? std::size_t{0} : static_cast<std::size_t>(rng() % n); };
  static const std::vector<std::string> kTokens = {
      "\0",          "\xff", "{",  "}",          "[",    "]",       ":",
      ",",           "\"",   "\n", "- ",         "&a ",  "*a",      "!!",
      "'",           "#",    "\t", "4294967296", "-1",   "1e308",   "nan",
      "0x",          "017",  "~",  "true",       "null", "\\u0000", "99999999999999999999999",
      "\xef\xbb\xbf"};
  const int kinds = 8;
  const int rounds = 1 + static_cast<int>(pick(3));
  for (int r = 0; r < rounds; ++r) {
    const std::size_t at = pick(s.size() + 1);
    switch (pick(kinds)) {
      case 0:  // flip a bit
        if (!s.empty()) s[pick(s.size())] ^= static_cast<char>(1u << pick(8));
        break;
      case 1:  // insert a token
        s.insert(at, kTokens[pick(kTokens.size())]);
        break;
      case 2:  // cut a range
        s.erase(at, pick(64));
        break;
      case 3: {  // double a range
        const auto len = pick(128);
        s.insert(at, s.substr(at, len));
        break;
      }
      case 4:  // truncate
        s.resize(at);
        break;
      case 5: {  // replace a digit run with a huge, negative or fractional number
        const auto digit = s.find_first_of("0123456789", at);
        if (digit == std::string::npos) break;
        const auto end = s.find_first_not_of("0123456789", digit);
        static const std::vector<std::string> kNumbers = {
            "4294967296", "-5", "18446744073709551616", "1.5", "-0", "9223372036854775807", "1e400", "0"};
        s.replace(digit, (end == std::string::npos ? s.size() : end) - digit,
                  kNumbers[pick(kNumbers.size())]);
        break;
      }
      case 6:  // deep nesting
        s.insert(at, std::string(pick(40) == 0 ? 100000 : 100 + pick(2000), pick(2) == 0 ? '[' : '{'));
        break;
      default:  // a random byte
        s.insert(at, 1, static_cast<char>(pick(256)));
        break;
    }
  }
  return s;
}

// Caps the address space while alive at what the process maps now plus 4 GiB (a LibTorch process maps
// gigabytes of libraries before it parses anything): a memory bomb becomes std::bad_alloc (a failure) instead
// of the OOM killer.
struct AddressSpaceCap {
  AddressSpaceCap() {
    ::getrlimit(RLIMIT_AS, &saved);
    std::size_t pages = 0;
    std::ifstream("/proc/self/statm") >> pages;
    const rlim_t mapped = static_cast<rlim_t>(pages) * static_cast<rlim_t>(::sysconf(_SC_PAGESIZE));
    rlimit capped = saved;
    capped.rlim_cur = std::min<rlim_t>(saved.rlim_cur, mapped + (rlim_t{4} << 30));
    ::setrlimit(RLIMIT_AS, &capped);
  }
  ~AddressSpaceCap() { ::setrlimit(RLIMIT_AS, &saved); }
  rlimit saved{};
};

struct Outcome {
  std::size_t parsed = 0, refused = 0;
};

// Runs `parse` on mutants of every seed; any exception that is not an accel::Error, or a message that is
// unbounded or has raw control characters, fails with the mutant's bytes saved for reproduction.
// `names`: what every refusal must name (the file it read), when given.
inline Outcome fuzz(const std::string& what, const std::vector<std::string>& seeds,
                    const std::function<void(const std::string&)>& parse, const std::string& names = "") {
  // About 2,400 mutants per parser by default, however many seeds it has.
  const std::size_t iterations =
      env_number("ACCEL_FUZZ_ITERATIONS", std::max<std::size_t>(1, 2400 / seeds.size()));
  std::mt19937_64 rng(env_number("ACCEL_FUZZ_SEED", 1));
  AddressSpaceCap cap;
  Outcome out;
  for (std::size_t s = 0; s < seeds.size(); ++s) {
    for (std::size_t i = 0; i < iterations; ++i) {
      const std::string mutant = mutate(seeds[s], rng);
      std::string failure;
      try {
        parse(mutant);
        ++out.parsed;
      } catch (const accel::Error& e) {
        ++out.refused;
        const std::string message = e.what();
        if (message.size() > 4000) failure = "a message of " + std::to_string(message.size()) + " characters";
        if (!names.empty() && message.find(names) == std::string::npos)
          failure = "a message that does not name " + names + ": " + message.substr(0, 300);
        for (unsigned char c : message) {
          if (c < 0x20 && c != '\n' && c != '\t') {
            failure = "a message with the raw control character " + std::to_string(c) + ": " +
                      message.substr(0, 300);
            break;
          }
        }
      } catch (const std::exception& e) {
        failure = std::string("a non-accel exception: ") + e.what();
      }
      if (!failure.empty()) {
        const auto keep = fs::temp_directory_path() / ("accel_fuzz_" + what + "_failure");
        write(keep, mutant);
        FAIL(what << " seed " << s << " mutant " << i << " (saved as " << keep.string() << "): " << failure);
      }
    }
  }
  INFO(what << ": " << out.parsed << " parsed, " << out.refused << " refused");
  CHECK(out.refused > 0);  // the mutations reach the checks
  return out;
}

using accel::test::TempDir;

inline std::vector<std::string> files_in(const fs::path& dir, const std::string& ext) {
  std::vector<fs::path> paths;
  for (const auto& e : fs::directory_iterator(dir)) {
    if (e.is_regular_file() && e.path().extension() == ext) paths.push_back(e.path());
  }
  std::sort(paths.begin(), paths.end());
  std::vector<std::string> out;
  for (const auto& p : paths)
    out.push_back(read(p));
  return out;
}

}  // namespace accel_fuzz
