/// \file main.cpp
/// accel-launch: the only place where errors become messages and exit codes.

#include <CLI/CLI.hpp>

#include <exception>
#include <iostream>

#include "accel/errors.hpp"
#include "commands.hpp"
#include "launch_command.hpp"

#ifndef ACCEL_LAUNCH_VERSION
#define ACCEL_LAUNCH_VERSION "0.1.0"
#endif

namespace {

int report_error(const char* message, int exit_code) {
  std::cerr << "accel-launch: error: " << message << std::endl;
  return exit_code;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Configure and launch accelerate-cpp training programs", "accel-launch"};
  app.set_version_flag("--version", std::string("accel-launch ") + ACCEL_LAUNCH_VERSION);
  app.require_subcommand(1);
  accel::launcher::setup_launch_command(app);
  accel::launcher::setup_train_command(app);
  accel::launcher::setup_config_command(app);
  accel::launcher::setup_env_command(app);
  accel::launcher::setup_estimate_memory_command(app);
  accel::launcher::setup_test_command(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const accel::launcher::RanksFailed& e) {
    std::cerr << e.what() << std::flush;
    return e.exit_code();
  } catch (const accel::ConfigError& e) {
    return report_error(e.what(), 2);
  } catch (const accel::UsageError& e) {
    return report_error(e.what(), 2);
  } catch (const accel::LaunchError& e) {
    return report_error(e.what(), 1);
  } catch (const std::exception& e) {
    return report_error(e.what(), 1);
  }
  return 0;
}
