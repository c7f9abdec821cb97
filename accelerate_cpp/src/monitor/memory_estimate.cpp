#include <accel/errors.hpp>
#include <accel/monitor/memory.hpp>
#include <accel/parallel/pipeline_schedule.hpp>

#include "config/config_detail.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <numeric>

namespace accel {
namespace {

// Per-rank state of `params` elements on `ranks` data-parallel ranks, sharded as `layout` says.
MemoryReport state_memory(std::uint64_t params, int ranks, int states, const BackendCapabilities& layout) {
  const std::uint64_t p = params, n = static_cast<std::uint64_t>(ranks);
  const std::uint64_t s = (p + n - 1) / n;  // elements per shard
  constexpr std::uint64_t kFloat = 4;  // fp32 weights, gradients and optimizer state (autocast keeps them)
  MemoryReport r;
  if (layout.shards_parameters && n > 1) {
    // At rest only the slices exist (units are gathered while they compute; not counted here).
    r.parameters = kFloat * s;
    r.gradients = kFloat * s;
    r.optimizer_state = kFloat * s * static_cast<std::uint64_t>(states);
  } else if (layout.shards_optimizer_state && n > 1) {
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

ConfigError field_error(const std::string& field, const std::string& message) {
  return ConfigError("estimate-memory: " + message, {}, 0, field);
}

// The config the estimate's backend fields describe (`--backend zero --zero_stage 2`): its layout then comes
// from the backend's fact sheet. ConfigError naming an unknown backend or a bad backend field.
Config estimate_config(const MemoryEstimateInput& in) {
  const config_detail::BackendPart* part = config_detail::find_part(in.backend);
  if (part == nullptr) {
    std::string names;
    for (const BackendInfo& info : config_backends())
      names += (names.empty() ? "" : ", ") + info.name;
    throw ConfigError(fmt::format("estimate-memory: unknown backend '{}'; allowed: {}", in.backend, names),
                      {}, 0, "backend");
  }
  Config c;
  c.backend = in.backend;
  if (part->estimate_config) part->estimate_config(in, c);
  return c;
}

}  // namespace

std::string MemoryReport::to_string() const {
  auto mib = [](std::uint64_t b) { return static_cast<double>(b) / (1024.0 * 1024.0); };
  return fmt::format(
      "parameters: {:.3f} MiB\ngradients: {:.3f} MiB\noptimizer state: {:.3f} MiB\ntotal: {:.3f} MiB{}",
      mib(parameters), mib(gradients), mib(optimizer_state), mib(total()),
      (nvme > 0 ? fmt::format("\noptimizer state on NVMe (files, not memory): {:.3f} MiB", mib(nvme))
                : std::string()) +
          (nvme_parameters > 0 ? fmt::format("\nparameter shards on NVMe (files, not memory): {:.3f} MiB",
                                             mib(nvme_parameters))
                               : std::string()) +
          (gathered > 0 ? fmt::format("\nwhile training, units gathered at once (not in total): {:.3f} MiB\n"
                                      "peak while training, activations aside: {:.3f} MiB",
                                      mib(gathered), mib(peak()))
                        : std::string()));
}

namespace {

// The number of optimizer state tensors per parameter; ConfigError for an unknown optimizer.
int optimizer_states(const MemoryEstimateInput& in) {
  if (in.optimizer == "adam" || in.optimizer == "adamw") return 2;
  if (in.optimizer == "sgd_momentum" || in.optimizer == "rmsprop" || in.optimizer == "adagrad") return 1;
  if (in.optimizer != "sgd") {
    throw ConfigError(fmt::format("estimate-memory: unknown optimizer '{}'; allowed: adam, adamw, sgd, "
                                  "sgd_momentum, rmsprop, adagrad",
                                  in.optimizer),
                      {}, 0, "optimizer");
  }
  return 0;
}

void check_mixed_precision(const MemoryEstimateInput& in) {
  if (in.mixed_precision != "no" && in.mixed_precision != "bf16" && in.mixed_precision != "fp16") {
    throw ConfigError(fmt::format("estimate-memory: invalid mixed_precision '{}'; allowed: no, fp16, bf16",
                                  in.mixed_precision),
                      {}, 0, "mixed_precision");
  }
}

// pipeline_stages, then whether the backend's layout allows a pipeline, then micro_batches.
void check_pipeline_fields(const MemoryEstimateInput& in, const Config& config,
                           const BackendCapabilities& layout) {
  const int p = in.pipeline_stages;
  if (p < 1 || in.num_processes % p != 0) {
    throw field_error(
        "pipeline_stages",
        fmt::format("pipeline_stages ({}) must be at least 1 and divide num_processes ({}): each "
                    "stage runs on num_processes / pipeline_stages data-parallel ranks",
                    p, in.num_processes));
  }
  if (p > 1 && (layout.shards_parameters || layout.shards_gradients)) {
    throw field_error("backend",
                      fmt::format("backend {} shards gradients or parameters, which a pipeline refuses (as "
                                  "DeepSpeed: it would reduce them once per micro-batch); estimate with {}",
                                  describe_layout(config),
                                  layouts_where(
                                      [](const BackendCapabilities& s) {
                                        return !s.shards_gradients && !s.shards_parameters;
                                      },
                                      LayoutSpelling::Flags)));
  }
  if (in.micro_batches < 0) {
    throw field_error("micro_batches",
                      fmt::format("micro_batches must be 0 (unknown) or more, got {}", in.micro_batches));
  }
}

pipeline::Schedule estimate_schedule(const MemoryEstimateInput& in) {
  try {
    return pipeline::parse_schedule(in.pipeline_schedule);
  } catch (const ConfigError&) {
    throw field_error("pipeline_schedule",
                      fmt::format("pipeline_schedule '{}' is not one of 1f1b, gpipe", in.pipeline_schedule));
  }
}

// How the model's parameters fall on the stages: the total, and the stage boundaries when the layers'
// parameter counts were given.
struct StageSplit {
  std::uint64_t total = 0;
  std::vector<int> boundaries;  // empty: no layers given
};

StageSplit split_stages(const MemoryEstimateInput& in, int p) {
  StageSplit split;
  split.total = in.num_parameters;
  const auto& layers = in.layer_parameters;
  if (layers.empty()) return split;
  const std::uint64_t sum = std::accumulate(layers.begin(), layers.end(), std::uint64_t{0});
  if (split.total == 0) split.total = sum;
  if (sum != split.total) {
    throw field_error("layer_parameters",
                      fmt::format("the layer parameter counts add up to {}, but num_parameters is {}; give "
                                  "both for the same model (or leave num_parameters out)",
                                  sum, split.total));
  }
  if (static_cast<int>(layers.size()) < p) {
    throw field_error("layer_parameters", fmt::format("{} layer(s) cannot fill {} pipeline stages; give one "
                                                      "parameter count per layer of the Sequential",
                                                      layers.size(), p));
  }
  const auto method = pipeline::parse_partition(in.partition);
  if (method.kind == pipeline::PartitionMethod::Kind::Type) {
    throw field_error("partition",
                      fmt::format("partition '{}' needs the layers' type names, which estimate-memory does "
                                  "not know; give the boundaries it yields (e.g. 0,3,6) instead",
                                  in.partition));
  }
  const std::vector<std::int64_t> weights(layers.begin(), layers.end());
  split.boundaries = pipeline::partition(method, weights, std::vector<std::string>(layers.size()), p);
  return split;
}

StageMemoryEstimate estimate_stage(const MemoryEstimateInput& in, int s, const StageSplit& split, int states,
                                   const BackendCapabilities& layout, pipeline::Schedule schedule) {
  const int p = in.pipeline_stages;
  const int ranks = in.num_processes / p;
  const auto pp = static_cast<std::uint64_t>(p);
  const auto& layers = in.layer_parameters;
  StageMemoryEstimate e;
  const auto su = static_cast<std::uint64_t>(s);
  if (split.boundaries.empty()) {
    e.num_parameters = split.total / pp + (su < split.total % pp ? 1 : 0);
  } else {
    e.first_layer = split.boundaries[su];
    e.end_layer = split.boundaries[su + 1];
    e.num_parameters =
        std::accumulate(layers.begin() + e.first_layer, layers.begin() + e.end_layer, std::uint64_t{0});
  }
  // Hybrid sharding splits the state over one shard group's ranks: a machine's, or hybrid_shard_size (checked
  // to divide in estimate_pipeline_memory).
  const int shard_ranks = in.hybrid_shard_size > 0 ? in.hybrid_shard_size : ranks / in.num_machines;
  e.state = state_memory(e.num_parameters, layout.shards_per_machine ? shard_ranks : ranks, states, layout);
  const int m = in.micro_batches;
  e.live_micro_batches = schedule == pipeline::Schedule::GPipe ? m : m > 0 ? std::min(p - s, m) : p - s;
  if (p == 1) e.live_micro_batches = 1;  // no pipeline: each micro-batch's backward runs before the next
  if (in.activation_bytes > 0) {
    // The stage's share of one micro-batch's activations: its layers' share, or 1/p.
    const double share = split.boundaries.empty() ? 1.0 / p
                                                  : static_cast<double>(e.end_layer - e.first_layer) /
                                                        static_cast<double>(layers.size());
    e.activation_bytes = static_cast<std::uint64_t>(static_cast<double>(in.activation_bytes) * share + 0.5) *
                         static_cast<std::uint64_t>(e.live_micro_batches);
  }
  return e;
}

}  // namespace

std::vector<StageMemoryEstimate> estimate_pipeline_memory(const MemoryEstimateInput& in) {
  if (in.num_processes < 1) {
    throw ConfigError(
        fmt::format("estimate-memory: num_processes must be at least 1, got {}", in.num_processes), {}, 0,
        "num_processes");
  }
  const int states = optimizer_states(in);
  check_mixed_precision(in);
  // The layout comes from the backend's fact sheet (backends/<name>/<name>_config.cpp).
  const Config config = estimate_config(in);
  const BackendCapabilities layout = sharding_of(config);
  check_pipeline_fields(in, config, layout);
  if (in.num_machines < 1 || (in.num_processes / in.pipeline_stages) % in.num_machines != 0) {
    throw field_error(
        "num_machines",
        fmt::format("num_machines ({}) must be at least 1 and divide the data-parallel ranks ({}): "
                    "every machine runs the same number of processes",
                    in.num_machines, in.num_processes / in.pipeline_stages));
  }
  if (in.hybrid_shard_size < 0 ||
      (in.hybrid_shard_size > 0 && (in.num_processes / in.pipeline_stages) % in.hybrid_shard_size != 0)) {
    throw field_error("hybrid_shard_size",
                      fmt::format("hybrid_shard_size ({}) must be 0 (one machine's ranks) or divide the "
                                  "data-parallel ranks ({})",
                                  in.hybrid_shard_size, in.num_processes / in.pipeline_stages));
  }
  const pipeline::Schedule schedule = estimate_schedule(in);
  const int p = in.pipeline_stages;
  const StageSplit split = split_stages(in, p);
  std::vector<StageMemoryEstimate> stages;
  stages.reserve(static_cast<std::size_t>(p));
  for (int s = 0; s < p; ++s)
    stages.push_back(estimate_stage(in, s, split, states, layout, schedule));
  return stages;
}

std::string describe_backend(const MemoryEstimateInput& in) {
  if (config_detail::find_part(in.backend) == nullptr) return in.backend;
  return describe_layout(estimate_config(in));
}

std::uint64_t frozen_bytes(const MemoryEstimateInput& in) {
  if (in.frozen_parameters == 0) return 0;
  // Bytes per frozen element, x 1e4 (accel::quant's measured 0.5159 and 0.5625 for the 4-bit forms).
  std::uint64_t per_10k = 0;
  if (in.frozen_dtype == "fp32")
    per_10k = 40000;
  else if (in.frozen_dtype == "bf16" || in.frozen_dtype == "fp16")
    per_10k = 20000;
  else if (in.frozen_dtype == "4bit")
    per_10k = 5159;
  else if (in.frozen_dtype == "4bit_single")
    per_10k = 5625;
  else
    throw field_error("frozen_dtype", fmt::format("frozen_dtype '{}' is not one of fp32, bf16, fp16, 4bit "
                                                  "(NF4/FP4 with double quantisation), 4bit_single",
                                                  in.frozen_dtype));
  return (in.frozen_parameters * per_10k + 9999) / 10000;
}

// The frozen base's bytes on one rank: whole, except under a layout that shards parameters (ZeRO-3,
// FULL_SHARD, HYBRID_SHARD), which shards frozen parameters too, over the shard group's ranks (DeepSpeed's
// ZeRO-3 and FSDP do). A 4-bit base is buffers (accel::quant), never sharded: whole on every rank.
struct FrozenShare {
  std::uint64_t held = 0;
  bool sharded = false;
};

FrozenShare frozen_held(const MemoryEstimateInput& in) {
  const auto bytes = frozen_bytes(in);
  const BackendCapabilities layout = sharding_of(estimate_config(in));
  const int ranks = in.num_processes / in.pipeline_stages;
  const int shard_ranks = !layout.shards_per_machine ? ranks
                          : in.hybrid_shard_size > 0 ? in.hybrid_shard_size
                                                     : ranks / in.num_machines;
  const bool four_bit = in.frozen_dtype == "4bit" || in.frozen_dtype == "4bit_single";
  if (!layout.shards_parameters || shard_ranks <= 1 || four_bit) return {bytes, false};
  const auto n = static_cast<std::uint64_t>(shard_ranks);
  return {(bytes + n - 1) / n, true};
}

// Elements of the largest unit a stage-3 or FULL_SHARD layout gathers: --largest_unit_parameters, else the
// largest of --layer_parameters, else 0 (unknown).
std::uint64_t largest_unit(const MemoryEstimateInput& in) {
  std::uint64_t unit = in.largest_unit_parameters;
  for (const auto l : in.layer_parameters)
    if (in.largest_unit_parameters == 0) unit = std::max(unit, l);
  return unit;
}

// Bytes a stage-3 / FULL_SHARD rank holds at once in gathered units (backends/zero/full_shard_backend.cpp):
// touch() releases every unpinned unit except the one it prefetches before gathering, so two units are
// whole at once (the one computing, the next one prefetched), and on_grad() accumulates a unit's gradients
// into a flat buffer of the unit's whole size until its reduce-scatter. Trainable: 3 x the largest unit in
// fp32. A unit's frozen parameters (requires_grad false at prepare: a LoRA base) form flat vectors of their
// own that are gathered in their dtype and never get a gradient buffer, so with a frozen base the largest
// unit counts twice in the frozen dtype, and its gradient buffer holds at most the trainable parameters. A
// 4-bit base is buffers, never sharded nor gathered: only the trainable parameters are.
std::uint64_t gathered_units(const MemoryEstimateInput& in) {
  const std::uint64_t unit = largest_unit(in);
  if (in.frozen_parameters == 0) return 3 * 4 * unit;
  const std::uint64_t trainable = std::min(unit, in.num_parameters);
  const bool four_bit = in.frozen_dtype == "4bit" || in.frozen_dtype == "4bit_single";
  if (four_bit) return 3 * 4 * trainable;
  const std::uint64_t frozen_element = in.frozen_dtype == "fp32" ? 4 : 2;
  return 2 * frozen_element * unit + 4 * trainable;
}

MemoryReport estimate_memory(const MemoryEstimateInput& in) {
  const auto stages = estimate_pipeline_memory(in);
  auto r = std::max_element(stages.begin(), stages.end(), [](const auto& a, const auto& b) {
             return a.state.total() < b.state.total();
           })->state;
  const auto frozen = frozen_held(in);
  r.parameters += frozen.held;
  if (in.offload_optimizer == "nvme") {
    if (in.backend != "zero" || in.zero_stage < 1) {
      throw field_error("offload_optimizer",
                        "offload_optimizer nvme needs --backend zero with --zero_stage 1, 2 "
                        "or 3");
    }
    if (in.nvme_buffer_count < 2)
      throw field_error("nvme_buffer_count", "nvme_buffer_count must be at least 2");
    // The state moves to the files; memory keeps the buffers of a few sub-groups (the one stepped, one read
    // ahead, the rest written behind), each a sub-group's slice of every state tensor.
    const auto states = static_cast<std::uint64_t>(optimizer_states(in));
    const auto n = static_cast<std::uint64_t>(in.num_processes);
    const std::uint64_t slice = (std::max<std::uint64_t>(in.sub_group_size, 1) + n - 1) / n;
    const std::uint64_t buffers = static_cast<std::uint64_t>(in.nvme_buffer_count) * states * slice * 4;
    r.nvme = r.optimizer_state;
    r.optimizer_state = std::min(r.optimizer_state, buffers);
  } else if (in.offload_optimizer != "none" && in.offload_optimizer != "cpu") {
    throw field_error("offload_optimizer", fmt::format("offload_optimizer '{}' is not one of none, cpu, nvme",
                                                       in.offload_optimizer));
  }
  if (in.offload_param == "nvme") {
    if (in.backend != "zero" || in.zero_stage != 3)
      throw field_error("offload_param", "offload_param nvme needs --backend zero with --zero_stage 3");
    if (in.param_nvme_buffer_count < 2)
      throw field_error("param_nvme_buffer_count", "param_nvme_buffer_count must be at least 2");
    // The shards move to the files; memory keeps a few of them (the unit gathered, the next read ahead, the
    // step's writes behind), each at most the largest unit's shard: from --largest_unit_parameters, else
    // the largest of --layer_parameters, else unknown (then counted whole, an upper bound).
    const std::uint64_t unit = largest_unit(in);
    const std::uint64_t shards = r.parameters - (frozen.sharded ? 0 : frozen.held);
    const auto n = static_cast<std::uint64_t>(in.num_processes);
    const std::uint64_t buffers =
        unit > 0 ? static_cast<std::uint64_t>(in.param_nvme_buffer_count) * ((unit + n - 1) / n) * 4 : shards;
    r.nvme_parameters = shards;
    r.parameters -= shards - std::min(shards, buffers);
  } else if (in.offload_param != "none" && in.offload_param != "cpu") {
    throw field_error("offload_param",
                      fmt::format("offload_param '{}' is not one of none, cpu, nvme", in.offload_param));
  }
  // The units gathered while training (the layout's fact sheet says whether it gathers any).
  if (sharding_of(estimate_config(in)).shards_parameters && in.num_processes / in.pipeline_stages > 1)
    r.gathered = gathered_units(in);
  return r;
}

}  // namespace accel
