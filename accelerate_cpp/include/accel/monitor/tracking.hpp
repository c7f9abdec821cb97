#pragma once
/// \file tracking.hpp
/// Experiment tracking as Hugging Face Accelerate does it: `log_with` names the trackers, the main process
/// alone writes, and every tracker gets the run configuration once (`init_trackers`) and then named scalar
/// values per step (`log`). Built in, with no Python or protobuf dependency:
///  - `tensorboard`: TensorBoard event files (`events.out.tfevents.*`, the TFRecord format of length, masked
///    CRC-32C and serialized `Event` protos with scalar summaries; the configuration as a text summary);
///  - `csv`: `metrics.csv` (`step,name,value`, one row per value) and `hparams.csv`;
///  - `jsonl`: `metrics.jsonl` (one JSON object per `log` call, with `step`) and `hparams.json`.
/// A program adds its own tracker (Weights & Biases through its C API, a database ...) by implementing
/// `Tracker` and passing it to `AcceleratorOptions().log_with(...)`.
///
/// Also here: `get_logger`, a logger that prints on the main process only unless asked otherwise, with the
/// rank in front (left to accel-launch, which prefixes every line already, when it started the process).
/// Torch-free.

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

namespace accel {

/// One value of the run configuration given to `init_trackers` (number, flag or text).
struct TrackerValue {
  std::variant<bool, std::int64_t, double, std::string> value;

  TrackerValue(bool v) : value(v) {}
  TrackerValue(const char* v) : value(std::string(v)) {}
  TrackerValue(std::string v) : value(std::move(v)) {}
  template <class T, std::enable_if_t<std::is_integral_v<T> && !std::is_same_v<T, bool>, int> = 0>
  TrackerValue(T v) : value(static_cast<std::int64_t>(v)) {}
  template <class T, std::enable_if_t<std::is_floating_point_v<T>, int> = 0>
  TrackerValue(T v) : value(static_cast<double>(v)) {}

  /// The value as text: `true`/`false`, the integer, the shortest exact decimal of the number, the string.
  std::string text() const;
  /// The value as JSON: a string is quoted and escaped; a non-finite number is written as Python's json
  /// module writes it (NaN, Infinity, -Infinity).
  std::string json() const;
};

/// The run configuration given to `init_trackers`, in the order given.
using TrackerConfig = std::vector<std::pair<std::string, TrackerValue>>;
/// Named scalars given to `log`, in the order given.
using TrackerValues = std::vector<std::pair<std::string, double>>;

/// Where logged values go. Called on the main process only, by `Accelerator::init_trackers`, `log` and
/// `end_training`.
class Tracker {
 public:
  virtual ~Tracker() = default;
  /// The name `get_tracker` finds it by ("tensorboard", "csv", "jsonl", or the program's own).
  virtual std::string name() const = 0;
  /// Called once, before the first `log`.
  virtual void store_init_configuration(const TrackerConfig& config) = 0;
  /// Values of one step. `wall_time` is seconds since the Unix epoch.
  virtual void log(const TrackerValues& values, std::int64_t step, double wall_time) = 0;
  /// Flushes and closes; called by `end_training` and when the accelerator is destroyed. Logging after it is
  /// an error of the caller.
  virtual void finish() {}
};

/// The built-in trackers' names: "tensorboard", "csv", "jsonl".
std::vector<std::string> builtin_trackers();
/// `log_with` as given in AcceleratorOptions, the YAML key or `accel-launch --log_with`: "" (none), a name,
/// "all" (every built-in tracker), or a comma-separated list; returns the names. Throws ConfigError naming
/// the unknown name and the valid ones.
std::vector<std::string> parse_log_with(const std::string& log_with);
/// A built-in tracker writing into `run_dir` (created if needed). Throws UsageError for an unknown name.
std::unique_ptr<Tracker> make_builtin_tracker(const std::string& name, const std::string& run_dir);

namespace tfevents {
/// CRC-32C (Castagnoli), as TFRecord files use it.
std::uint32_t crc32c(const void* data, std::size_t size);
/// TFRecord's masked CRC: ((crc >> 15) | (crc << 17)) + 0xa282ead8.
std::uint32_t masked_crc32c(const void* data, std::size_t size);
/// One TFRecord: length (uint64 LE), masked CRC of the length, the data, masked CRC of the data.
std::string record(const std::string& data);
}  // namespace tfevents

/// Severity of a Logger message; `ACCEL_LOG_LEVEL` (or Accelerate's `ACCELERATE_LOG_LEVEL`) = debug | info |
/// warning | error sets the threshold (default info).
enum class LogLevel { Debug, Info, Warning, Error };

/// Accelerate's `get_logger` (MultiProcessAdapter): messages go to standard error as
/// `[rank R] LEVEL name: message`, by default on the main process only; pass `main_process_only = false` to
/// print on every rank. The rank prefix is left out when accel-launch started the process (it prefixes each
/// line with the rank already).
class Logger {
 public:
  Logger(std::string name, int rank, LogLevel threshold, bool prefix_rank);
  void debug(std::string_view message, bool main_process_only = true) const;
  void info(std::string_view message, bool main_process_only = true) const;
  void warning(std::string_view message, bool main_process_only = true) const;
  void error(std::string_view message, bool main_process_only = true) const;
  void log(LogLevel level, std::string_view message, bool main_process_only = true) const;
  /// The line `log` prints (without the newline), or nullopt when it prints nothing on this rank.
  std::optional<std::string> format(LogLevel level, std::string_view message, bool main_process_only) const;

 private:
  std::string name_;
  int rank_;
  LogLevel threshold_;
  bool prefix_rank_;
};

/// A logger for this process: the rank from `RANK` (0 when unset), the threshold from `level` or else from
/// `ACCEL_LOG_LEVEL` / `ACCELERATE_LOG_LEVEL`. Throws ConfigError for an unknown level name.
Logger get_logger(const std::string& name, std::optional<LogLevel> level = std::nullopt);

}  // namespace accel
