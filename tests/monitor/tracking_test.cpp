// Trackers and logger (torch-free): the TFRecord framing, csv and jsonl files, log_with parsing, the logger's
// filtering. TensorBoard's own reader checks the event files in the distributed `tracking` scenario.
#include <catch2/catch.hpp>

#include "accel/config/config.hpp"
#include "accel/errors.hpp"
#include "accel/monitor/progress.hpp"
#include "accel/monitor/tracking.hpp"

#include <algorithm>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <unistd.h>

namespace fs = std::filesystem;
using namespace accel;

namespace {

// A path for a tracker to create (not created here), removed at scope exit.
struct NewPath {
  fs::path path;
  NewPath() {
    path = fs::temp_directory_path() /
           ("accel-tracking-" + std::to_string(::getpid()) + "-" + std::to_string(counter()++));
    fs::remove_all(path);
  }
  ~NewPath() { fs::remove_all(path); }
  static int& counter() {
    static int n = 0;
    return n;
  }
};

std::string read_all(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

}  // namespace

TEST_CASE("tracking: CRC-32C and TFRecord framing as TensorFlow writes them") {
  // The check value of CRC-32C (RFC 3720, iSCSI) and TensorFlow's masking.
  CHECK(tfevents::crc32c("123456789", 9) == 0xE3069283u);
  CHECK(tfevents::crc32c("", 0) == 0u);
  const std::uint32_t crc = 0xE3069283u;
  CHECK(tfevents::masked_crc32c("123456789", 9) == ((crc >> 15) | (crc << 17)) + 0xa282ead8u);
  const std::string r = tfevents::record("abc");
  REQUIRE(r.size() == 8 + 4 + 3 + 4);
  std::uint64_t length = 0;
  std::memcpy(&length, r.data(), 8);
  CHECK(length == 3);
  std::uint32_t length_crc = 0, data_crc = 0;
  std::memcpy(&length_crc, r.data() + 8, 4);
  std::memcpy(&data_crc, r.data() + 15, 4);
  CHECK(length_crc == tfevents::masked_crc32c(r.data(), 8));
  CHECK(r.substr(12, 3) == "abc");
  CHECK(data_crc == tfevents::masked_crc32c("abc", 3));
}

TEST_CASE("tracking: csv and jsonl trackers write exactly the logged values") {
  NewPath dir;
  auto csv = make_builtin_tracker("csv", dir.path.string());
  auto jsonl = make_builtin_tracker("jsonl", dir.path.string());
  const TrackerConfig config{{"lr", 0.001}, {"epochs", 3}, {"name", "a \"b\", c"}, {"amp", true}};
  csv->store_init_configuration(config);
  jsonl->store_init_configuration(config);
  csv->log({{"loss", 0.1}, {"acc", 1.0 / 3}}, 1, 1700000000.25);
  jsonl->log({{"loss", 0.1}, {"acc", 1.0 / 3}}, 1, 1700000000.25);
  csv->finish();
  jsonl->finish();
  CHECK(read_all(dir.path / "metrics.csv") == "step,name,value\n1,loss,0.1\n1,acc,0.3333333333333333\n");
  CHECK(read_all(dir.path / "hparams.csv") ==
        "name,value\nlr,0.001\nepochs,3\nname,\"a \"\"b\"\", c\"\namp,true\n");
  CHECK(read_all(dir.path / "metrics.jsonl") ==
        "{\"step\": 1, \"loss\": 0.1, \"acc\": 0.3333333333333333, \"_timestamp\": 1700000000.250}\n");
  CHECK(read_all(dir.path / "hparams.json") ==
        "{\"lr\": 0.001, \"epochs\": 3, \"name\": \"a \\\"b\\\", c\", \"amp\": true}\n");
  CHECK_THROWS_AS(csv->log({{"loss", 1}}, 2, 0), UsageError);  // after finish
  auto clash = make_builtin_tracker("jsonl", (dir.path / "clash").string());
  CHECK_THROWS_WITH(clash->log({{"step", 1.0}}, 1, 0), Catch::Contains("'step' would clash"));

  // Appending run: a second csv tracker on the same directory keeps the rows and writes no second header.
  auto again = make_builtin_tracker("csv", dir.path.string());
  again->log({{"loss", 0.05}}, 2, 0);
  again->finish();
  CHECK(read_all(dir.path / "metrics.csv") ==
        "step,name,value\n1,loss,0.1\n1,acc,0.3333333333333333\n2,loss,0.05\n");
}

TEST_CASE("tracking: a TensorBoard event file starts with the file version and holds one record per call") {
  NewPath dir;
  auto tb = make_builtin_tracker("tensorboard", dir.path.string());
  tb->store_init_configuration({{"lr", 0.5}, {"note", "a|b\nc"}});
  tb->log({{"loss", 2.0}}, 7, 1.5);
  tb->finish();
  std::vector<fs::path> files;
  for (const auto& e : fs::directory_iterator(dir.path))
    files.push_back(e.path());
  REQUIRE(files.size() == 1);
  CHECK(files[0].filename().string().rfind("events.out.tfevents.", 0) == 0);
  const std::string bytes = read_all(files[0]);
  // Walk the records, checking each one's CRCs.
  std::size_t at = 0;
  std::vector<std::string> records;
  while (at < bytes.size()) {
    REQUIRE(at + 12 <= bytes.size());
    std::uint64_t length = 0;
    std::memcpy(&length, bytes.data() + at, 8);
    REQUIRE(at + 16 + length <= bytes.size());
    const std::string data = bytes.substr(at + 12, length);
    std::uint32_t crc = 0;
    std::memcpy(&crc, bytes.data() + at + 12 + length, 4);
    CHECK(crc == tfevents::masked_crc32c(data.data(), data.size()));
    records.push_back(data);
    at += 16 + length;
  }
  REQUIRE(records.size() == 3);  // file version, hyperparameters, one log call
  CHECK(records[0].find("brain.Event:2") != std::string::npos);
  CHECK(records[1].find("| lr | 0.5 |") != std::string::npos);
  CHECK(records[1].find("| note | a\\|b c |") != std::string::npos);  // a cell cannot break the table
  CHECK(records[2].find("loss") != std::string::npos);
}

TEST_CASE("tracking: log_with names, the YAML key and the logger") {
  CHECK(parse_log_with("").empty());
  CHECK(parse_log_with("all") == std::vector<std::string>{"tensorboard", "csv", "jsonl"});
  CHECK(parse_log_with(" TensorBoard , csv,tensorboard") == std::vector<std::string>{"tensorboard", "csv"});
  CHECK_THROWS_WITH(parse_log_with("tensorboard,wandb"), Catch::Contains("unknown tracker 'wandb'") &&
                                                             Catch::Contains("tensorboard, csv, jsonl, all"));

  const Config c = Config::load_string("log_with: tensorboard,jsonl\n", "t.yaml");
  CHECK(c.log_with == "tensorboard,jsonl");
  CHECK(Config::load_string(c.to_yaml()) == c);
  CHECK_THROWS_WITH(Config::load_string("log_with: wandb\n", "t.yaml"),
                    Catch::Contains("t.yaml:1") && Catch::Contains("unknown tracker 'wandb'"));

  const Logger main("train", 0, LogLevel::Info, true);
  const Logger other("train", 1, LogLevel::Info, true);
  CHECK(main.format(LogLevel::Info, "epoch 1", true) ==
        std::optional<std::string>("[rank 0] INFO train: epoch 1"));
  CHECK_FALSE(other.format(LogLevel::Info, "epoch 1", true).has_value());  // main process only
  CHECK(other.format(LogLevel::Warning, "slow", false) ==
        std::optional<std::string>("[rank 1] WARNING train: slow"));
  CHECK_FALSE(main.format(LogLevel::Debug, "details", true).has_value());  // below the threshold
  const Logger launched("train", 1, LogLevel::Debug, false);
  CHECK(launched.format(LogLevel::Debug, "x", false) == std::optional<std::string>("DEBUG train: x"));

  ::setenv("ACCEL_LOG_LEVEL", "loud", 1);
  CHECK_THROWS_WITH(get_logger("t"), Catch::Contains("ACCEL_LOG_LEVEL='loud'"));
  ::setenv("ACCEL_LOG_LEVEL", "warning", 1);
  CHECK_FALSE(get_logger("t").format(LogLevel::Info, "x", false).has_value());
  ::unsetenv("ACCEL_LOG_LEVEL");
}

TEST_CASE("progress bar: rendering, lines at most every interval, in-place redraws, silent off rank 0") {
  CHECK(ProgressBar::render("epoch 0", 420, 1000, 3.0, "batches", "loss 0.3141") ==
        "epoch 0:  42%|########            | 420/1000 [00:03<00:04, 140.00 batches/s] loss 0.3141");
  CHECK(ProgressBar::render("", 0, 10, 0.0, "it", "") ==
        "  0%|                    | 0/10 [00:00<?, 0.00 it/s]");
  CHECK(ProgressBar::render("eval", 7, 0, 3725.0, "samples", "") == "eval: 7 [1:02:05, 0.00 samples/s]");

  double now = 100;
  auto clock = [&now] { return now; };
  {
    std::ostringstream out;
    ProgressOptions o;
    o.mode = ProgressMode::Lines;
    o.rank = 0;
    o.unit = "batches";
    ProgressBar bar(10, o, out, clock);
    for (int i = 0; i < 10; ++i) {
      now += 1.5;  // a line at most every 5 s: after 1.5 s (first), 6 s, 10.5 s, then the final one
      bar.update();
    }
    bar.set_postfix("loss 1");
    bar.close();
    bar.close();  // once
    const std::string text = out.str();
    CHECK(std::count(text.begin(), text.end(), '\n') == 4);
    INFO(text);
    CHECK(text.find(" 10%|##") == 0);
    CHECK(text.find("100%|####################| 10/10 [00:15<00:00, 0.67 batches/s] loss 1\n") !=
          std::string::npos);
  }
  {
    std::ostringstream out;
    ProgressOptions o;
    o.mode = ProgressMode::Terminal;
    o.rank = 0;
    ProgressBar bar(3, o, out, clock);
    now += 1;
    bar.update();
    now += 1;
    bar.update(2);
    bar.close();
    const std::string text = out.str();
    CHECK(std::count(text.begin(), text.end(), '\r') == 3);  // two updates and the final draw
    CHECK(std::count(text.begin(), text.end(), '\n') == 1);
  }
  {
    std::ostringstream out;
    ProgressOptions o;
    o.mode = ProgressMode::Lines;
    o.rank = 1;  // only the main process draws
    ProgressBar bar(3, o, out, clock);
    bar.update(3);
    bar.close();
    CHECK(bar.mode() == ProgressMode::Off);
    CHECK(out.str().empty());
  }
  // Not a terminal (this test's standard error is a file or a pipe under ctest) and no launcher console.
  ::unsetenv("ACCEL_CONSOLE_TTY");
  if (!::isatty(2)) CHECK(ProgressBar(5).mode() == ProgressMode::Off);
  ::setenv("ACCEL_CONSOLE_TTY", "1", 1);
  if (!::isatty(2)) CHECK(ProgressBar(5).mode() == ProgressMode::Lines);
  ::unsetenv("ACCEL_CONSOLE_TTY");
}
