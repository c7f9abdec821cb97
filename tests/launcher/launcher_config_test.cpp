// Tests of `accel-launch config`: the questionnaire driven through streams, `config default` through the
// CLI11 app, and (tag [binary]) the real accel-launch binary with answers piped on stdin.

#include <catch2/catch.hpp>
#include "build_paths.hpp"

#include <sys/wait.h>
#include <unistd.h>
#include <CLI/CLI.hpp>

#include <accel/config/config.hpp>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <sstream>
#include <string>

#include "../../launcher/commands.hpp"
#include "../../launcher/questionnaire.hpp"

namespace {

using accel::Config;
using accel::MixedPrecision;
using accel::launcher::QuestionnaireOptions;
using accel::launcher::run_questionnaire;

// A fresh directory under the system temp dir, removed at scope exit.
struct ScratchDir {
  ScratchDir() {
    std::string pattern = (std::filesystem::temp_directory_path() / "accel_config_cmd_XXXXXX").string();
    if (::mkdtemp(pattern.data()) == nullptr) FAIL("mkdtemp failed for " << pattern);
    path = pattern;
  }
  ~ScratchDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  std::string file(const std::string& name) const { return (path / name).string(); }
  std::filesystem::path path;
};

// Redirects std::cout into a string for the lifetime of the object.
struct CaptureCout {
  CaptureCout() : old(std::cout.rdbuf(buffer.rdbuf())) {}
  ~CaptureCout() { std::cout.rdbuf(old); }
  std::string text() const { return buffer.str(); }
  std::ostringstream buffer;
  std::streambuf* old;
};

struct Session {
  Config config;
  std::string output;
};

Session answer(const std::string& answers, QuestionnaireOptions options = {}) {
  std::istringstream in(answers);
  std::ostringstream out;
  Session session;
  session.config = run_questionnaire(in, out, options);
  session.output = out.str();
  return session;
}

size_t count(const std::string& text, const std::string& needle) {
  size_t n = 0;
  for (size_t pos = text.find(needle); pos != std::string::npos; pos = text.find(needle, pos + 1))
    ++n;
  return n;
}

// The YAML written for `config` must load back into an equal Config.
void require_round_trip(const Config& config) {
  ScratchDir dir;
  const std::string path = dir.file("sub/config.yaml");
  config.save_file(path);
  const Config loaded = Config::load_file(path);
  REQUIRE(loaded == config);
}

// Runs a shell command, returns its exit status and combined output.
int run_shell(const std::string& command, std::string& output) {
  FILE* pipe = ::popen((command + " 2>&1").c_str(), "r");
  REQUIRE(pipe != nullptr);
  char buffer[4096];
  output.clear();
  while (size_t n = std::fread(buffer, 1, sizeof buffer, pipe))
    output.append(buffer, n);
  const int status = ::pclose(pipe);
  REQUIRE(WIFEXITED(status));
  return WEXITSTATUS(status);
}

std::string launcher_binary() {
  const std::string& bin = accel::test::launch_bin();
  INFO("accel-launch of this build: " << bin);
  REQUIRE(std::filesystem::exists(bin));
  return bin;
}

}  // namespace

TEST_CASE("config command: all defaults give the default Config", "[config_command]") {
  // compute environment, backend, CPU only, accumulation, mixed precision: the local backend asks no more.
  const Session session = answer("\n\n\n\n\n");
  CHECK(session.config == Config{});
  CHECK(session.output.find("Enter 0-3 or a name [local]: local (default)\n") != std::string::npos);
  CHECK(session.output.find("How many processes") == std::string::npos);
  CHECK(session.output.find("end of input") == std::string::npos);
  require_round_trip(session.config);

  SECTION("empty stdin takes every default and says so") {
    const Session empty = answer("");
    CHECK(empty.config == Config{});
    CHECK(count(empty.output, "(default: end of input)") == 5);
  }
}

TEST_CASE("config command: DDP with 2 processes, bf16, accumulation 4", "[config_command]") {
  const Session session = answer("0\nddp\n\n2\n4\nbf16\n\n");
  Config expected;
  expected.backend = "ddp";
  expected.num_processes = 2;
  expected.gradient_accumulation_steps = 4;
  expected.mixed_precision = MixedPrecision::Bf16;
  CHECK(session.config == expected);
  require_round_trip(session.config);
}

TEST_CASE("config command: ZeRO stage 3 with CPU offload", "[config_command]") {
  const Session session = answer("\nzero\nyes\n4\n3\ncpu\ncpu\nyes\n\nfp16\nyes\n");
  Config expected;
  expected.backend = "zero";
  expected.use_cpu = true;
  expected.num_processes = 4;
  expected.zero.stage = 3;
  expected.zero.offload_optimizer_device = accel::OffloadDevice::Cpu;
  expected.zero.offload_param_device = accel::OffloadDevice::Cpu;
  expected.zero.activation_checkpointing = true;
  expected.mixed_precision = MixedPrecision::Fp16;
  expected.debug = true;
  CHECK(session.config == expected);
  require_round_trip(session.config);

  SECTION("stage 0 skips the offload questions") {
    const Session stage0 = answer("\nzero\n\n\n0\n\n\n\n\n");
    CHECK(stage0.config.zero.stage == 0);
    CHECK(stage0.output.find("offloaded") == std::string::npos);
  }
  SECTION("nvme asks for the directory of the optimizer state's files") {
    const Session nvme = answer("\nzero\n\n\n\nnvme\n/scratch/nvme\n\n\n\n\n");
    CHECK(nvme.config.zero.offload_optimizer_device == accel::OffloadDevice::Nvme);
    CHECK(nvme.config.zero.offload_optimizer_nvme_path == "/scratch/nvme");
    CHECK(nvme.output.find("Which directory should hold the optimizer state's files") != std::string::npos);
    require_round_trip(nvme.config);
  }
  SECTION("stage 2 asks for optimizer offload only") {
    const Session stage2 = answer("\nzero\n\n\n\ncpu\n\n\n\n\n");
    CHECK(stage2.config.zero.stage == 2);
    CHECK(stage2.config.zero.offload_optimizer_device == accel::OffloadDevice::Cpu);
    CHECK(stage2.output.find("Where should the parameters be offloaded?") == std::string::npos);
  }
}

TEST_CASE("config command: FSDP with SHARD_GRAD_OP", "[config_command]") {
  const Session session = answer("\nfsdp\n\n\nSHARD_GRAD_OP\nsize_based_wrap\n1000000\nyes\nno\n2\n\n\n");
  Config expected;
  expected.backend = "fsdp";
  expected.num_processes = 2;
  expected.fsdp.sharding_strategy = accel::ShardingStrategy::ShardGradOp;
  expected.fsdp.auto_wrap_policy = accel::AutoWrapPolicy::SizeBasedWrap;
  expected.fsdp.min_num_params = 1000000;
  expected.fsdp.offload_params = true;
  expected.gradient_accumulation_steps = 2;
  CHECK(session.config == expected);
  require_round_trip(session.config);

  SECTION("transformer-based wrap asks for the module names unless the model's block type is to decide") {
    const Session transformer = answer("\nfsdp\n\n\n\n0\nno\nBlock,Attention\n\nyes\n\n\n\n");
    CHECK(transformer.config.fsdp.auto_wrap_policy == accel::AutoWrapPolicy::TransformerBasedWrap);
    CHECK(transformer.config.fsdp.transformer_layer_cls_to_wrap == "Block,Attention");
    CHECK(transformer.config.fsdp.activation_checkpointing);
    require_round_trip(transformer.config);
  }
}

TEST_CASE("config command: multi-machine", "[config_command]") {
  const Session session = answer("multi-machine\n2\n1\n10.1.2.3\n29600\n\n\n8\n\n\n\n");
  Config expected;
  expected.num_machines = 2;
  expected.machine_rank = 1;
  expected.main_process_ip = "10.1.2.3";
  expected.main_process_port = 29600;
  expected.backend = "ddp";  // the default backend on several machines
  expected.num_processes = 8;
  CHECK(session.config == expected);
  CHECK(session.output.find("Enter 0-3 or a name [ddp]: ddp (default)") != std::string::npos);
  CHECK(session.output.find("How many processes will you use in total (across all machines)? [4]: 8") !=
        std::string::npos);
  require_round_trip(session.config);
}

TEST_CASE("config command: pipeline parallelism", "[config_command]") {
  // environment, backend, CPU only, processes, accumulation, mixed precision, debug, then the pipeline.
  const Session session = answer("\nddp\n\n4\n2\n\n\nyes\n2\n8\ngpipe\n0,3,6\n");
  Config expected;
  expected.backend = "ddp";
  expected.num_processes = 4;
  expected.gradient_accumulation_steps = 2;
  expected.pipeline.stages = 2;  // 2 data-parallel replicas of each stage
  expected.pipeline.micro_batches = 8;
  expected.pipeline.schedule = accel::pipeline::Schedule::GPipe;
  expected.pipeline.partition = "0,3,6";
  CHECK(session.config == expected);
  CHECK(session.output.find(
            "How many micro-batches is each batch cut into (the batch's row count must be a "
            "multiple; with M micro-batches each stage idles (stages - 1) / (M + stages - 1) of "
            "a step; 0: gradient_accumulation_steps, here 2)? [8]: 8") != std::string::npos);
  require_round_trip(session.config);
  ScratchDir dir;
  session.config.save_file(dir.file("pipeline.yaml"));
  std::ifstream written(dir.file("pipeline.yaml"));
  const std::string yaml((std::istreambuf_iterator<char>(written)), std::istreambuf_iterator<char>());
  CHECK(yaml.find("pipeline_config:\n  stages: 2\n  micro_batches: 8\n  schedule: gpipe\n  partition: "
                  "'0,3,6'\n") != std::string::npos);

  SECTION("the defaults: one stage per process, 1F1B, balanced by parameters") {
    const Session defaults = answer("\nddp\n\n2\n\n\n\ny\n");
    Config two;
    two.backend = "ddp";
    two.num_processes = 2;
    two.pipeline.stages = 2;
    // 4 micro-batches per stage: each stage idles 1/9 of a step, not half of it as with one micro-batch.
    two.pipeline.micro_batches = 8;
    CHECK(defaults.config == two);
    CHECK(defaults.output.find("How many pipeline stages (num_processes must be a multiple: num_processes / "
                               "stages data-parallel replicas of each stage)? [2]: 2 (default") !=
          std::string::npos);
    require_round_trip(defaults.config);
  }
  SECTION("no pipeline: the section stays out of the YAML") {
    const Session no = answer("\nddp\n\n2\n\n\n\n\n");
    CHECK(no.config.pipeline == accel::PipelineConfig{});
    CHECK(no.output.find("How many pipeline stages") == std::string::npos);
  }
  SECTION("one process is not asked") {
    const Session one = answer("\nddp\n\n1\n\n\n\n");
    CHECK(one.output.find("pipeline parallelism") == std::string::npos);
  }
  SECTION("'balanced' is the parameters partition") {
    const Session balanced = answer("\nddp\n\n2\n\n\n\nyes\n\n\n\nbalanced\n");
    CHECK(balanced.config.pipeline.partition == "parameters");
    CHECK(balanced.config.pipeline.schedule == accel::pipeline::Schedule::OneFOneB);
  }
  SECTION("bad answers are explained and asked again") {
    const Session bad = answer(
        "\nddp\n\n6\n\n\n\nyes\n"
        "4\n"        // does not divide 6
        "1\n"        // a pipeline has at least 2 stages
        "7\n"        // more stages than processes
        "3\n"        //
        "-1\n"       // micro-batches
        "\n"         //
        "zigzag\n"   // no such schedule
        "1f1b\n"     //
        "0,3\n"      // 2 boundaries for 3 stages
        "1,2,3,4\n"  // does not start at 0
        "0,2,2,5\n"  // stage 1 empty
        "layers\n"   // not a partition (4 bad answers: a fifth would end the session)
        "0,2,4,6\n"  //
    );
    const std::string& out = bad.output;
    CHECK(out.find("Error: 6 processes do not split into 4 stages: the number of stages must divide "
                   "num_processes (6)\n") != std::string::npos);
    CHECK(out.find("Error: 1 is out of range: enter a number from 2 to 6\n") != std::string::npos);
    CHECK(out.find("Error: 7 is out of range: enter a number from 2 to 6\n") != std::string::npos);
    CHECK(out.find("Error: -1 is too small: enter a number of at least 0\n") != std::string::npos);
    CHECK(out.find("Error: 'zigzag' is not one of the choices: enter a number from 0 to 1 or one of 1f1b, "
                   "gpipe\n") != std::string::npos);
    // The model is not known yet: no layer count is claimed from the typed values.
    CHECK(
        out.find("Error: pipeline: partition 0,3 has 2 boundaries; 3 stages need 4: 0, then where each stage "
                 "ends (the last is the model's layer count)\n") != std::string::npos);
    CHECK(out.find("Error: pipeline: partition 1,2,3,4 must start at 0, the first layer\n") !=
          std::string::npos);
    CHECK(
        out.find("Error: pipeline: partition 0,2,2,5 leaves stage 1 without layers; boundaries must increase "
                 "strictly\n") != std::string::npos);
    CHECK(out.find("Error: pipeline: partition 'layers' is not parameters, uniform, type:<regex> or "
                   "comma-separated layer boundaries such as 0,3,6\n") != std::string::npos);
    CHECK(count(out, "is not parameters, uniform, type:<regex>") == 1);
    CHECK(bad.config.pipeline.stages == 3);
    CHECK(bad.config.pipeline.micro_batches == 12);  // the default, 4 x 3 stages
    CHECK(bad.config.pipeline.partition == "0,2,4,6");
    require_round_trip(bad.config);
  }
  SECTION("a backend that shards gradients is refused with the reason") {
    // zero: environment, backend, CPU only, processes, stage 2, offload optimizer, activation checkpointing,
    // accumulation, mixed precision, debug.
    const Session zero = answer("\nzero\n\n\n\n\n\n\n\n\nyes\nno\n");
    CHECK(zero.output.find("Error: backend zero (zero_stage 2) shards gradients or parameters, which a "
                           "pipeline refuses") != std::string::npos);
    CHECK(zero.output.find("run accel-launch config again with backend: ddp, fsdp with "
                           "fsdp_sharding_strategy: NO_SHARD, or zero with zero_stage: 0 or 1") !=
          std::string::npos);
    CHECK(zero.config.pipeline.stages == 1);
  }
}

TEST_CASE("config command: bad answers are explained and asked again", "[config_command]") {
  const Session session = answer(
      "2\n"            // no such compute environment
      "0\n"            //
      "foo\n"          // no such backend
      "ddp\n"          //
      "maybe\n"        // not a yes/no
      "\n"             //
      "abc\n"          // not a number
      "0\n"            // too small
      "3\n"            //
      "0\n"            // accumulation too small
      "99999999999\n"  // too large
      "4\n"            //
      "fp8\n"          // no such precision
      "bf16\n"
      "\n");
  const std::string& out = session.output;
  CHECK(out.find("Error: '2' is not one of the choices: enter a number from 0 to 1 or one of This machine, "
                 "Multi-machine\n") != std::string::npos);
  CHECK(out.find("Error: 'foo' is not one of the choices: enter a number from 0 to 3 or one of local, ddp, "
                 "fsdp, zero\n") != std::string::npos);
  CHECK(out.find("Error: 'maybe' is not yes or no\n") != std::string::npos);
  CHECK(out.find("Error: 'abc' is not a whole number\n") != std::string::npos);
  CHECK(out.find("Error: 0 is too small: enter a number of at least 1\n") != std::string::npos);
  CHECK(out.find("Error: '99999999999' is too large\n") != std::string::npos);
  CHECK(out.find("Error: 'fp8' is not one of the choices: enter a number from 0 to 2 or one of no, fp16, "
                 "bf16\n") != std::string::npos);
  // The same question is asked again (and the list of choices is not repeated).
  CHECK(count(out, "Enter 0-3 or a name [local]: ") == 2);
  CHECK(count(out, "How many processes will you use? [2]: ") == 3);
  CHECK(count(out, "How many gradient accumulation steps do you want? [1]: ") == 3);
  CHECK(count(out, "  3) zero") == 1);

  Config expected;
  expected.backend = "ddp";
  expected.num_processes = 3;
  expected.gradient_accumulation_steps = 4;
  expected.mixed_precision = MixedPrecision::Bf16;
  CHECK(session.config == expected);

  SECTION("answers that contradict earlier ones are rejected with the reason") {
    const Session multi = answer("1\n2\n0\nhost-0\n\nlocal\nddp\n\n3\n4\n\n\n\n");
    CHECK(multi.output.find(
              "Error: local runs a single process; training on 2 machines needs ddp, fsdp or zero\n") !=
          std::string::npos);
    CHECK(
        multi.output.find("Error: 3 is not a multiple of the number of machines (2): every machine runs the "
                          "same number of processes\n") != std::string::npos);
    CHECK(multi.config.num_processes == 4);
    CHECK(multi.config.main_process_ip == "host-0");
  }
  SECTION("a question without a default does not accept an empty answer") {
    const Session multi = answer("1\n\n\n\n10.0.0.1\n");
    CHECK(multi.output.find("Error: this question has no default: type an answer\n") != std::string::npos);
    CHECK(multi.config.main_process_ip == "10.0.0.1");
  }
}

TEST_CASE("config command: too many bad answers is a ConfigError naming the question", "[config_command]") {
  REQUIRE_THROWS_MATCHES(
      answer("0\nx\nx\nx\nx\nx\nddp\n"), accel::ConfigError,
      Catch::Message(
          "no valid answer for 'Which type of distributed training do you want?' after 5 attempts; "
          "the last one was rejected because 'x' is not one of the choices: enter a number from 0 "
          "to 3 or one of local, ddp, fsdp, zero"));

  QuestionnaireOptions patient;
  patient.max_attempts = 0;  // unlimited, as on a terminal
  CHECK(answer("0\nx\nx\nx\nx\nx\nx\nx\nddp\n", patient).config.backend == "ddp");
}

TEST_CASE("config command: stdin ending before a question without a default is a UsageError",
          "[config_command]") {
  REQUIRE_THROWS_MATCHES(
      answer("1\n2\n0\n"), accel::UsageError,
      Catch::Message("stdin ended before question 'What is the IP address or host name of the "
                     "machine that will host the main process?' was answered; give one "
                     "answer per line (an empty line takes the default)"));
  REQUIRE_THROWS_AS(answer("\nfsdp\n\n\n\nTRANSFORMER_BASED_WRAP\n"), accel::UsageError);
  // Answering yes to the block-type question (Accelerate's _no_split_modules one) leaves the class list
  // empty: the model's repeated block type is wrapped at prepare.
  const auto from_model = answer("\nfsdp\n\n\n\nTRANSFORMER_BASED_WRAP\nyes\n\n\n\n\n\n\n\n\n\n\n\n").config;
  CHECK(from_model.fsdp.auto_wrap_policy == accel::AutoWrapPolicy::TransformerBasedWrap);
  CHECK(from_model.fsdp.transformer_layer_cls_to_wrap.empty());
}

TEST_CASE("config command: choices accept the number or the name", "[config_command]") {
  const char* const names[] = {"local", "ddp", "fsdp", "zero"};
  for (int i = 0; i < 4; ++i) {
    // Answers past the last question are never read; enough empty lines for the longest path (zero).
    const std::string rest = "\n\n\n\n\n\n\n\n\n\n";
    INFO("backend " << names[i]);
    const Config by_number = answer("0\n" + std::to_string(i) + rest).config;
    const Config by_name = answer("this machine\n" + std::string(names[i]) + rest).config;
    CHECK(by_number == by_name);
    CHECK(by_number.backend == names[i]);
  }
  CHECK(answer("\nFSDP\n\n\n\n\n\n\n\n\n").config.backend == "fsdp");
  CHECK(answer("\nDeepSpeed\n\n\n\n\n\n\n\n\n").config.backend == "zero");
  CHECK(answer("\nmulti-gpu\n\n\n\n\n\n").config.backend == "ddp");
  CHECK(answer("\n\n\n\n2\n").config.mixed_precision == MixedPrecision::Bf16);
  CHECK(answer("\n\n\n\n  Fp16  \n").config.mixed_precision == MixedPrecision::Fp16);
  CHECK(answer("\nfsdp\n\n\nshard-grad-op\n\n\n\n\n\n\n").config.fsdp.sharding_strategy ==
        accel::ShardingStrategy::ShardGradOp);
  CHECK(answer("MULTI_MACHINE\n\n\nhost\n\n\n\n\n\n\n\n").config.num_machines == 2);
}

TEST_CASE("config command: piped answers are echoed, typed answers are not", "[config_command]") {
  const std::string answers = "\nddp\n\n2\n\n\n\n";
  const Session piped = answer(answers);
  CHECK(piped.output.find("Enter 0-3 or a name [local]: ddp\nDo you want") != std::string::npos);
  CHECK(piped.output.find("How many processes will you use? [2]: 2\n") != std::string::npos);

  QuestionnaireOptions terminal;
  terminal.interactive = true;
  const Session typed = answer(answers, terminal);
  CHECK(typed.config == piped.config);
  CHECK(typed.output.find("Enter 0-3 or a name [local]: Do you want") != std::string::npos);
  CHECK(typed.output.find("(default)") == std::string::npos);
}

TEST_CASE("config command: 'config default' writes a file and refuses to overwrite without --force",
          "[config_command]") {
  ScratchDir dir;
  const std::string path = dir.file("default.yaml");
  auto run = [](const std::string& command_line) {
    CLI::App app("accel-launch");
    accel::launcher::setup_config_command(app);
    CaptureCout capture;
    app.parse(command_line);
    return capture.text();
  };

  CHECK(run("config default --config_file " + path) ==
        "accelerate-cpp configuration saved at " + path + "\n");
  CHECK(Config::load_file(path) == Config{});

  REQUIRE_THROWS_MATCHES(run("config default --config-file " + path + " --mixed_precision bf16"),
                         accel::UsageError,
                         Catch::Message(path + " already exists; pass --force to overwrite it"));
  CHECK(Config::load_file(path) == Config{});  // untouched

  const std::string output =
      run("config --config-file " + path + " default --force --mixed-precision BF16 --num_processes 2");
  CHECK(output.find("accelerate-cpp configuration saved at " + path + "\n") != std::string::npos);
  Config expected;
  expected.backend = "ddp";
  expected.num_processes = 2;
  expected.mixed_precision = MixedPrecision::Bf16;
  CHECK(Config::load_file(path) == expected);

  CHECK_THROWS_AS(run("config default --config_file " + path + " --force --mixed_precision fp8"),
                  CLI::ValidationError);
  CHECK_THROWS_AS(run("config default --config_file " + path + " --force --num_processes 0"),
                  CLI::ValidationError);
}

TEST_CASE("config command: the binary writes the expected file from piped answers",
          "[config_command][binary]") {
  const std::string bin = launcher_binary();
  ScratchDir dir;
  const std::string path = dir.file("piped.yaml");
  std::string output;

  const int status = run_shell(
      "printf '0\\nddp\\n\\n2\\n4\\nbf16\\n\\n' | " + bin + " config --config_file " + path, output);
  INFO(output);
  REQUIRE(status == 0);
  CHECK(output.find("accelerate-cpp configuration saved at " + path) != std::string::npos);
  CHECK(output.find("Enter 0-3 or a name [local]: ddp\n") != std::string::npos);
  Config expected;
  expected.backend = "ddp";
  expected.num_processes = 2;
  expected.gradient_accumulation_steps = 4;
  expected.mixed_precision = MixedPrecision::Bf16;
  CHECK(Config::load_file(path) == expected);

  // Running it again overwrites, and says so; stdin ending early takes the defaults.
  REQUIRE(run_shell("printf '\\nzero\\n' | " + bin + " config --config-file " + path, output) == 0);
  CHECK(output.find("Overwrote the existing file " + path) != std::string::npos);
  Config zero;
  zero.backend = "zero";
  zero.num_processes = 2;
  CHECK(Config::load_file(path) == zero);
}

TEST_CASE("config command: the binary fails on bad piped input and on overwriting a default config",
          "[config_command][binary]") {
  const std::string bin = launcher_binary();
  ScratchDir dir;
  const std::string path = dir.file("default.yaml");
  std::string output;

  CHECK(run_shell("printf 'x\\nx\\nx\\nx\\nx\\n' | " + bin + " config --config_file " + path, output) != 0);
  CHECK(output.find("no valid answer for 'In which compute environment are you running?'") !=
        std::string::npos);
  CHECK_FALSE(std::filesystem::exists(path));

  REQUIRE(run_shell(bin + " config default --config_file " + path + " < /dev/null", output) == 0);
  CHECK(run_shell(bin + " config default --config_file " + path, output) != 0);
  CHECK(output.find(path + " already exists; pass --force to overwrite it") != std::string::npos);
  CHECK(run_shell(bin + " config default --config_file " + path + " --force", output) == 0);
  CHECK(Config::load_file(path) == Config{});

  REQUIRE(run_shell(bin + " config --help", output) == 0);
  CHECK(output.find("--config_file,--config-file") != std::string::npos);
  CHECK(output.find("When stdin ends early, the remaining questions take their defaults") !=
        std::string::npos);
  REQUIRE(run_shell(bin + " config default --help", output) == 0);
  CHECK(output.find("--force") != std::string::npos);
  CHECK(output.find("--mixed_precision,--mixed-precision") != std::string::npos);
}

TEST_CASE("config keys: docs/config_keys.md is what `accel-launch config keys` prints", "[config_command]") {
  std::string output;
  REQUIRE(run_shell(launcher_binary() + " config keys", output) == 0);
  const std::string doc_path = accel::test::tests_dir() + "/../docs/config_keys.md";
  std::ifstream in(doc_path);
  REQUIRE(in.good());
  std::stringstream doc;
  doc << in.rdbuf();
  // The file is a short header, then exactly the table.
  const auto table = doc.str().find("| key |");
  REQUIRE(table != std::string::npos);
  INFO("regenerate with: build/launcher/accel-launch config keys (below the header of " << doc_path << ")");
  CHECK(doc.str().substr(table) == output);
  CHECK(output.find("| `fsdp_config.fsdp_sharding_strategy` | `FULL_SHARD` |") != std::string::npos);
  CHECK(output.find("| `deepspeed_config.zero_stage` | `2` | `3` |") != std::string::npos);
  CHECK(output.find("\n## Not supported\n") != std::string::npos);
  CHECK(output.find("| `fp8_config` |") != std::string::npos);
  CHECK(output.find("| `megatron_lm_config.megatron_lm_tp_degree` |") != std::string::npos);
  CHECK(output.find("| `parallelism_config.parallelism_config_tp_size` |") != std::string::npos);
  CHECK(output.find("| DeepSpeed JSON | `zero_optimization.zenflow` | refused | null |") !=
        std::string::npos);
}
