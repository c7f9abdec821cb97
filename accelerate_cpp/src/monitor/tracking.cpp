// Built-in trackers (TensorBoard event files written natively, CSV, JSON lines) and the multi-process logger.
#include <accel/distributed/env_contract.hpp>
#include <accel/errors.hpp>
#include <accel/monitor/tracking.hpp>

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>

namespace accel {
namespace {

namespace fs = std::filesystem;

std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (const char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (c < 0x20)
          out += fmt::format("\\u{:04x}", c);
        else
          out += ch;
    }
  }
  return out + "\"";
}

std::string json_number(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "Infinity" : "-Infinity";
  return fmt::format("{}", v);
}

// A Markdown table cell: '|' escaped, line breaks as spaces.
std::string markdown_cell(const std::string& s) {
  std::string out;
  for (const char c : s) {
    if (c == '|')
      out += "\\|";
    else if (c == '\n' || c == '\r')
      out += ' ';
    else
      out += c;
  }
  return out;
}

// A CSV field: quoted when it holds a comma, quote or line break.
std::string csv_field(const std::string& s) {
  if (s.find_first_of(",\"\n\r") == std::string::npos) return s;
  std::string out = "\"";
  for (const char c : s)
    out += c == '"' ? std::string("\"\"") : std::string(1, c);
  return out + "\"";
}

std::ofstream open_for_append(const fs::path& path) {
  std::ofstream out(path, std::ios::app | std::ios::binary);
  if (!out) throw UsageError(fmt::format("tracking: cannot open '{}' for writing", path.string()));
  return out;
}

void check_written(const std::ofstream& out, const fs::path& path) {
  if (!out) throw UsageError(fmt::format("tracking: writing '{}' failed (disk full?)", path.string()));
}

// --- Protocol buffers, the few encodings an Event needs ----------------------------------------------------

void varint(std::string& out, std::uint64_t v) {
  while (v >= 0x80) {
    out += static_cast<char>((v & 0x7f) | 0x80);
    v >>= 7;
  }
  out += static_cast<char>(v);
}
void key(std::string& out, int field, int wire_type) {
  varint(out, (static_cast<std::uint64_t>(field) << 3) | static_cast<std::uint64_t>(wire_type));
}
void fixed(std::string& out, const void* bytes, std::size_t n) {  // little-endian hosts
  out.append(static_cast<const char*>(bytes), n);
}
void field_double(std::string& out, int field, double v) {
  key(out, field, 1);
  fixed(out, &v, 8);
}
void field_float(std::string& out, int field, float v) {
  key(out, field, 5);
  fixed(out, &v, 4);
}
void field_int(std::string& out, int field, std::int64_t v) {
  key(out, field, 0);
  varint(out, static_cast<std::uint64_t>(v));
}
void field_bytes(std::string& out, int field, const std::string& v) {
  key(out, field, 2);
  varint(out, v.size());
  out += v;
}

// tensorflow/core/util/event.proto: Event{wall_time = 1, step = 2, file_version = 3, summary = 5}.
std::string event(double wall_time, std::int64_t step) {
  std::string e;
  field_double(e, 1, wall_time);
  field_int(e, 2, step);
  return e;
}

// tensorflow/core/framework/summary.proto: Summary{repeated Value value = 1};
// Value{tag = 1, simple_value = 2, tensor = 8, metadata = 9}.
std::string scalar_value(const std::string& tag, double v) {
  std::string value;
  field_bytes(value, 1, tag);
  field_float(value, 2, static_cast<float>(v));
  return value;
}

// A text summary as TensorBoard's text plugin reads it: metadata.plugin_data.plugin_name = "text" and a
// scalar DT_STRING TensorProto{dtype = 1 (7), tensor_shape = 2 (empty: a scalar), string_val = 8}.
std::string text_value(const std::string& tag, const std::string& text) {
  std::string plugin_data;
  field_bytes(plugin_data, 1, "text");
  std::string metadata;
  field_bytes(metadata, 1, plugin_data);
  std::string tensor;
  field_int(tensor, 1, 7);  // DT_STRING
  field_bytes(tensor, 2, "");
  field_bytes(tensor, 8, text);
  std::string value;
  field_bytes(value, 1, tag);
  field_bytes(value, 8, tensor);
  field_bytes(value, 9, metadata);
  return value;
}

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// A file a tracker appends to: flushed after every write (a crash loses nothing logged), closed by finish().
class AppendFile {
 public:
  AppendFile(fs::path path, const char* tracker) : path_(std::move(path)), tracker_(tracker) {
    empty_ = !fs::exists(path_) || fs::file_size(path_) == 0;
    out_ = open_for_append(path_);
  }
  bool was_empty() const { return empty_; }
  void write(const std::string& text) {
    if (!out_.is_open()) throw UsageError(fmt::format("tracking: {}: log after end_training()", tracker_));
    out_ << text;
    out_.flush();
    check_written(out_, path_);
  }
  void close() {
    if (out_.is_open()) out_.close();
  }

 private:
  fs::path path_;
  const char* tracker_;
  bool empty_ = true;
  std::ofstream out_;
};

void write_whole_file(const fs::path& path, const std::string& text) {
  std::ofstream out(path, std::ios::trunc | std::ios::binary);
  out << text;
  out.flush();
  check_written(out, path);
}

// The name TensorBoard's loaders look for: events.out.tfevents.<time>.<host>.<pid>.<n>
fs::path event_file_name(const fs::path& dir) {
  std::array<char, 256> host{};
  if (gethostname(host.data(), host.size() - 1) != 0) std::strcpy(host.data(), "localhost");
  static int serial = 0;
  return dir / fmt::format("events.out.tfevents.{}.{}.{}.{}", static_cast<std::int64_t>(now_seconds()),
                           host.data(), ::getpid(), serial++);
}

class TensorBoardTracker final : public Tracker {
 public:
  explicit TensorBoardTracker(const fs::path& dir) : file_(event_file_name(dir), "tensorboard") {
    std::string first = event(now_seconds(), 0);
    field_bytes(first, 3, "brain.Event:2");
    file_.write(tfevents::record(first));
  }
  std::string name() const override { return "tensorboard"; }
  void store_init_configuration(const TrackerConfig& config) override {
    // The configuration as a Markdown table, which TensorBoard's text tab renders.
    std::string table = "| name | value |\n|---|---|\n";
    for (const auto& [k, v] : config)
      table += fmt::format("| {} | {} |\n", markdown_cell(k), markdown_cell(v.text()));
    std::string summary;
    field_bytes(summary, 1, text_value("hyperparameters", table));
    std::string e = event(now_seconds(), 0);
    field_bytes(e, 5, summary);
    file_.write(tfevents::record(e));
  }
  void log(const TrackerValues& values, std::int64_t step, double wall_time) override {
    std::string summary;
    for (const auto& [tag, v] : values)
      field_bytes(summary, 1, scalar_value(tag, v));
    std::string e = event(wall_time, step);
    field_bytes(e, 5, summary);
    file_.write(tfevents::record(e));
  }
  void finish() override { file_.close(); }

 private:
  AppendFile file_;
};

class CsvTracker final : public Tracker {
 public:
  explicit CsvTracker(const fs::path& dir) : dir_(dir), file_(dir / "metrics.csv", "csv") {
    if (file_.was_empty()) file_.write("step,name,value\n");
  }
  std::string name() const override { return "csv"; }
  void store_init_configuration(const TrackerConfig& config) override {
    std::string text = "name,value\n";
    for (const auto& [k, v] : config)
      text += csv_field(k) + ',' + csv_field(v.text()) + '\n';
    write_whole_file(dir_ / "hparams.csv", text);
  }
  void log(const TrackerValues& values, std::int64_t step, double) override {
    std::string text;
    for (const auto& [k, v] : values)
      text += fmt::format("{},{},{}\n", step, csv_field(k), json_number(v));
    file_.write(text);
  }
  void finish() override { file_.close(); }

 private:
  fs::path dir_;
  AppendFile file_;
};

class JsonlTracker final : public Tracker {
 public:
  explicit JsonlTracker(const fs::path& dir) : dir_(dir), file_(dir / "metrics.jsonl", "jsonl") {}
  std::string name() const override { return "jsonl"; }
  void store_init_configuration(const TrackerConfig& config) override {
    std::string text = "{";
    for (std::size_t i = 0; i < config.size(); ++i)
      text += (i ? ", " : "") + json_string(config[i].first) + ": " + config[i].second.json();
    write_whole_file(dir_ / "hparams.json", text + "}\n");
  }
  void log(const TrackerValues& values, std::int64_t step, double wall_time) override {
    for (const auto& [k, v] : values) {
      if (k == "step" || k == "_timestamp") {
        throw UsageError(
            fmt::format("tracking: jsonl: a value named '{}' would clash with the line's own "
                        "'{}' field; rename it",
                        k, k));
      }
    }
    std::string text = fmt::format("{{\"step\": {}", step);
    for (const auto& [k, v] : values)
      text += ", " + json_string(k) + ": " + json_number(v);
    file_.write(text + fmt::format(", \"_timestamp\": {:.3f}}}\n", wall_time));
  }
  void finish() override { file_.close(); }

 private:
  fs::path dir_;
  AppendFile file_;
};

std::optional<LogLevel> level_named(std::string name) {
  for (auto& c : name)
    c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (name == "debug") return LogLevel::Debug;
  if (name == "info") return LogLevel::Info;
  if (name == "warning" || name == "warn") return LogLevel::Warning;
  if (name == "error" || name == "critical") return LogLevel::Error;
  return std::nullopt;
}

const char* level_text(LogLevel level) {
  switch (level) {
    case LogLevel::Debug:
      return "DEBUG";
    case LogLevel::Info:
      return "INFO";
    case LogLevel::Warning:
      return "WARNING";
    case LogLevel::Error:
      return "ERROR";
  }
  return "INFO";
}

}  // namespace

std::string TrackerValue::text() const {
  return std::visit(
      [](const auto& v) -> std::string {
        using T = std::decay_t<decltype(v)>;
        if constexpr (std::is_same_v<T, bool>)
          return v ? "true" : "false";
        else if constexpr (std::is_same_v<T, std::string>)
          return v;
        else
          return fmt::format("{}", v);
      },
      value);
}

std::string TrackerValue::json() const {
  if (const auto* text = std::get_if<std::string>(&value)) return json_string(*text);
  if (const auto* number = std::get_if<double>(&value)) return json_number(*number);
  return this->text();  // true/false and integers are already JSON
}

std::vector<std::string> builtin_trackers() {
  return {"tensorboard", "csv", "jsonl"};
}

std::vector<std::string> parse_log_with(const std::string& log_with) {
  std::vector<std::string> names;
  std::size_t start = 0;
  while (start <= log_with.size()) {
    const auto comma = log_with.find(',', start);
    std::string name = log_with.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    name.erase(0, name.find_first_not_of(" \t"));
    name.erase(name.find_last_not_of(" \t") + 1);
    for (auto& c : name)
      c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    if (name == "all") {
      for (const auto& b : builtin_trackers())
        if (std::find(names.begin(), names.end(), b) == names.end()) names.push_back(b);
    } else if (!name.empty()) {
      const auto builtin = builtin_trackers();
      if (std::find(builtin.begin(), builtin.end(), name) == builtin.end()) {
        throw ConfigError(fmt::format(
            "log_with: unknown tracker '{}'; use tensorboard, csv, jsonl, all, or a comma-separated list "
            "of them (a tracker of your own goes to AcceleratorOptions().log_with(tracker))",
            name));
      }
      if (std::find(names.begin(), names.end(), name) == names.end()) names.push_back(name);
    }
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return names;
}

std::unique_ptr<Tracker> make_builtin_tracker(const std::string& name, const std::string& run_dir) {
  std::error_code ec;
  fs::create_directories(run_dir, ec);
  if (ec) {
    throw UsageError(
        fmt::format("tracking: cannot create the log directory '{}': {}", run_dir, ec.message()));
  }
  if (name == "tensorboard") return std::make_unique<TensorBoardTracker>(run_dir);
  if (name == "csv") return std::make_unique<CsvTracker>(run_dir);
  if (name == "jsonl") return std::make_unique<JsonlTracker>(run_dir);
  throw UsageError(
      fmt::format("tracking: no built-in tracker named '{}' (built in: tensorboard, csv, jsonl)", name));
}

namespace tfevents {

std::uint32_t crc32c(const void* data, std::size_t size) {
  static const auto table = [] {
    std::array<std::uint32_t, 256> t{};
    for (std::uint32_t i = 0; i < 256; ++i) {
      std::uint32_t c = i;
      for (int k = 0; k < 8; ++k)
        c = (c & 1) ? 0x82f63b78u ^ (c >> 1) : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  std::uint32_t crc = 0xffffffffu;
  const auto* p = static_cast<const unsigned char*>(data);
  for (std::size_t i = 0; i < size; ++i)
    crc = table[(crc ^ p[i]) & 0xff] ^ (crc >> 8);
  return crc ^ 0xffffffffu;
}

std::uint32_t masked_crc32c(const void* data, std::size_t size) {
  const std::uint32_t crc = crc32c(data, size);
  return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

std::string record(const std::string& data) {
  std::string out;
  const std::uint64_t length = data.size();
  fixed(out, &length, 8);
  const std::uint32_t length_crc = masked_crc32c(&length, 8);
  fixed(out, &length_crc, 4);
  out += data;
  const std::uint32_t data_crc = masked_crc32c(data.data(), data.size());
  fixed(out, &data_crc, 4);
  return out;
}

}  // namespace tfevents

Logger::Logger(std::string name, int rank, LogLevel threshold, bool prefix_rank)
    : name_(std::move(name)), rank_(rank), threshold_(threshold), prefix_rank_(prefix_rank) {}

std::optional<std::string> Logger::format(LogLevel level, std::string_view message,
                                          bool main_process_only) const {
  if (level < threshold_ || (main_process_only && rank_ != 0)) return std::nullopt;
  return fmt::format("{}{} {}: {}", prefix_rank_ ? fmt::format("[rank {}] ", rank_) : std::string(),
                     level_text(level), name_, message);
}

void Logger::log(LogLevel level, std::string_view message, bool main_process_only) const {
  if (const auto line = format(level, message, main_process_only)) std::cerr << *line << std::endl;
}
void Logger::debug(std::string_view message, bool main_process_only) const {
  log(LogLevel::Debug, message, main_process_only);
}
void Logger::info(std::string_view message, bool main_process_only) const {
  log(LogLevel::Info, message, main_process_only);
}
void Logger::warning(std::string_view message, bool main_process_only) const {
  log(LogLevel::Warning, message, main_process_only);
}
void Logger::error(std::string_view message, bool main_process_only) const {
  log(LogLevel::Error, message, main_process_only);
}

Logger get_logger(const std::string& name, std::optional<LogLevel> level) {
  if (!level) {
    for (const char* variable : {"ACCEL_LOG_LEVEL", "ACCELERATE_LOG_LEVEL"}) {
      const char* value = std::getenv(variable);
      if (value == nullptr || *value == '\0') continue;
      level = level_named(value);
      if (!level) {
        throw ConfigError(fmt::format("{}='{}': expected debug, info, warning or error", variable, value));
      }
      break;
    }
  }
  const char* rank = std::getenv(env::kRank);
  const char* launched = std::getenv(env::kLaunched);
  return Logger(name, rank != nullptr && *rank != '\0' ? std::atoi(rank) : 0, level.value_or(LogLevel::Info),
                launched == nullptr || std::string(launched) != "1");
}

}  // namespace accel
