// `accel-launch estimate-memory`: predicted per-rank bytes of parameters, gradients and optimizer state for a
// parameter count, world size, backend, stage, precision and optimizer (the layouts of accelerate-cpp itself,
// checked against measured runs by the test suite).
#include <accel/memory.hpp>

#include "commands.hpp"

#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include <iostream>
#include <memory>

namespace accel::launcher {
namespace {

void run_estimate(const MemoryEstimateInput& in) {
  const auto r = estimate_memory(in);
  std::cout << fmt::format(
                   "Per-rank memory for {} parameters on {} process(es), backend {}{}, optimizer {}, "
                   "mixed precision {}:\n",
                   in.num_parameters, in.num_processes, in.backend,
                   in.backend == "zero"   ? fmt::format(" stage {}", in.zero_stage)
                   : in.backend == "fsdp" ? " " + in.fsdp_sharding_strategy
                                          : std::string(),
                   in.optimizer, in.mixed_precision)
            << r.to_string() << "\n"
            << fmt::format("bytes: parameters={} gradients={} optimizer_state={} total={}\n", r.parameters,
                           r.gradients, r.optimizer_state, r.total());
}

}  // namespace

void setup_estimate_memory_command(CLI::App& app) {
  auto in = std::make_shared<MemoryEstimateInput>();
  auto* cmd = app.add_subcommand("estimate-memory",
                                 "Predict per-rank bytes of parameters, gradients and optimizer state");
  cmd->add_option("--num_parameters,--num-parameters,-p", in->num_parameters,
                  "Trainable parameters (elements)")
      ->required();
  cmd->add_option("--num_processes,--num-processes,-n", in->num_processes, "Processes (ranks)")
      ->default_val(1);
  cmd->add_option("--backend", in->backend, "local | ddp | zero | fsdp")->default_val("ddp");
  cmd->add_option("--zero_stage,--zero-stage", in->zero_stage, "ZeRO stage for --backend zero: 0, 1, 2 or 3")
      ->default_val(2);
  cmd->add_option("--fsdp_sharding_strategy,--fsdp-sharding-strategy", in->fsdp_sharding_strategy,
                  "For --backend fsdp: FULL_SHARD, SHARD_GRAD_OP or NO_SHARD")
      ->default_val("SHARD_GRAD_OP");
  cmd->add_option("--optimizer", in->optimizer, "adam | adamw | sgd | sgd_momentum | rmsprop | adagrad")
      ->default_val("adam");
  cmd->add_option("--mixed_precision,--mixed-precision", in->mixed_precision, "no | fp16 | bf16")
      ->default_val("no");
  cmd->callback([in] { run_estimate(*in); });
}

}  // namespace accel::launcher
