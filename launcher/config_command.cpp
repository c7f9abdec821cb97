/// \file config_command.cpp
/// `accel-launch config` (the questionnaire) and `accel-launch config default` (a file without questions).

#include <unistd.h>
#include <CLI/CLI.hpp>

#include <filesystem>
#include <iostream>
#include <memory>
#include <string>

#include "commands.hpp"
#include "questionnaire.hpp"

namespace accel::launcher {
namespace {

/// Options of `config` and `config default` (one struct: `--config_file` may be given before or after
/// `default`).
struct ConfigCommandOptions {
  std::string config_file;
  bool force = false;
  int num_processes = 1;
  std::string mixed_precision = "no";
};

constexpr const char* kStdinHelp =
    "Answers may be piped on stdin, one per line, e.g.\n"
    "  printf '0\\nddp\\n\\n4\\n' | accel-launch config --config_file my.yaml\n"
    "An empty line takes the default shown in brackets; a choice accepts its number (from 0) or its name "
    "(case-insensitive). When stdin ends early, the remaining questions take their defaults (the output says "
    "so); a question without a default (main process IP, FSDP module names) then fails. On a non-interactive "
    "stdin an invalid answer is asked again at most 5 times, then the command fails. An existing file is "
    "overwritten.";

std::string resolve_path(const ConfigCommandOptions& options) {
  return options.config_file.empty() ? default_config_path() : options.config_file;
}

void save(const Config& config, const std::string& path, bool existed) {
  config.save_file(path);
  if (existed) std::cout << "Overwrote the existing file " << path << "\n";
  std::cout << "accelerate-cpp configuration saved at " << path << std::endl;
}

void run_config_command(const ConfigCommandOptions& options) {
  const std::string path = resolve_path(options);
  QuestionnaireOptions questionnaire;
  questionnaire.interactive = ::isatty(STDIN_FILENO) != 0;
  questionnaire.max_attempts = questionnaire.interactive ? 0 : 5;
  const Config config = run_questionnaire(std::cin, std::cout, questionnaire);
  save(config, path, std::filesystem::exists(path));
}

void run_config_default_command(const ConfigCommandOptions& options) {
  const std::string path = resolve_path(options);
  const bool existed = std::filesystem::exists(path);
  if (existed && !options.force) throw UsageError(path + " already exists; pass --force to overwrite it");
  save(default_config(options.num_processes, parse_mixed_precision(options.mixed_precision)), path, existed);
}

// Reads a config (an older or hand-written one, an Accelerate file) and writes it back with every key this
// build knows at its current default, keeping a copy of the original next to it.
void run_config_update_command(const ConfigCommandOptions& options) {
  const std::string path = resolve_path(options);
  if (!std::filesystem::exists(path)) {
    throw UsageError(path +
                     " does not exist; create one with 'accel-launch config' or 'accel-launch config "
                     "default', or name another with --config_file");
  }
  Config config = Config::load_file(path);  // ConfigError names the file, line and fix
  for (const std::string& notice : config.notices)
    std::cerr << "accel-launch: " << notice << "\n";
  const std::string backup = path + ".bak";
  std::filesystem::copy_file(path, backup, std::filesystem::copy_options::overwrite_existing);
  config.save_file(path);
  std::cout << "accelerate-cpp configuration updated at " << path << " (the previous file is " << backup
            << ")" << std::endl;
}

// Every config key as a Markdown table, from the schema that also reads and writes them (docs/config_keys.md
// is this output; a test keeps the two equal).
void run_config_keys_command() {
  std::cout << "| key | default | example | meaning |\n|---|---|---|---|\n";
  auto escaped = [](const std::string& text) {
    std::string out;
    for (char c : text)
      out += c == '|' ? std::string("\\|") : std::string(1, c);
    return out;
  };
  auto cell = [&](const std::string& text) {
    return text.empty() ? std::string() : "`" + escaped(text) + "`";
  };
  for (const auto& key : config_keys()) {
    std::cout << "| `" << key.path << "` | " << cell(key.default_value) << " | " << cell(key.example) << " | "
              << escaped(key.doc) << (key.setting ? "" : " (no setting of its own)") << " |\n";
  }
  std::cout
      << "\n## Not supported\n\n"
         "Real keys of Accelerate's YAML files and of DeepSpeed JSON files (`deepspeed_config_file`), of "
         "some version of them, that\naccelerate-cpp does not support, from the table that also decides "
         "what loading them does (`unsupported_config_keys()`):\nrefused with \"`<key>` is not supported "
         "by accelerate-cpp: <what it does there>; <instead>\", or ignored with a notice that\nsays why "
         "(launcher-side and logging settings, and settings whose job is done here another way, such as "
         "the\noptimizer your loop creates; a DeepSpeed JSON's notices list its keys in one line). A value "
         "the \"accepted when\" column\nnames asks for nothing and is accepted without a word.\n\n"
         "| file | key | outcome | accepted when | what it does there | instead |\n"
         "|---|---|---|---|---|---|\n";
  for (const auto& key : unsupported_config_keys()) {
    std::cout << "| " << key.file << " | `" << key.path << "` | "
              << (key.refused ? "refused" : "ignored, with a notice") << " | " << escaped(key.accepted_when)
              << " | " << escaped(key.what) << " | " << escaped(key.instead) << " |\n";
  }
}

}  // namespace

void setup_config_command(CLI::App& app) {
  auto options = std::make_shared<ConfigCommandOptions>();

  CLI::App* config = app.add_subcommand(
      "config",
      "Ask a few questions (compute environment, backend, processes, FSDP/ZeRO settings, gradient "
      "accumulation, mixed precision, debug checks, and with several processes pipeline parallelism: stages, "
      "micro-batches, schedule, partition) and write the YAML config that 'accel-launch launch' reads.");
  config->footer(kStdinHelp);
  config->add_option("--config_file,--config-file", options->config_file,
                     "Where to write the config (default: $ACCEL_CONFIG_FILE, else "
                     "$XDG_CONFIG_HOME/accelerate-cpp/default_config.yaml, else "
                     "~/.config/accelerate-cpp/default_config.yaml)");

  CLI::App* defaults = config->add_subcommand(
      "default",
      "Write a config without asking: the local backend with one process, or ddp with --num_processes > 1. "
      "Refuses to replace an existing file unless --force is given.");
  defaults->footer(
      "Example: accel-launch config default --config_file my.yaml --num_processes 2 --mixed_precision bf16");
  defaults->add_option("--config_file,--config-file", options->config_file,
                       "Where to write the config (default: as for 'accel-launch config')");
  defaults->add_flag("--force,-f", options->force, "Overwrite the file if it exists");
  defaults
      ->add_option("--mixed_precision,--mixed-precision", options->mixed_precision,
                   "Mixed precision: no, fp16 (with dynamic loss scaling) or bf16")
      ->check(CLI::IsMember({"no", "fp16", "bf16"}, CLI::ignore_case))
      ->capture_default_str();
  defaults
      ->add_option("--num_processes,--num-processes", options->num_processes,
                   "Number of processes on this machine; more than 1 selects the ddp backend")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  defaults->callback([options] { run_config_default_command(*options); });

  CLI::App* keys = config->add_subcommand(
      "keys", "Print every key of the YAML config (default, an example value, meaning) as a Markdown table.");
  keys->callback([] { run_config_keys_command(); });

  CLI::App* update = config->add_subcommand(
      "update",
      "Rewrite an existing config (--config_file, else the default one) with every key at its current "
      "default where the file leaves it out, so that it shows every setting; the original is kept as "
      "<file>.bak.");
  update->add_option("--config_file,--config-file", options->config_file,
                     "The config to update (default: as for 'accel-launch config')");
  update->callback([options] { run_config_update_command(*options); });

  // With subcommands, CLI11 runs this callback after theirs: `config default` must not start the questions.
  config->callback([options, defaults, keys, update] {
    if (defaults->parsed() || keys->parsed() || update->parsed()) return;
    run_config_command(*options);
  });
}

}  // namespace accel::launcher
