#pragma once
// Command-line pieces shared by the argument readers (TrainingArguments, ModelArguments).

#include <accel/errors.hpp>

#include <cstddef>
#include <optional>
#include <string>
#include <vector>

namespace accel::config_detail {

// Removes the first `--NAME FILE` / `--NAME=FILE` (also spelled with '-' for '_') from `args` and returns
// FILE; nullopt when absent. `what` describes the file in the error for a missing value ("TYPE.model.yaml").
inline std::optional<std::string> take_file_option(std::vector<std::string>& args, const std::string& name,
                                                   const std::string& what) {
  std::string dashed = name;
  for (auto& c : dashed)
    if (c == '_') c = '-';
  const std::string flag = "--" + name, dashed_flag = "--" + dashed, prefix = flag + "=";
  for (std::size_t i = 0; i < args.size(); ++i) {
    const auto at = args.begin() + static_cast<std::ptrdiff_t>(i);
    if (args[i] == flag || args[i] == dashed_flag) {
      if (i + 1 >= args.size()) throw ConfigError("command line: " + flag + " needs a file (" + what + ")");
      std::string file = args[i + 1];
      args.erase(at, at + 2);
      return file;
    }
    if (args[i].rfind(prefix, 0) == 0) {
      std::string file = args[i].substr(prefix.size());
      args.erase(at);
      return file;
    }
  }
  return std::nullopt;
}

}  // namespace accel::config_detail
