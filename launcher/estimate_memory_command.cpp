// `accel-launch estimate-memory`: predicted per-rank bytes of parameters, gradients and optimizer state for a
// parameter count, world size, backend, stage, precision and optimizer (the layouts of accelerate-cpp itself,
// checked against measured runs by the test suite); with --pipeline_stages, per stage: the stage's share of
// the parameters (by the partition of --layer_parameters, else 1/p) and the schedule's activation bound.
#include <accel/monitor/memory.hpp>

#include "commands.hpp"

#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include <iostream>
#include <memory>
#include <string>
#include <vector>

namespace accel::launcher {
namespace {

std::string bytes_line(const MemoryReport& r) {
  return fmt::format(
      "parameters={} gradients={} optimizer_state={} total={}{}", r.parameters, r.gradients,
      r.optimizer_state, r.total(),
      (r.nvme > 0 ? fmt::format(" nvme={}", r.nvme) : std::string()) +
          (r.nvme_parameters > 0 ? fmt::format(" nvme_parameters={}", r.nvme_parameters) : std::string()));
}

// One line per stage, then the heaviest stage's report.
void print_pipeline(const MemoryEstimateInput& in, const std::vector<StageMemoryEstimate>& stages) {
  const int p = in.pipeline_stages;
  std::cout << fmt::format(
      "Pipeline: {} stages x {} data-parallel rank(s) each, schedule {}, {} micro-batches; each stage's "
      "parameters: {}\n",
      p, in.num_processes / p, in.pipeline_schedule,
      in.micro_batches > 0 ? std::to_string(in.micro_batches) : std::string("unknown"),
      in.layer_parameters.empty() ? std::string("1/") + std::to_string(p) +
                                        " of the model (give --layer_parameters to partition them)"
                                  : fmt::format("partition '{}' of {} layers' parameter counts", in.partition,
                                                in.layer_parameters.size()));
  std::size_t heaviest = 0;
  for (std::size_t s = 0; s < stages.size(); ++s) {
    const auto& e = stages[s];
    if (e.state.total() > stages[heaviest].state.total()) heaviest = s;
    const std::string layers = in.layer_parameters.empty() ? ""
                               : e.end_layer - e.first_layer == 1
                                   ? fmt::format("layer {}, ", e.first_layer)
                                   : fmt::format("layers {}-{}, ", e.first_layer, e.end_layer - 1);
    const std::string activations =
        in.activation_bytes > 0
            ? fmt::format("activations={} ({} micro-batch(es))", e.activation_bytes, e.live_micro_batches)
        : e.live_micro_batches > 0
            ? fmt::format("activations: at most {} micro-batch(es), not estimated", e.live_micro_batches)
            : std::string("activations: not estimated");
    std::cout << fmt::format("stage {}: {}{} parameters: {} {}\n", s, layers, e.num_parameters,
                             bytes_line(e.state), activations);
  }
  if (in.activation_bytes == 0) {
    std::cout << "Activations are not included: give --activation_bytes (what autograd keeps for one "
                 "micro-batch through the whole model) and --micro_batches; 1F1B holds at most "
                 "min(stages - s, micro_batches) micro-batches on stage s, GPipe all of them.\n";
  }
  std::cout << fmt::format("Heaviest stage: {}\n", heaviest);
}

void run_estimate(const MemoryEstimateInput& in) {
  const auto stages = estimate_pipeline_memory(in);
  const auto r = estimate_memory(in);
  std::uint64_t parameters = 0;  // --num_parameters, or the sum of --layer_parameters
  for (const auto& e : stages)
    parameters += e.num_parameters;
  std::cout << fmt::format(
      "Per-rank memory for {} parameters on {} process(es), backend {}, optimizer {}, mixed precision "
      "{}{}:\n",
      parameters, in.num_processes, describe_backend(in), in.optimizer, in.mixed_precision,
      in.frozen_parameters > 0 ? fmt::format(", and {} frozen in {}", in.frozen_parameters, in.frozen_dtype)
                               : std::string());
  if (in.pipeline_stages > 1) print_pipeline(in, stages);
  std::cout << r.to_string() << "\n"
            << "bytes: " << bytes_line(r) << "\n";
}

}  // namespace

void setup_estimate_memory_command(CLI::App& app) {
  auto in = std::make_shared<MemoryEstimateInput>();
  auto* cmd = app.add_subcommand("estimate-memory",
                                 "Predict per-rank bytes of parameters, gradients and optimizer state");
  cmd->add_option("--num_parameters,--num-parameters,-p", in->num_parameters,
                  "Trainable parameters (elements)")
      ->default_val(0);
  cmd->add_option("--num_processes,--num-processes,-n", in->num_processes, "Processes (ranks)")
      ->default_val(1);
  cmd->add_option("--num_machines,--num-machines", in->num_machines,
                  "Machines the processes run on (HYBRID_* strategies shard over one machine's ranks)")
      ->default_val(1);
  cmd->add_option(
         "--hybrid_shard_size,--hybrid-shard-size", in->hybrid_shard_size,
         "Ranks per shard group for HYBRID_* strategies (fsdp_hybrid_shard_size, parallelism_config's "
         "dp_shard_size); 0: one machine's")
      ->default_val(0);
  cmd->add_option("--backend", in->backend, backend_names_help())->default_val("ddp");
  cmd->add_option("--zero_stage,--zero-stage", in->zero_stage, "ZeRO stage for --backend zero: 0, 1, 2 or 3")
      ->default_val(2);
  cmd->add_option(
         "--fsdp_sharding_strategy,--fsdp-sharding-strategy", in->fsdp_sharding_strategy,
         "For --backend fsdp: FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD or HYBRID_SHARD_ZERO2")
      ->default_val("SHARD_GRAD_OP");
  cmd->add_option("--optimizer", in->optimizer, "adam | adamw | sgd | sgd_momentum | rmsprop | adagrad")
      ->default_val("adam");
  cmd->add_option("--mixed_precision,--mixed-precision", in->mixed_precision, "no | fp16 | bf16")
      ->default_val("no");
  cmd->add_option("--pipeline_stages,--pipeline-stages", in->pipeline_stages,
                  "Pipeline stages (pipeline_config.stages); num_processes must be a multiple")
      ->default_val(1);
  cmd->add_option("--micro_batches,--micro-batches", in->micro_batches,
                  "Micro-batches per step, for the activation bound (0: unknown)")
      ->default_val(0);
  cmd->add_option("--pipeline_schedule,--pipeline-schedule", in->pipeline_schedule, "1f1b | gpipe")
      ->default_val("1f1b");
  cmd->add_option("--partition", in->partition,
                  "With --layer_parameters: parameters | uniform | boundaries such as 0,3,6")
      ->default_val("parameters");
  cmd->add_option("--layer_parameters,--layer-parameters", in->layer_parameters,
                  "Trainable parameters of each layer of the Sequential, in order (comma-separated)")
      ->delimiter(',');
  cmd->add_option("--frozen_parameters,--frozen-parameters", in->frozen_parameters,
                  "Frozen elements beside the trainable ones (the base of LoRA/QLoRA: then --num_parameters "
                  "is the adapters'), held whole on every rank");
  cmd->add_option(
         "--frozen_dtype,--frozen-dtype", in->frozen_dtype,
         "fp32 | bf16 | fp16 | 4bit (QLoRA: NF4/FP4 with double quantisation, 0.516 B) | 4bit_single")
      ->capture_default_str();
  cmd->add_option("--offload_optimizer,--offload-optimizer", in->offload_optimizer,
                  "none | cpu | nvme (zero stages 1-3: the optimizer state in files, memory keeps "
                  "--nvme_buffer_count sub-group buffers)")
      ->capture_default_str();
  cmd->add_option("--sub_group_size,--sub-group-size", in->sub_group_size,
                  "Elements per optimizer sub-group (deepspeed_config sub_group_size)")
      ->capture_default_str();
  cmd->add_option("--nvme_buffer_count,--nvme-buffer-count", in->nvme_buffer_count,
                  "offload_optimizer.buffer_count: sub-group buffers in memory with nvme")
      ->capture_default_str();
  cmd->add_option("--offload_param,--offload-param", in->offload_param,
                  "none | cpu | nvme (zero stage 3: the parameter shards in files, memory keeps "
                  "--param_nvme_buffer_count of them)")
      ->capture_default_str();
  cmd->add_option("--param_nvme_buffer_count,--param-nvme-buffer-count", in->param_nvme_buffer_count,
                  "offload_param.buffer_count: shard buffers in memory with nvme")
      ->capture_default_str();
  cmd->add_option(
         "--largest_unit_parameters,--largest-unit-parameters", in->largest_unit_parameters,
         "Elements of the model's largest ZeRO-3 / FULL_SHARD unit (a module's own parameters; default: the "
         "largest of --layer_parameters): sizes the NVMe shard buffers and the units gathered while training")
      ->capture_default_str();
  cmd->add_option("--activation_bytes,--activation-bytes", in->activation_bytes,
                  "Bytes autograd keeps for one micro-batch through the whole model (0: unknown)")
      ->default_val(0);
  cmd->callback([in] {
    if (in->num_parameters == 0 && in->layer_parameters.empty()) {
      throw CLI::ValidationError("--num_parameters",
                                 "give --num_parameters, or --layer_parameters for a pipeline's layers");
    }
    run_estimate(*in);
  });
}

}  // namespace accel::launcher
