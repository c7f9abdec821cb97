/// \file train_command.cpp
/// `accel-launch train -t TYPE [launch options] PROGRAM [ARGS...]`: the training types of the users' material
/// (full, lora, qlora, deepspeed, stage2_offload, stage3, minimal) as named pairs of files in
/// config_templates/trainer/:
/// `<type>.accelerate.yaml` (the Accelerate config: backend, precision, offload) and `<type>.yaml` (Hugging
/// Face TrainingArguments). It is `launch --config_file <type>.accelerate.yaml PROGRAM --training_args
/// <type>.yaml ARGS...`: a Trainer program (examples/trainer) reads both; options given here or after PROGRAM
/// override the files.
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <CLI/CLI.hpp>

#include <accel/errors.hpp>

#include <algorithm>
#include <cstdlib>
#include <filesystem>

#include "commands.hpp"
#include "launch_command.hpp"

namespace accel::launcher {
namespace {

namespace fs = std::filesystem;

// The installed templates, relative to this executable (PREFIX/bin/accel-launch ->
// PREFIX/share/accelerate_cpp/config_templates), so that an installed launcher never depends on the source
// tree it was built from and a moved prefix still finds them. Empty when there are none (the build tree's
// launcher).
fs::path installed_templates_dir() {
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (ec) return {};
  const fs::path dir = exe.parent_path().parent_path() / "share" / "accelerate_cpp" / "config_templates";
  return fs::is_directory(dir / "trainer", ec) ? dir : fs::path();
}

// --templates, else ACCEL_TEMPLATES_DIR, else the installed templates, else the source tree's
// config_templates (the build tree's launcher).
}  // namespace

std::string config_templates_dir(const std::string& given) {
  if (!given.empty()) return given;
  if (const char* env = std::getenv("ACCEL_TEMPLATES_DIR"); env != nullptr && *env != '\0') return env;
  if (const fs::path installed = installed_templates_dir(); !installed.empty()) return installed.string();
#ifdef ACCEL_CONFIG_TEMPLATE_DIR
  return ACCEL_CONFIG_TEMPLATE_DIR;
#else
  return "config_templates";
#endif
}

namespace {

std::vector<std::string> training_types(const fs::path& dir) {
  std::vector<std::string> types;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    const std::string suffix = ".accelerate.yaml";
    if (name.size() > suffix.size() &&
        name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0) {
      const std::string type = name.substr(0, name.size() - suffix.size());
      if (fs::exists(dir / (type + ".yaml"), ec)) types.push_back(type);
    }
  }
  std::sort(types.begin(), types.end());
  return types;
}

}  // namespace

void setup_train_command(CLI::App& app) {
  auto options = std::make_shared<LaunchOptions>();
  auto type = std::make_shared<std::string>();
  auto templates = std::make_shared<std::string>();
  CLI::App* sub = app.add_subcommand("train",
                                     "Launch a Trainer program with a training type: the pair "
                                     "<type>.accelerate.yaml (Accelerate config) and "
                                     "<type>.yaml (TrainingArguments) of config_templates/trainer/");
  sub->add_option("-t,--type", *type,
                  "Training type (full, lora, qlora, deepspeed, stage2_offload, stage3, minimal, ...)")
      ->required();
  sub->add_option("--templates", *templates,
                  "Directory holding trainer/<type>.* (default: $ACCEL_TEMPLATES_DIR, else the installed "
                  "PREFIX/share/accelerate_cpp/config_templates, else the source tree's config_templates)");
  add_launch_options(sub, options);
  sub->callback([options, type, templates] {
    const fs::path dir = fs::path(config_templates_dir(*templates)) / "trainer";
    const auto types = training_types(dir);
    if (std::find(types.begin(), types.end(), *type) == types.end()) {
      throw UsageError(
          fmt::format("train: unknown training type '{}'; {} has {} (each a <type>.accelerate.yaml and "
                      "<type>.yaml pair); "
                      "pass --templates DIR or set ACCEL_TEMPLATES_DIR for another directory",
                      *type, dir.string(),
                      types.empty() ? std::string("none") : fmt::format("{}", fmt::join(types, ", "))));
    }
    if (options->command.empty())
      throw UsageError(
          "train: give the Trainer program to run (for example "
          "build/examples/trainer/fashion_mnist_trainer)");
    LaunchOptions launch = *options;
    // The recipe's ranks get tcmalloc where it is installed, as PyTorch's run_cpu gives them (glibc's malloc
    // keeps ~0.1-0.3 GB of activation-sized holes a rank at a step's peak; tcmalloc does not, at the same CPU
    // a step: BENCHMARKS.md, eleventh update); --use_default_allocator keeps glibc's.
    if (launch.allocator.empty()) {
      launch.allocator = "tcmalloc";
      launch.allocator_by_default = true;
    }
    if (launch.config_file.empty()) launch.config_file = (dir / (*type + ".accelerate.yaml")).string();
    // The program's own --training_args (after PROGRAM) wins; otherwise the type's file comes first, so that
    // the options after it override its keys.
    const bool own = std::find_if(launch.command.begin() + 1, launch.command.end(), [](const std::string& a) {
                       return a == "--training_args" || a.rfind("--training_args=", 0) == 0;
                     }) != launch.command.end();
    if (!own) {
      launch.command.insert(launch.command.begin() + 1,
                            {"--training_args", (dir / (*type + ".yaml")).string()});
    }
    // A type that fine-tunes through adapters also has <type>.model.yaml (TRL's ModelConfig keys), passed as
    // --model_config unless the program was given its own.
    const fs::path model_config = dir / (*type + ".model.yaml");
    const bool own_model =
        std::find_if(launch.command.begin() + 1, launch.command.end(), [](const std::string& a) {
          return a == "--model_config" || a.rfind("--model_config=", 0) == 0;
        }) != launch.command.end();
    if (!own_model && fs::exists(model_config))
      launch.command.insert(launch.command.begin() + 1, {"--model_config", model_config.string()});
    run_launch(launch);
  });
}

}  // namespace accel::launcher
