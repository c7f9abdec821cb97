#include <accel/errors.hpp>
#include <accel/memory.hpp>

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
  bool sharded = false, params_sharded = false;
  if (in.backend == "zero") {
    if (in.zero_stage < 0 || in.zero_stage > 3) {
      throw ConfigError(
          fmt::format("estimate-memory: zero_stage {} is not available (0, 1, 2 or 3)", in.zero_stage), {}, 0,
          "zero_stage");
    }
    sharded = in.zero_stage >= 1;
    params_sharded = in.zero_stage == 3;
  } else if (in.backend == "fsdp") {
    if (in.fsdp_sharding_strategy == "SHARD_GRAD_OP" || in.fsdp_sharding_strategy == "FULL_SHARD") {
      sharded = true;
      params_sharded = in.fsdp_sharding_strategy == "FULL_SHARD";
    } else if (in.fsdp_sharding_strategy != "NO_SHARD") {
      throw ConfigError(
          fmt::format("estimate-memory: fsdp_sharding_strategy '{}' is not available (FULL_SHARD, "
                      "SHARD_GRAD_OP, NO_SHARD)",
                      in.fsdp_sharding_strategy),
          {}, 0, "fsdp_sharding_strategy");
    }
  } else if (in.backend != "ddp" && in.backend != "local") {
    throw ConfigError(
        fmt::format("estimate-memory: unknown backend '{}'; allowed: local, ddp, zero, fsdp", in.backend), {},
        0, "backend");
  }
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
