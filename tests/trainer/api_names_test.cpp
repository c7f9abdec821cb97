// Every `Class::member` that a library message names (advice such as "give it to Trainer::set_optimizer")
// exists: the class (or its module, ClassImpl) is declared in a header of the library (public, or private
// under accelerate_cpp/src) and that header declares the member (a function or a field). Classes of LibTorch
// named in messages (torch::nn::Module) are listed below and not looked for. A message that named a type the
// library never had (TrainerOptions::optimizer) is what this guards.
#include "build_paths.hpp"

#include <catch2/catch.hpp>

#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

namespace {

namespace fs = std::filesystem;

std::string read(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

// The contents of the string literals of a C++ source (comments and character literals skipped; raw strings
// R"(...)" read whole), one string per literal.
std::vector<std::string> string_literals(const std::string& src) {
  std::vector<std::string> out;
  std::size_t i = 0;
  const std::size_t n = src.size();
  while (i < n) {
    if (src.compare(i, 2, "//") == 0) {
      i = src.find('\n', i);
      if (i == std::string::npos) break;
    } else if (src.compare(i, 2, "/*") == 0) {
      i = src.find("*/", i + 2);
      if (i == std::string::npos) break;
      i += 2;
    } else if (src[i] == '\'') {
      ++i;
      while (i < n && src[i] != '\'')
        i += src[i] == '\\' ? 2 : 1;
      ++i;
    } else if (src.compare(i, 3, "R\"(") == 0) {
      const auto end = src.find(")\"", i + 3);
      if (end == std::string::npos) break;
      out.push_back(src.substr(i + 3, end - i - 3));
      i = end + 2;
    } else if (src[i] == '"') {
      std::string lit;
      ++i;
      while (i < n && src[i] != '"') {
        if (src[i] == '\\' && i + 1 < n) {
          lit += src[i + 1];
          i += 2;
        } else {
          lit += src[i++];
        }
      }
      ++i;
      out.push_back(lit);
    } else {
      ++i;
    }
  }
  return out;
}

std::vector<fs::path> sources(const fs::path& root) {
  std::vector<fs::path> files;
  for (const char* dir : {"accelerate_cpp/src", "accelerate_cpp/include", "backends", "launcher"}) {
    if (!fs::is_directory(root / dir)) continue;
    for (const auto& e : fs::recursive_directory_iterator(root / dir)) {
      const auto ext = e.path().extension().string();
      if (e.is_regular_file() && (ext == ".cpp" || ext == ".hpp")) files.push_back(e.path());
    }
  }
  return files;
}

}  // namespace

TEST_CASE("api names: every Class::member a library message names is declared in a public header") {
  const fs::path root = fs::path(accel::test::tests_dir()).parent_path();
  std::map<std::string, std::string> headers;  // path -> text
  for (const char* dir : {"accelerate_cpp/include", "accelerate_cpp/src", "backends"})
    for (const auto& e : fs::recursive_directory_iterator(root / dir))
      if (e.is_regular_file() && e.path().extension() == ".hpp") headers[e.path().string()] = read(e.path());
  const std::set<std::string> libtorch = {"Module", "Tensor", "Optimizer", "LRScheduler"};
  REQUIRE(headers.size() > 20);
  // Names of classes are CamelCase (std::, fmt::, accel:: and the like are lower case and not checked).
  const std::regex named(R"(\b([A-Z][A-Za-z0-9]*)::([a-z_][a-z0-9_]*)\b)");
  std::set<std::string> checked;
  int messages = 0;
  for (const auto& file : sources(root)) {
    for (const auto& lit : string_literals(read(file))) {
      for (std::sregex_iterator it(lit.begin(), lit.end(), named), end; it != end; ++it) {
        const std::string cls = (*it)[1], member = (*it)[2];
        const std::string what = cls + "::" + member;
        ++messages;
        if (libtorch.count(cls) > 0) continue;
        if (!checked.insert(what).second) continue;
        INFO(what << " named in a message of " << fs::relative(file, root).string());
        const std::regex declares_class("\\b(class|struct)\\s+" + cls + "(Impl)?\\b[^;]*\\{");
        const std::regex declares_member("\\b" + member + "\\s*[(;={]");
        bool has_class = false, has_member = false;
        for (const auto& [path, text] : headers) {
          if (!std::regex_search(text, declares_class)) continue;
          has_class = true;
          has_member = has_member || std::regex_search(text, declares_member);
        }
        CHECK(has_class);
        CHECK(has_member);
      }
    }
  }
  // The messages do name API: Trainer::set_optimizer at least (the advice for another optimizer).
  CHECK(checked.count("Trainer::set_optimizer") == 1);
  CHECK(messages > 5);
}
