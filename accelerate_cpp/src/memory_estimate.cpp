#include <accel/errors.hpp>
#include <accel/memory.hpp>

#include "config_detail.hpp"

#include <fmt/format.h>

namespace accel {

std::string MemoryReport::to_string() const {
  auto mib = [](std::uint64_t b) { return static_cast<double>(b) / (1024.0 * 1024.0); };
  return fmt::format(
      "parameters: {:.3f} MiB\ngradients: {:.3f} MiB\noptimizer state: {:.3f} MiB\ntotal: {:.3f} MiB",
      mib(parameters), mib(gradients), mib(optimizer_state), mib(total()));
}

MemoryReport estimate_memory(const MemoryEstimateInput& in) {
  if (in.num_processes < 1) {
    throw ConfigError(
        fmt::format("estimate-memory: num_processes must be at least 1, got {}", in.num_processes), {}, 0,
        "num_processes");
  }
  int states = 0;
  if (in.optimizer == "adam" || in.optimizer == "adamw") {
    states = 2;
  } else if (in.optimizer == "sgd_momentum" || in.optimizer == "rmsprop" || in.optimizer == "adagrad") {
    states = 1;
  } else if (in.optimizer != "sgd") {
    throw ConfigError(fmt::format("estimate-memory: unknown optimizer '{}'; allowed: adam, adamw, sgd, "
                                  "sgd_momentum, rmsprop, adagrad",
                                  in.optimizer),
                      {}, 0, "optimizer");
  }
  if (in.mixed_precision != "no" && in.mixed_precision != "bf16" && in.mixed_precision != "fp16") {
    throw ConfigError(fmt::format("estimate-memory: invalid mixed_precision '{}'; allowed: no, fp16, bf16",
                                  in.mixed_precision),
                      {}, 0, "mixed_precision");
  }
  // The layout comes from the backend's own config part (backends/<name>/<name>_config.cpp).
  const config_detail::BackendPart* part = config_detail::find_part(in.backend);
  if (part == nullptr) {
    std::string names;
    for (const BackendInfo& info : config_backends())
      names += (names.empty() ? "" : ", ") + info.name;
    throw ConfigError(fmt::format("estimate-memory: unknown backend '{}'; allowed: {}", in.backend, names),
                      {}, 0, "backend");
  }
  const config_detail::MemoryLayout layout =
      part->memory_layout ? part->memory_layout(in) : config_detail::MemoryLayout{};
  const bool sharded = layout.shards_state, params_sharded = layout.shards_parameters;
  const std::uint64_t p = in.num_parameters, n = static_cast<std::uint64_t>(in.num_processes);
  const std::uint64_t s = (p + n - 1) / n;  // elements per shard
  constexpr std::uint64_t kFloat = 4;  // fp32 weights, gradients and optimizer state (autocast keeps them)
  MemoryReport r;
  if (params_sharded && n > 1) {
    // At rest only the slices exist (units are gathered while they compute; not counted here).
    r.parameters = kFloat * s;
    r.gradients = kFloat * s;
    r.optimizer_state = kFloat * s * static_cast<std::uint64_t>(states);
  } else if (sharded && n > 1) {
    r.parameters = kFloat * (p + s);
    r.gradients = kFloat * s;
    r.optimizer_state = kFloat * s * static_cast<std::uint64_t>(states);
  } else {
    r.parameters = kFloat * p;
    r.gradients = kFloat * p;
    r.optimizer_state = kFloat * p * static_cast<std::uint64_t>(states);
  }
  return r;
}

}  // namespace accel
