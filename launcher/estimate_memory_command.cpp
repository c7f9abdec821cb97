// `accel-launch estimate-memory`: predicted per-rank bytes of parameters, gradients and optimizer state for a
// parameter count, world size, backend, stage, precision and optimizer (the layouts of accelerate-cpp itself,
// checked against measured runs by the test suite); with --pipeline_stages, per stage: the stage's share of
// the parameters (by the partition of --layer_parameters, else 1/p) and the schedule's activation bound. With
// --model_config and --max_length, a CausalLM step's activations (llm::estimate_activation_memory) and a
// total.
#include <accel/config/config.hpp>
#include <accel/llm/models/activation_memory.hpp>
#include <accel/llm/models/parameter_count.hpp>
#include <accel/monitor/memory.hpp>
#include <accel/trainer/model_arguments.hpp>
#include <accel/trainer/training_arguments.hpp>

#include "commands.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <filesystem>
#include <iostream>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace accel::launcher {
namespace {

// --model_config / --type: a Hugging Face config.json and a training type of config_templates/trainer/.
struct ModelOptions {
  std::string model_config, type, templates;
  /// Bytes of autograd's gradient of the trained embedding while it exists beside its bucket or shard (0
  /// when the embedding is frozen or the layout gathers units, whose own term counts it).
  std::uint64_t transient = 0;
  /// Bytes of a 4-bit base's parts that stay in the compute dtype (embedding, norms, biases, an untied head):
  /// added to the parameters, whole on every rank (a 4-bit base is never sharded).
  std::uint64_t full_precision_frozen = 0;
  /// ZeRO-3 with a frozen base in its dtype (LoRA): the bytes of the units gathered at once, counted module
  /// by module (per_module_gathered); 0: the library's bound stands.
  std::uint64_t module_gathered = 0;
  std::string module_gathered_note;  ///< what module_gathered counts, for the report
  /// Activations (--max_length): the step's shape; the batch and checkpointing come from the type's
  /// TrainingArguments unless given, the adapters and the dtype from its model file.
  llm::ActivationMemoryOptions activation;
  std::optional<llm::ActivationMemory> activations;  ///< set when --max_length and --model_config are given
  std::optional<llm::ModelConfig> config;            ///< the parsed --model_config
};

// Full fine-tuning trains the embedding: its [vocab, hidden] gradient exists, for a moment, as autograd made
// it beside the bucket or shard it moves into (DDP, ZeRO-1/2, SHARD_GRAD_OP), twice when the head is tied
// (the head's contribution waits in autograd's buffer while the lookup's dense gradient is formed). The
// layouts that gather units count it in their gathered units.
std::uint64_t embedding_transient(const MemoryEstimateInput& in, const llm::ParameterCount& count) {
  const bool gathers = (in.backend == "zero" && in.zero_stage == 3) ||
                       (in.backend == "fsdp" && in.fsdp_sharding_strategy != "SHARD_GRAD_OP" &&
                        in.fsdp_sharding_strategy != "NO_SHARD");
  if (gathers) return 0;
  return static_cast<std::uint64_t>(count.embedding) * 4 * (count.lm_head == 0 ? 2 : 1);
}

// ZeRO-3 gathers module by module (make_zero_engine: UnitPolicy::PerModule, DeepSpeed's granularity: each
// module's own parameters are a unit), and backends/zero/full_shard_backend.cpp's touch() releases every unit
// but the ones an operator uses and the one it prefetches: two different modules are whole at once. The
// largest, the embedding (or an untied head), is used next to the first block's modules (in forward; backward
// never gathers a frozen embedding) or the final norm (the head), never next to the other of the two: the
// largest unit plus a block's largest Linear (two of a block's Linears are the most otherwise), in the frozen
// base's dtype. Measured (bench/llm/memory_check.py, BENCHMARKS.md): one embedding above the state. The
// adapters are units of their own (fp32); each one's gradient buffer is reduce-scattered once its gradient
// is complete (one filling, one in flight): twice the largest LoRA matrix. The library's term
// (estimate_memory) knows no module sizes and counts the largest unit twice and a gradient buffer for every
// adapter: one unit too many here (Qwen2.5-1.5B: 0.93 GB).
void per_module_gathered(const MemoryEstimateInput& in, const llm::ParameterCount& count,
                         std::int64_t lora_matrix, ModelOptions& mo) {
  const bool four_bit = in.frozen_dtype == "4bit" || in.frozen_dtype == "4bit_single";
  if (in.backend != "zero" || in.zero_stage != 3 || in.frozen_parameters == 0 || four_bit) return;
  const std::uint64_t element = in.frozen_dtype == "fp32" ? 4 : 2;
  const auto largest =
      static_cast<std::uint64_t>(std::max({count.embedding, count.lm_head, count.largest_projection}));
  const auto beside = static_cast<std::uint64_t>(count.largest_projection);
  const auto adapter = static_cast<std::uint64_t>(lora_matrix);
  mo.module_gathered = element * (largest + beside) + 2 * 4 * adapter;
  mo.module_gathered_note = fmt::format(
      "ZeRO-3 gathers module by module: the largest unit ({} elements) and a block's largest Linear ({}) "
      "whole at once in {}, and two adapter gradient buffers of at most {} elements in fp32",
      largest, beside, in.frozen_dtype, adapter);
}

// The optimizer of a TrainingArguments `optim` as the estimate counts it (8-bit states are not modelled).
std::string estimate_optimizer(const std::string& optim) {
  if (optim.rfind("adamw", 0) == 0 && optim.find("8bit") == std::string::npos) return "adamw";
  if (optim == "sgd") return "sgd";
  if (optim == "adagrad") return "adagrad";
  if (optim == "rmsprop") return "rmsprop";
  throw ConfigError("estimate-memory: the training type's optim '" + optim +
                    "' is not modelled by the estimate (its 8-bit or paged state); give --optimizer instead");
}

// Fills `in` from the model's config.json (sizes) and, with --type, the type's three files (layout,
// adapters, optimizer), as `accel-launch train -t TYPE` would run them; explicit options given on the
// command line win.
void apply_model(MemoryEstimateInput& in, ModelOptions& mo, const CLI::App& cmd) {
  namespace fs = std::filesystem;
  mo.config = llm::ModelConfig::from_file(mo.model_config);
  const auto& config = *mo.config;
  const auto count = llm::count_parameters(config);
  auto given = [&](const char* option) { return cmd.count(option) > 0; };
  if (!given("--largest_unit_parameters"))
    in.largest_unit_parameters = static_cast<std::uint64_t>(count.largest_unit());
  in.num_parameters = static_cast<std::uint64_t>(count.total());
  std::cout << fmt::format(
      "Model: {} ({}), {} parameters: {} layers of {}, embedding {}{}\n", mo.model_config,
      config.architecture(), count.total(), config.num_hidden_layers, count.per_layer, count.embedding,
      count.lm_head > 0 ? fmt::format(", lm_head {}", count.lm_head) : std::string(" (tied head)"));
  if (mo.type.empty()) return;
  const fs::path dir = fs::path(config_templates_dir(mo.templates)) / "trainer";
  const Config layout = Config::load_file((dir / (mo.type + ".accelerate.yaml")).string());
  if (!given("--backend")) in.backend = layout.backend;
  if (!given("--zero_stage")) in.zero_stage = layout.zero.stage;
  if (!given("--fsdp_sharding_strategy"))
    in.fsdp_sharding_strategy = to_string(layout.fsdp.sharding_strategy);
  if (!given("--offload_optimizer")) in.offload_optimizer = to_string(layout.zero.offload_optimizer_device);
  if (!given("--offload_param")) in.offload_param = to_string(layout.zero.offload_param_device);
  if (!given("--mixed_precision")) in.mixed_precision = to_string(layout.mixed_precision);
  if (!given("--num_processes")) in.num_processes = layout.num_processes;
  const auto args = TrainingArguments::load_file((dir / (mo.type + ".yaml")).string());
  if (!given("--optimizer")) in.optimizer = estimate_optimizer(args.optim);
  if (!given("--per_device_train_batch_size"))
    mo.activation.micro_batch_size = args.per_device_train_batch_size;
  if (!given("--gradient_checkpointing")) mo.activation.gradient_checkpointing = args.gradient_checkpointing;
  const fs::path model_file = dir / (mo.type + ".model.yaml");
  mo.transient = embedding_transient(in, count);
  if (!fs::exists(model_file)) return;
  const auto model = ModelArguments::load_file(model_file.string());
  if (model.dtype == "bfloat16" || model.dtype == "float16") mo.activation.dtype = model.dtype;
  if (!model.use_peft) return;
  mo.transient = 0;  // the base (the embedding with it) is frozen
  std::vector<std::string> targets = model.lora_target_modules;
  if (model.lora_target_modules_string) targets = {*model.lora_target_modules_string};
  mo.activation.lora_target_modules = targets;
  mo.activation.lora_r = model.lora_r;
  mo.activation.lora_dropout = model.lora_dropout;
  in.num_parameters = static_cast<std::uint64_t>(llm::count_lora_parameters(config, targets, model.lora_r));
  in.frozen_parameters = static_cast<std::uint64_t>(count.total());
  const std::uint64_t dtype_bytes = model.dtype == "bfloat16" || model.dtype == "float16" ? 2 : 4;
  if (!given("--frozen_dtype")) {
    in.frozen_dtype = model.load_in_4bit          ? (model.use_bnb_nested_quant ? "4bit" : "4bit_single")
                      : model.dtype == "bfloat16" ? "bf16"
                      : model.dtype == "float16"  ? "fp16"
                                                  : "fp32";
  }
  if (model.load_in_4bit && !given("--frozen_parameters")) {
    // load_in_4bit quantises the blocks' projection weights only (as bitsandbytes through transformers); the
    // embedding (a quarter of Qwen2.5-0.5B), norms, biases and an untied head stay in `dtype`.
    in.frozen_parameters = static_cast<std::uint64_t>(count.projection_weights);
    mo.full_precision_frozen =
        static_cast<std::uint64_t>(count.total() - count.projection_weights) * dtype_bytes;
  }
  per_module_gathered(in, count, llm::largest_lora_matrix(config, targets, model.lora_r), mo);
  std::cout << fmt::format(
      "Training type {}: {} on {} rank(s), LoRA r {} on {}: {} trainable, the base frozen "
      "in {}{}\n",
      mo.type, describe_backend(in), in.num_processes, model.lora_r, fmt::join(targets, ","),
      in.num_parameters, in.frozen_dtype,
      mo.full_precision_frozen > 0
          ? fmt::format(" ({} projection weights; the other {} elements in {}: {} bytes)",
                        in.frozen_parameters, count.total() - count.projection_weights, model.dtype,
                        mo.full_precision_frozen)
          : std::string());
}

std::string bytes_line(const MemoryReport& r) {
  return fmt::format(
      "parameters={} gradients={} optimizer_state={} total={}{}", r.parameters, r.gradients,
      r.optimizer_state, r.total(),
      (r.nvme > 0 ? fmt::format(" nvme={}", r.nvme) : std::string()) +
          (r.nvme_parameters > 0 ? fmt::format(" nvme_parameters={}", r.nvme_parameters) : std::string()) +
          (r.gathered > 0 ? fmt::format(" gathered={}", r.gathered) : std::string()));
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

double mib(std::uint64_t bytes) {
  return static_cast<double>(bytes) / (1024.0 * 1024.0);
}

// With --max_length: the step's activations (llm::estimate_activation_memory) and the total with them; else
// how to include them. The units gathered (ZeRO-3) are whole while activations live; the embedding's
// transient gradient comes at the end of backward, after the blocks' activations are freed: the larger of the
// two.
void print_activations(const MemoryEstimateInput& in, const ModelOptions& mo, const MemoryReport& r,
                       std::uint64_t gathered, std::uint64_t transient) {
  if (!mo.activations) {
    std::cout << "Activations are not included (what autograd keeps for backward; Hugging Face Accelerate's "
                 "and DeepSpeed's estimators leave them out too): give --max_length (tokens per row) with "
                 "--model_config, and --per_device_train_batch_size / --gradient_checkpointing where the "
                 "type's differ\n";
    return;
  }
  const auto& a = *mo.activations;
  const auto& o = mo.activation;
  const bool full = o.lora_target_modules.empty();
  std::cout << fmt::format(
      "activations: {} row(s) of {} tokens, {}, {}, gradient checkpointing {}: {} blocks keeping {:.3f} MiB "
      "each{}, the final norm, rotary tables and the loss's gradient of the hidden states {:.3f} MiB; then "
      "the "
      "larger of the fused loss's working set ({} rows of float32 logits: {:.3f} MiB) and {}: peak {:.3f} "
      "MiB\n",
      o.micro_batch_size, o.sequence_length, o.dtype,
      full ? std::string("full fine-tuning")
           : fmt::format("LoRA r {} on {} with dropout {}", o.lora_r, fmt::join(o.lora_target_modules, ","),
                         o.lora_dropout),
      o.gradient_checkpointing ? "on" : "off", a.layers, mib(a.per_block),
      a.first_block != a.per_block ? fmt::format(" (the first {:.3f} MiB)", mib(a.first_block))
                                   : std::string(),
      mib(a.head), a.chunk_rows, mib(a.loss_working),
      o.gradient_checkpointing
          ? fmt::format("one block recomputed in backward ({:.3f} MiB)", mib(a.recompute))
          : std::string("nothing recomputed"),
      mib(a.peak()));
  if (in.mixed_precision != "no")
    std::cout << "(mixed precision " << in.mixed_precision
              << ": activations are counted in the model's dtype, " << o.dtype
              << "; autocast's half-precision copies are not modelled)\n";
  std::cout << fmt::format(
      "total with activations{}: {:.3f} MiB\n",
      gathered > 0    ? " and the units gathered"
      : transient > 0 ? " (the embedding's transient gradient comes after them: the larger of the two)"
                      : "",
      mib(r.total() + gathered + std::max(transient, a.peak())));
}

void run_estimate(const MemoryEstimateInput& in, const ModelOptions& mo) {
  const std::uint64_t transient = mo.transient;
  const auto stages = estimate_pipeline_memory(in);
  auto r = estimate_memory(in);
  r.parameters += mo.full_precision_frozen;
  if (r.gathered > 0 && mo.module_gathered > 0) {
    r.gathered = mo.module_gathered;
    std::cout << mo.module_gathered_note << "\n";
  }
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
  std::cout << r.to_string() << "\n";
  if (transient > 0) {
    std::cout << fmt::format(
        "while training, autograd's gradient of the embedding beside its bucket or shard (twice with a tied "
        "head; not in total): {:.3f} MiB\n",
        static_cast<double>(transient) / (1024.0 * 1024.0));
  }
  const std::uint64_t gathered = in.pipeline_stages > 1 ? 0 : r.gathered;
  print_activations(in, mo, r, gathered, transient);
  std::cout << "bytes: " << bytes_line(r) << (transient > 0 ? fmt::format(" transient={}", transient) : "")
            << (mo.activations ? fmt::format(" activations={}", mo.activations->peak()) : "") << "\n";
}

}  // namespace

void setup_estimate_memory_command(CLI::App& app) {
  auto in = std::make_shared<MemoryEstimateInput>();
  auto* cmd = app.add_subcommand("estimate-memory",
                                 "Predict per-rank bytes of parameters, gradients and optimizer state "
                                 "(with --model_config and --max_length, also the step's activations)");
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
  cmd->add_option(
      "--frozen_parameters,--frozen-parameters", in->frozen_parameters,
      "Frozen elements beside the trainable ones (the base of LoRA/QLoRA: then --num_parameters "
      "is the adapters'): whole on every rank, or 1/N of them where the backend shards parameters "
      "(ZeRO-3, FULL_SHARD; a 4-bit base is never sharded)");
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
  auto model = std::make_shared<ModelOptions>();
  cmd->add_option("--model_config,--model-config", model->model_config,
                  "A Hugging Face config.json (Llama, Qwen2, Qwen3): the parameter counts come from it");
  cmd->add_option("--type,-t", model->type,
                  "With --model_config: a training type of config_templates/trainer/ (full, lora, qlora, "
                  "deepspeed, stage2_offload, stage3, minimal): its backend, ranks, adapters and optimizer; "
                  "options given here win");
  cmd->add_option("--templates", model->templates,
                  "Directory holding trainer/<type>.* (as accel-launch train)");
  cmd->add_option("--max_length,--max-length,--seq_length,--seq-length", model->activation.sequence_length,
                  "With --model_config: tokens per row (TRL's max_length): adds the step's activations (what "
                  "autograd keeps for backward, with the fused loss) and a total with them. Without it the "
                  "estimate is the training state only, as Hugging Face Accelerate's estimate-memory and "
                  "DeepSpeed's estimate_zero*_model_states_mem_needs count");
  cmd->add_option("--per_device_train_batch_size,--per-device-train-batch-size",
                  model->activation.micro_batch_size,
                  "Rows per forward for the activations (default: the type's TrainingArguments, else 1)");
  cmd->add_flag(
      "--gradient_checkpointing,--gradient-checkpointing", model->activation.gradient_checkpointing,
      "Activations with gradient checkpointing (=false to turn the type's off; default: the type's)");
  cmd->callback([in, model, cmd] {
    if (!model->model_config.empty()) {
      apply_model(*in, *model, *cmd);
      if (cmd->count("--max_length") > 0) {
        if (in->pipeline_stages > 1)
          throw CLI::ValidationError("--max_length",
                                     "a pipeline's stages hold different micro-batches: give "
                                     "--activation_bytes and --micro_batches instead");
        model->activations = llm::estimate_activation_memory(*model->config, model->activation);
      }
    } else if (!model->type.empty() || cmd->count("--max_length") > 0) {
      throw CLI::ValidationError(model->type.empty() ? "--max_length" : "--type",
                                 "give the model's config.json with --model_config too");
    }
    if (in->num_parameters == 0 && in->layer_parameters.empty()) {
      throw CLI::ValidationError("--num_parameters",
                                 "give --num_parameters, or --layer_parameters for a pipeline's layers");
    }
    run_estimate(*in, *model);
  });
}

}  // namespace accel::launcher
