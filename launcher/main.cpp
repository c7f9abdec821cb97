/// \file main.cpp
/// accel-launch: the only place where errors become messages and exit codes.

#include <CLI/CLI.hpp>

#include <exception>
#include <iostream>
#include <string>

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

// A command-line error as one line: what was wrong, which option, and where its valid values are listed.
std::string usage_message(const CLI::App& app, const CLI::ParseError& e) {
  std::string what = e.what();
  std::string where = "accel-launch";
  for (const auto* sub : app.get_subcommands())
    where += " " + sub->get_name();
  if (e.get_name() == "ConversionError") {
    what +=
        " (not of the option's type, or outside its range: counts and ranks are whole numbers up to "
        "2147483647)";
  }
  return what + "; see `" + where + " --help`";
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
  } catch (const CLI::Success& e) {
    return app.exit(e);  // --help, --version
  } catch (const CLI::ParseError& e) {
    // CLI11's own text ("Could not convert: --num_processes = 99999999999") in our form, with the way on.
    return report_error(usage_message(app, e).c_str(), 2);
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
