// The pieces of deepspeed_json.cpp that its topic files share (private to backends/zero): the file being read
// (JsonFile: its path and text, errors naming key, file and line) and the value readers, and each topic's
// entry point. deepspeed_json.cpp: reading, parsing, top-level keys, batch sizes, accumulation, clipping,
// AutoTP and the unsupported-keys table; deepspeed_json_precision.cpp: fp16 / bf16 / torch_autocast and the
// loss scaler; deepspeed_json_zero.cpp: zero_optimization and its offload blocks.
#pragma once

#include "deepspeed_json.hpp"

#include <nlohmann/json.hpp>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace accel::config_detail::ds_json {

using Json = nlohmann::json;

/// The 1-based line of the first `"key"` in `text` (0 when absent).
std::size_t line_of_key(const std::string& text, const std::string& key);

class JsonFile {
 public:
  JsonFile(std::string path, std::string text) : path_(std::move(path)), text_(std::move(text)) {}

  [[noreturn]] void fail(const std::string& key_path, const std::string& leaf,
                         const std::string& body) const {
    const auto line = static_cast<int>(line_of_key(text_, leaf));
    fail_at_line(line, key_path, body);
  }
  [[noreturn]] void fail_at_line(int line, const std::string& key_path, const std::string& body) const {
    throw ConfigError(location(path_, line) + body, path_, line, key_path);
  }
  const std::string& path() const { return path_; }
  const std::string& text() const { return text_; }

 private:
  std::string path_, text_;
};

/// Whether `v` is the string "auto".
bool is_auto(const Json& v);
/// A non-negative integer count (JSON integer or float notation such as 5e8) or "auto" (nullopt).
std::optional<std::uint64_t> count_or_auto(const JsonFile& f, const Json& v, const std::string& path,
                                           const std::string& leaf);
/// A JSON boolean, or an error naming `path`.
bool boolean_value(const JsonFile& f, const Json& v, const std::string& path, const std::string& leaf);
/// Refuses the keys of `object` that the unsupported-keys table refuses (unless their value asks nothing).
void refuse_unsupported(const JsonFile& f, const Json& object, const std::string& path);
/// Rejects keys of `object` outside `valid`, naming the nearest valid key.
void check_keys(const JsonFile& f, const Json& object, const std::string& path,
                const std::vector<std::string>& valid);

// deepspeed_json_precision.cpp
void apply_mixed_precision(const JsonFile& f, const Json& root, const DeepSpeedJsonContext& context,
                           Config& c);
void apply_torch_autocast(const JsonFile& f, const Json& root, const DeepSpeedJsonContext& context,
                          Config& c);
void read_loss_scaler(const JsonFile& f, const Json& root, Config& c);

// deepspeed_json_zero.cpp
void apply_zero_optimization(const JsonFile& f, const Json& root, Config& c);

// deepspeed_trainer.cpp: the keys Hugging Face's Trainer fills or checks (Config::zero.trainer_keys), with
// the optimizer and scheduler blocks' types checked.
void read_trainer_keys(const JsonFile& f, const Json& root, Config& c);
bool supported_optimizer_type(const std::string& type);
bool supported_scheduler_type(const std::string& type);

}  // namespace accel::config_detail::ds_json
