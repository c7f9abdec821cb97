// `accel-launch env`: a block to paste into bug reports. accel-launch never loads LibTorch (it must start
// fast), so LibTorch, CUDA and NCCL versions are the ones this build was configured against; devices come
// from the system (nvidia-smi, /proc/cpuinfo).
#include <accel/config/config.hpp>
#include <accel/errors.hpp>

#include "commands.hpp"

#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <thread>

namespace accel::launcher {
namespace {

struct EnvOptions {
  std::string config_file;
};

std::string run_capture(const std::string& cmd) {
  std::unique_ptr<FILE, int (*)(FILE*)> pipe(::popen(cmd.c_str(), "r"), ::pclose);
  if (!pipe) return {};
  std::string out;
  char buf[512];
  while (std::fgets(buf, sizeof buf, pipe.get()) != nullptr)
    out += buf;
  while (!out.empty() && (out.back() == '\n' || out.back() == ' '))
    out.pop_back();
  return out;
}

std::string cpu_model() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  }
  return "unknown";
}

// The settings that silently change training when a user swaps backends by editing the file (clipping,
// precision, accumulation): each value with where it came from (Config::origins).
void print_origins(const Config& config) {
  const auto origin = [&](const std::string& key, const std::string& fallback) {
    const auto it = config.origins.find(key);
    return it == config.origins.end() ? fallback : it->second;
  };
  const double clipping = automatic_gradient_clipping(config);
  std::cout << "- Where the settings that change training came from:\n"
            << "    mixed_precision: " << to_string(config.mixed_precision) << "  <- "
            << origin("mixed_precision", "default: 'no', as Accelerate's") << "\n"
            << "    gradient_accumulation_steps: " << config.gradient_accumulation_steps << "  <- "
            << origin("gradient_accumulation_steps", "default: 1, as Accelerate's") << "\n"
            << "    gradient_clipping: " << fmt::format("{:g}", clipping) << "  <- "
            << (clipping > 0 || config.origins.count("gradient_clipping")
                    ? origin("gradient_clipping", "the backend")
                    : fmt::format("backend {} does not clip by itself (call "
                                  "accelerator.clip_grad_norm_(max_norm) in your loop, or the Trainer's "
                                  "max_grad_norm)",
                                  config.backend))
            << "\n";
}

void run_env(const EnvOptions& options) {
  std::string path = options.config_file;
  if (path.empty() && std::filesystem::exists(default_config_path())) path = default_config_path();
  const Config config = path.empty() ? Config{} : Config::load_file(path);
  std::string gpus = run_capture("nvidia-smi -L 2>/dev/null");
  if (gpus.empty()) gpus = "none found (nvidia-smi absent or no GPU)";

  std::cout << "Copy-and-paste the text below in your GitHub issue\n\n"
            << "- accelerate-cpp version: " << ACCEL_LAUNCH_VERSION << "\n"
            << "- LibTorch version (built against): " << ACCEL_TORCH_VERSION << "\n"
            << "- CUDA toolkit (built against): " << ACCEL_CUDA_VERSION << "\n"
            << "- NCCL (built against, via libtorch): " << ACCEL_NCCL_VERSION << "\n"
            << "- Compiler: " << ACCEL_COMPILER << "\n"
            << "- Platform: " << run_capture("uname -srm") << "\n"
            << "- CPU: " << cpu_model() << " (" << std::thread::hardware_concurrency() << " logical cores)\n"
            << "- GPUs: " << gpus << "\n"
            << "- Environment: ACCEL_CONFIG_FILE="
            << (std::getenv("ACCEL_CONFIG_FILE") ? std::getenv("ACCEL_CONFIG_FILE") : "")
            << " OMP_NUM_THREADS=" << (std::getenv("OMP_NUM_THREADS") ? std::getenv("OMP_NUM_THREADS") : "")
            << "\n"
            << "- Config file: " << (path.empty() ? "none (defaults)" : path) << "\n"
            << "- Resolved config:\n";
  std::string yaml = config.to_yaml();
  std::size_t start = 0;
  while (start < yaml.size()) {
    const auto end = yaml.find('\n', start);
    const auto line = yaml.substr(start, end == std::string::npos ? std::string::npos : end - start);
    if (!line.empty() && line[0] != '#') std::cout << "    " << line << "\n";
    if (end == std::string::npos) break;
    start = end + 1;
  }
  print_origins(config);
}

}  // namespace

void setup_env_command(CLI::App& app) {
  auto options = std::make_shared<EnvOptions>();
  auto* cmd = app.add_subcommand("env", "Print versions, devices and the resolved config, for bug reports");
  cmd->add_option("--config_file,--config-file", options->config_file,
                  "Config file to resolve (default: the default config path, if it exists)");
  cmd->callback([options] { run_env(*options); });
}

}  // namespace accel::launcher
