#pragma once
/// \file commands.hpp
/// The subcommands of accel-launch. Each lives in its own file as an options struct, a `setup_*` that
/// registers it on the CLI11 app, and a `run_*` that does the work. Library errors (accel::Error and
/// subclasses) propagate to `main`, the only place that turns them into messages and exit codes.

#include <string>

namespace CLI {
class App;
}

namespace accel::launcher {

/// `accel-launch launch [options] PROGRAM [ARGS...]`: spawns the ranks of this machine.
void setup_launch_command(CLI::App& app);
/// `accel-launch config [default]`: the questionnaire that writes the YAML config.
void setup_config_command(CLI::App& app);
/// `accel-launch env`: a copy-paste block for bug reports.
void setup_env_command(CLI::App& app);
/// `accel-launch estimate-memory`: predicted per-rank memory of a training setup.
void setup_estimate_memory_command(CLI::App& app);
/// `accel-launch train -t TYPE PROGRAM [ARGS...]`: launch with a named pair of config_templates/trainer/.
void setup_train_command(CLI::App& app);
/// `accel-launch test`: runs accel-test-check on the configured ranks and says passed or FAILED.
void setup_test_command(CLI::App& app);

/// Where `config` writes and `launch` reads by default: `$ACCEL_CONFIG_FILE` if set, else
/// `$XDG_CONFIG_HOME/accelerate-cpp/default_config.yaml`, else
/// `~/.config/accelerate-cpp/default_config.yaml`.
std::string default_config_path();

/// The directory holding trainer/<type>.*: `given` (--templates), else $ACCEL_TEMPLATES_DIR, else the
/// installed PREFIX/share/accelerate_cpp/config_templates, else the source tree's (train_command.cpp).
std::string config_templates_dir(const std::string& given);

/// The registered backends' names joined by `separator` ("local | ddp | fsdp | zero"), for help texts.
std::string backend_names_help(const std::string& separator = " | ");

}  // namespace accel::launcher
