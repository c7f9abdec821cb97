#pragma once
/// \file config.hpp
/// The run configuration of accelerate-cpp: a plain struct with defaults for everything, read from and
/// written to YAML. Keys follow Hugging Face Accelerate's `default_config.yaml` where the concept is the
/// same, so a file written by `accelerate config` loads as is (or fails with a message naming the file, line,
/// key and fix).
///
/// Example:
/// \code
///   accel::Config config = accel::Config::load_file("accelerate.yaml");  // throws accel::ConfigError
///   if (config.backend == "fsdp") { ... }
///   config.num_processes = 4;
///   config.save_file("out/accelerate.yaml");
/// \endcode
///
/// This header is torch-free and does not include yaml-cpp or fmt. Nothing here is collective: every function
/// is local to the calling process.

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "accel/errors.hpp"
#include "accel/parallel/pipeline_schedule.hpp"

namespace accel {

class Questions;
struct Config;

/// Mixed precision mode (`mixed_precision:` `no|fp16|bf16`). fp16 uses dynamic loss scaling.
enum class MixedPrecision { No, Fp16, Bf16 };

/// Gradient compression on the wire (`ddp_comm_hook`, Accelerate's DDPCommunicationHookType names): gradients
/// are divided by the number of processes, cast to fp16 or bf16 for the reduction, and cast back, as
/// PyTorch's `fp16_compress_hook` / `bf16_compress_hook`. Halves the bytes of every gradient reduction (DDP's
/// all-reduce, ZeRO's and FSDP's reduce-scatter) at the cost of the cast's rounding. `power_sgd` (DDP only)
/// is PyTorch's `powerSGD_hook`: each gradient matrix travels as two rank-r factors, with error feedback and
/// warm start, after `ddp_comm_powersgd_start_iter` plain steps.
enum class CommHook { No, Fp16, Bf16, PowerSgd };

/// FSDP sharding strategy (`fsdp_sharding_strategy:`; Accelerate's numeric forms 1-5 are accepted too).
enum class ShardingStrategy {
  FullShard,  ///< parameters, gradients and optimizer state sharded; parameters freed after forward (ZeRO-3)
  ShardGradOp,  ///< gradients and optimizer state sharded; parameters kept after forward (ZeRO-2)
  NoShard,      ///< nothing sharded (DDP-like)
  /// FULL_SHARD over the ranks of each machine, every machine a replica (PyTorch FSDP's HYBRID_SHARD):
  /// gradients are reduce-scattered inside the machine, then each shard all-reduced across machines.
  HybridShard,
  /// SHARD_GRAD_OP over the ranks of each machine, every machine a replica (FSDP's _HYBRID_SHARD_ZERO2).
  HybridShardZero2
};

/// How the model is cut into FSDP units (`fsdp_auto_wrap_policy:`).
enum class AutoWrapPolicy {
  TransformerBasedWrap,  ///< one unit per module whose `name()` is in `transformer_layer_cls_to_wrap`
  SizeBasedWrap,         ///< units of at least `min_num_params` parameters
  NoWrap,                ///< the whole model is one unit
  PerChildWrap           ///< (accelerate-cpp only) one unit per direct child module
};

/// When the next FSDP unit's parameters are gathered during backward (`fsdp_backward_prefetch:`).
enum class BackwardPrefetch { BackwardPre, BackwardPost, NoPrefetch };

/// What `save_state` writes for FSDP models (`fsdp_state_dict_type:`).
enum class StateDictType {
  FullStateDict,    ///< one consolidated file written by rank 0
  ShardedStateDict  ///< one shard per rank
};

/// Where ZeRO offloads optimizer state or parameters (`offload_*_device:`). `nvme` (DeepSpeed's
/// ZeRO-Infinity) is taken for the optimizer state; parameters on NVMe are not supported.
enum class OffloadDevice { None, Cpu, Nvme };

/// Settings of the `fsdp` backend (YAML section `fsdp_config:`, keys prefixed `fsdp_`).
/// `pipeline_config:` section: pipeline parallelism (`<accel/parallel/pipeline.hpp>`,
/// `accelerator.pipeline_step`).
struct PipelineConfig {
  /// `stages`: pipeline stages (1: no pipeline). num_processes must be a multiple of it: num_processes /
  /// stages data-parallel replicas of the pipeline, rank = stage x replicas + replica.
  int stages = 1;
  /// `micro_batches`: micro-batches per optimizer step; 0 means gradient_accumulation_steps.
  int micro_batches = 0;
  /// `schedule`: `1f1b` (PipeDream-flush, at most stages - s micro-batches of activations on stage s) or
  /// `gpipe` (all forwards, then all backwards).
  pipeline::Schedule schedule = pipeline::Schedule::OneFOneB;
  /// `partition`: `parameters` (balanced by parameter count), `uniform`, `type:<regex>` or boundaries such
  /// as `0,3,6`.
  std::string partition = "parameters";
  bool operator==(const PipelineConfig& o) const {
    return stages == o.stages && micro_batches == o.micro_batches && schedule == o.schedule &&
           partition == o.partition;
  }
  bool operator!=(const PipelineConfig& o) const { return !(*this == o); }
};

struct FsdpConfig {
  /// `fsdp_sharding_strategy`. Accelerate's key `fsdp_reshard_after_forward` maps onto it: FSDP2's true ->
  /// FULL_SHARD, false -> SHARD_GRAD_OP, or FSDP1's strategy name (`FULL_SHARD`, what current
  /// `accelerate config` writes for FSDP1) -> that strategy.
  ShardingStrategy sharding_strategy = ShardingStrategy::FullShard;
  /// `fsdp_auto_wrap_policy`.
  AutoWrapPolicy auto_wrap_policy = AutoWrapPolicy::PerChildWrap;
  /// `fsdp_min_num_params`: minimum parameters (elements) per unit for SIZE_BASED_WRAP.
  int64_t min_num_params = 100000000;
  /// `fsdp_transformer_layer_cls_to_wrap`: comma-separated module names for TRANSFORMER_BASED_WRAP.
  std::string transformer_layer_cls_to_wrap;
  /// `fsdp_backward_prefetch`.
  BackwardPrefetch backward_prefetch = BackwardPrefetch::BackwardPre;
  /// `fsdp_forward_prefetch`: gather the next unit during forward.
  bool forward_prefetch = false;
  /// `fsdp_offload_params`: keep sharded parameters and optimizer state on CPU.
  bool offload_params = false;
  /// `fsdp_state_dict_type`.
  StateDictType state_dict_type = StateDictType::FullStateDict;
  /// `fsdp_activation_checkpointing`: recompute each unit's activations in backward.
  bool activation_checkpointing = false;
  /// `fsdp_version`: 1 or 2 (Accelerate's flag; both run the same accelerate-cpp implementation).
  int version = 1;
  /// `fsdp_cpu_ram_efficient_loading`: only rank 0 materialises full weights when loading.
  bool cpu_ram_efficient_loading = false;
  /// `fsdp_sync_module_states`: broadcast rank 0's parameters and buffers at prepare time.
  bool sync_module_states = true;
  /// `fsdp_use_orig_params`: accepted for Accelerate compatibility; the user's parameters always stay usable.
  bool use_orig_params = true;
  /// `fsdp_hybrid_shard_size` (accelerate-cpp's; parallelism_config's dp_shard_size sets it): the ranks of
  /// each shard group under HYBRID_SHARD / HYBRID_SHARD_ZERO2, consecutive ranks as Accelerate's device mesh
  /// (dp_replicate, dp_shard) lays them out; 0: the ranks of one machine (FSDP1's hybrid sharding).
  int hybrid_shard_size = 0;

  /// True when parameters are freed after forward (FULL_SHARD, HYBRID_SHARD).
  bool reshard_after_forward() const {
    return sharding_strategy == ShardingStrategy::FullShard ||
           sharding_strategy == ShardingStrategy::HybridShard;
  }
  /// True for the hybrid strategies: sharded inside each shard group (a machine unless hybrid_shard_size
  /// says otherwise), replicated across the groups.
  bool hybrid() const {
    return sharding_strategy == ShardingStrategy::HybridShard ||
           sharding_strategy == ShardingStrategy::HybridShardZero2;
  }
};

/// Settings of the `zero` backend (YAML section `deepspeed_config:`, DeepSpeed/Accelerate names).
struct ZeroConfig {
  /// `zero_stage`: 0 (DDP), 1 (optimizer state sharded), 2 (+ gradients), 3 (+ parameters).
  int stage = 2;
  /// `offload_optimizer_device`: `none`, `cpu` or `nvme` (needs stage >= 1). With `nvme` the fp32 master
  /// slices stay in CPU memory and the optimizer's state of each sub-group lives in a file under
  /// `offload_optimizer_nvme_path` between the optimizer's visits.
  OffloadDevice offload_optimizer_device = OffloadDevice::None;
  /// `offload_optimizer_nvme_path`: the directory for NVMe offload's files (a fast local disk).
  std::string offload_optimizer_nvme_path;
  /// DeepSpeed JSON `offload_optimizer.buffer_count`: sub-group buffers alive at once (at least 2: the one
  /// stepped, the one read ahead; the rest are writes in flight).
  int offload_optimizer_buffer_count = 4;
  /// DeepSpeed JSON `offload_optimizer.pipeline_read` / `pipeline_write`: read the next sub-group while one
  /// is stepped / write the last while the next is stepped. Results are the same either way. Ours default to
  /// true (DeepSpeed's to false: a JSON file that leaves them out gets DeepSpeed's synchronous swapping).
  bool offload_optimizer_pipeline_read = true;
  bool offload_optimizer_pipeline_write = true;
  /// `offload_param_device`: `none`, `cpu` or `nvme` (needs stage 3). With `nvme` each rank's parameter
  /// shards live in files under `offload_param_nvme_path`, read for each unit's all-gather and for the
  /// optimizer's step (ZeRO-Infinity).
  OffloadDevice offload_param_device = OffloadDevice::None;
  /// `offload_param_nvme_path`: the directory for the parameter shards' files (a fast local disk).
  std::string offload_param_nvme_path;
  /// DeepSpeed JSON `offload_param.buffer_count`: how many shard writes may be in flight behind the step,
  /// plus the shard in use and the one read ahead (at least 2); shards a fused multi-tensor step uses at once
  /// are all in memory during it.
  int offload_param_buffer_count = 5;
  /// `gradient_clipping`: max global gradient norm; 0 disables clipping.
  double gradient_clipping = 0.0;
  /// `gradient_clipping` was `auto` (in a DeepSpeed JSON file or a YAML deepspeed_config section, where an
  /// absent key is auto too): filled with 1.0 as Accelerate fills it, and with TrainingArguments'
  /// max_grad_norm under accel::Trainer, as Hugging Face's Trainer fills it. to_yaml writes `auto`.
  bool gradient_clipping_auto = false;
  /// `zero3_init_flag`: construct parameters already partitioned (stage 3).
  bool zero3_init_flag = false;
  /// `zero3_save_16bit_model`: `save_state` also writes a consolidated 16-bit model (stage 3).
  bool zero3_save_16bit_model = false;
  /// `reduce_bucket_size`: gradient reduce-scatter bucket, in elements as DeepSpeed counts it (a bucket holds
  /// that many gradient values: 5e8 fp32 values are 2 GB; YAML int or float such as 5e8).
  /// `auto` (std::nullopt) derives it from the model at prepare as Accelerate does for DeepSpeed:
  /// hidden_size² elements (at least 1 MiB), hidden_size being the most common input width of the model's
  /// matrices. 0 is DeepSpeed's "each parameter's gradient reduced on its own": stage 2 makes one bucket per
  /// parameter; stage 1, which reduce-scatters flat chunks, reads a 0 from a file as `auto` (with a notice).
  std::optional<uint64_t> reduce_bucket_size = 500000000;
  /// `overlap_comm`: stage 2 reduces a bucket while backward fills the next (two buckets of gradients at
  /// most); false reduces each bucket before backward continues (one bucket at most, no overlap).
  bool overlap_comm = true;
  /// `allgather_bucket_size`: parameter all-gather bucket, in elements as DeepSpeed counts it (0 accepted).
  /// Accepted for DeepSpeed files; no effect: stages 1-2 all-gather each optimizer sub-group straight into
  /// the parameters (no bucket buffer).
  uint64_t allgather_bucket_size = 500000000;
  /// `sub_group_size`: elements per optimizer sub-group in stages 1-2 (DeepSpeed's name). Each sub-group of
  /// whole parameters gets its own flat master slice, so the optimizer's per-tensor temporaries stay small.
  /// DeepSpeed's default is 1e9; ours is 4e6, measured in BENCHMARKS.md ("Sharded training vs DDP"). 0
  /// (DeepSpeed accepts it): every parameter is a sub-group of its own.
  uint64_t sub_group_size = 4000000;
  /// `zero_hpz_partition_size` (DeepSpeed ZeRO++ hpZ, stage 3): after a unit's forward each group of this
  /// many consecutive ranks (a machine) keeps a secondary copy of its parameters, split over the group, and
  /// backward gathers the unit from it inside the group instead of from every rank; 1: off.
  int hpz_partition_size = 1;
  /// `stage3_prefetch_bucket_size`: parameter elements prefetched ahead in stage 3 (DeepSpeed counts
  /// elements). Here stage 3 gathers whole units, so any positive size (and `auto`, std::nullopt) turns
  /// prefetching of the next unit on; 0 turns it off, as DeepSpeed prefetches nothing with 0.
  std::optional<uint64_t> stage3_prefetch_bucket_size = 50000000;
  /// `activation_checkpointing` (accelerate-cpp only): recompute activations in backward.
  bool activation_checkpointing = false;
  /// `vocab_parallel_lm_head` (a DeepSpeed JSON's `tensor_parallel.vocab_parallel_lm_head`; DeepSpeed's
  /// default false): under AutoTP (tensor_parallel_size > 1) the accel::llm models' output head is split over
  /// the vocabulary and the loss computed vocabulary-parallel, as DeepSpeed's AutoTP training does: an untied
  /// lm_head alone (embed_tokens stays whole), a tied one together with embed_tokens (one parameter, split
  /// once). Read by accel::llm::tensor_parallel_options(config); no effect on other models.
  bool vocab_parallel_lm_head = false;
  /// DeepSpeed's fp16 loss scaler (a DeepSpeed JSON's `fp16` block; YAML keys `fp16_<name>`), in effect under
  /// `mixed_precision: fp16`. The defaults are DeepSpeed's, which Accelerate's DeepSpeed plugin runs too.
  /// `fp16_loss_scale` (`fp16.loss_scale`): 0 scales dynamically; > 0 is a static scale (overflowing steps
  /// are still skipped, the scale never changes).
  double fp16_loss_scale = 0;
  /// `fp16_initial_scale_power` (`fp16.initial_scale_power`): the first dynamic scale is 2^this.
  int fp16_initial_scale_power = 16;
  /// `fp16_loss_scale_window` (`fp16.loss_scale_window`): the scale doubles when the clean steps since the
  /// last overflow, less one, are a positive multiple of this (the first growth after window + 1 steps).
  std::int64_t fp16_loss_scale_window = 1000;
  /// `fp16_hysteresis` (`fp16.hysteresis`): overflows (each a skipped step) before the scale halves.
  std::int64_t fp16_hysteresis = 2;
  /// `fp16_consecutive_hysteresis` (`fp16.consecutive_hysteresis`): refill the hysteresis at every clean
  /// step (false: only when the scale grows).
  bool fp16_consecutive_hysteresis = false;
  /// `fp16_min_loss_scale` (`fp16.min_loss_scale`): the scale never halves below this; an overflow at it
  /// stops the run with an error, as DeepSpeed's does.
  double fp16_min_loss_scale = 1;
  /// `deepspeed_config_file`: the DeepSpeed JSON these settings were read from ("" when from the YAML).
  /// Informational: not compared, and to_yaml writes the settings themselves.
  std::string config_file;
  /// `deepspeed_trainer_keys` (accelerate-cpp): the keys of a DeepSpeed JSON file that Hugging Face's Trainer
  /// fills from TrainingArguments or checks against them (transformers' HfTrainerDeepSpeedConfig), as one
  /// JSON object holding those the file sets of train_micro_batch_size_per_gpu, gradient_accumulation_steps,
  /// train_batch_size, gradient_clipping, fp16.enabled, bf16.enabled and the optimizer and scheduler blocks;
  /// "" without a file. accel::Trainer fills and checks them and builds the optimizer and scheduler blocks
  /// (<accel/config/deepspeed_trainer.hpp>); written by to_yaml so the ranks accel-launch starts see them.
  std::string trainer_keys;
};

/// The whole run configuration. Every field has a default; `Config{}` is a valid single-process CPU/GPU run.
/// YAML key names equal the field names unless noted.
struct Config {
  /// `config_version`: schema version of the file (missing means 1). This build reads version 1 only.
  int config_version = 1;
  /// `compute_environment`: only `LOCAL_MACHINE` is supported.
  std::string compute_environment = "LOCAL_MACHINE";
  /// The backend's name (`local`, `ddp`, `fsdp`, `zero`: see `config_backends()`), from `backend:` and/or
  /// Accelerate's `distributed_type:` (`NO` -> local, `MULTI_CPU`/`MULTI_GPU` -> ddp, `FSDP` -> fsdp,
  /// `DEEPSPEED` -> zero); when both are given they must agree. A program may set the name of a backend it
  /// registered itself (`AcceleratorOptions::registry`); files name the built-in ones.
  std::string backend = "local";
  /// `use_cpu`: run on CPU (Gloo) even when a GPU is present. `distributed_type: MULTI_CPU` implies it.
  bool use_cpu = false;
  /// `debug`: check every rank's tensor shapes before each collective so a mismatch is an error, not a hang.
  bool debug = false;
  /// `log_with`: experiment trackers the main process writes to (`tensorboard`, `csv`, `jsonl`, `all` or a
  /// comma-separated list; "" none); see tracking.hpp. AcceleratorOptions().log_with(...) overrides it.
  std::string log_with;
  /// `gpu_ids`: `all` or a comma-separated list such as `0,1`.
  std::string gpu_ids = "all";
  /// `num_processes`: total number of ranks across all machines.
  int num_processes = 1;
  /// `num_machines`: number of nodes; `num_processes` must be a multiple of it.
  int num_machines = 1;
  /// `machine_rank`: index of this node, 0..num_machines-1.
  int machine_rank = 0;
  /// `main_process_ip`: address of machine 0 (needed when num_machines > 1).
  std::string main_process_ip;
  /// `main_process_port`: rendezvous port on machine 0; 0 picks a free port.
  int main_process_port = 29500;
  /// `mixed_precision`.
  MixedPrecision mixed_precision = MixedPrecision::No;
  /// `gradient_accumulation_steps` (also read from `deepspeed_config:`; the two must agree).
  int gradient_accumulation_steps = 1;
  /// `collective_timeout_seconds`: a collective that takes longer fails with a DistributedError.
  double collective_timeout_seconds = 1800;
  /// `seed`: seed of every rank's RNGs and of data shuffling (`seed + epoch`); unset leaves RNGs alone.
  std::optional<uint64_t> seed;
  /// `even_batches`: complete the last round of batches by wrapping to the start of the epoch.
  bool even_batches = true;
  /// `split_batches`: cut each global batch into num_processes slices instead of giving each rank whole
  /// batches.
  bool split_batches = false;
  /// `ddp_bucket_cap_mb`: gradient all-reduce bucket size, in MiB.
  double ddp_bucket_cap_mb = 25;
  /// `ddp_first_bucket_cap_mb`: size of the first (latency-sensitive) bucket, in MiB.
  double ddp_first_bucket_cap_mb = 1;
  /// `ddp_find_unused_parameters`: tolerate parameters that get no gradient in a step.
  bool ddp_find_unused_parameters = false;
  /// `ddp_gradient_as_bucket_view` (PyTorch DDP's gradient_as_bucket_view): each parameter's .grad is a
  /// slice of its all-reduce bucket, so DDP holds one copy of the gradients, as estimate-memory counts; false
  /// keeps them apart (a second copy, PyTorch's default). The reduced gradients are the same either way.
  bool ddp_gradient_as_bucket_view = true;
  /// `ddp_broadcast_buffers`: after every sync step, copy rank 0's buffers (BatchNorm statistics) to every
  /// rank, as PyTorch DDP's `broadcast_buffers=True`, so all ranks evaluate and save the same model.
  bool ddp_broadcast_buffers = true;
  /// `ddp_comm_hook`: `no`, `fp16` or `bf16` gradient compression (DDP, ZeRO and FSDP gradient reduction).
  CommHook ddp_comm_hook = CommHook::No;
  /// `ddp_comm_powersgd_rank`: PowerSGD's matrix_approximation_rank (`ddp_comm_hook: power_sgd`).
  int ddp_comm_powersgd_rank = 1;
  /// `ddp_comm_powersgd_start_iter`: PowerSGD's start_powerSGD_iter: plain all-reduces before it (PyTorch's
  /// default 1000).
  int ddp_comm_powersgd_start_iter = 1000;
  /// `parallelism_config.parallelism_config_tp_size` (Accelerate 1.10+'s ParallelismConfig): ranks per
  /// tensor-parallel group, for a program whose layers are accel::tp layers built on
  /// `tensor_parallel_group()`; the same as AcceleratorOptions().tensor_parallel_size(n) (the two must agree
  /// when both are set). dp_replicate_size x dp_shard_size x tp_size must be num_processes, as in Accelerate.
  int tensor_parallel_size = 1;
  /// `parallelism_config.parallelism_config_sp_size` with `parallelism_config_sp_backend: deepspeed`
  /// (Accelerate's ALST / DeepSpeed Ulysses): ranks per sequence-parallel group (consecutive ranks reading
  /// the same batch, each its contiguous part of the positions; `sequence_parallel_group()`).
  int sequence_parallel_size = 1;
  /// `parallelism_config.parallelism_config_cp_size` (Accelerate's context parallelism): ranks per
  /// context-parallel group (the same group as sequence_parallel_size, positions load-balanced in 2 x cp
  /// chunks); exclusive with sequence_parallel_size.
  int context_parallel_size = 1;
  /// `parallelism_config.parallelism_config_cp_comm_strategy` (Accelerate's TorchContextParallelConfig,
  /// PyTorch's set_rotate_method): how context parallelism moves keys and values, "allgather" (Accelerate's
  /// default: all-gathered once per layer) or "alltoall" (ring attention: each block passed to the next rank
  /// point to point while the current one is attended, outputs merged by log-sum-exp).
  std::string context_parallel_comm_strategy = "allgather";
  /// `pipeline_config:` section.
  PipelineConfig pipeline;
  /// `fsdp_config:` section.
  FsdpConfig fsdp;
  /// `deepspeed_config:` section.
  ZeroConfig zero;
  /// File the config was read from as passed to `load_file`, the `source_name` of `load_string`, or "".
  std::string source;
  /// Settings read but without effect in this build, each with the reason (keys of a DeepSpeed JSON file that
  /// map to nothing here, ...). Printed by accel-launch and by the Accelerator's main process; not compared,
  /// not written.
  std::vector<std::string> notices;
  /// Where the settings that silently change training came from, for `accel-launch env`: keys
  /// `mixed_precision`, `gradient_accumulation_steps` and `gradient_clipping`, each "FILE:LINE", a DeepSpeed
  /// JSON file, or whose default applied (Accelerate's, DeepSpeed's, the backend's). Not compared, not
  /// written.
  std::map<std::string, std::string> origins;

  /// Reads and validates a YAML file. An empty file means all defaults.
  /// Throws ConfigError naming the file (as `path` was given), line, key, value and fix.
  static Config load_file(const std::string& path);
  /// Like load_file, from YAML text; `source_name` stands for the file name in messages.
  static Config load_string(const std::string& yaml, const std::string& source_name = "<string>");
  /// YAML text with Accelerate-style keys (`distributed_type`, ...) plus ours; `load_string` reads it back
  /// into an equal Config.
  std::string to_yaml() const;
  /// Writes `to_yaml()` to `path`, creating parent directories. Throws ConfigError when it cannot.
  void save_file(const std::string& path) const;
  /// Cross-field checks (machine_rank < num_machines, num_processes a multiple of num_machines, ranges ...).
  /// Throws ConfigError. `load_file`/`load_string` call it (and then also name the offending line).
  void validate() const;
};

/// Field-by-field equality of the settings (`source` is ignored).
bool operator==(const FsdpConfig& a, const FsdpConfig& b);
/// Negation of operator==.
inline bool operator!=(const FsdpConfig& a, const FsdpConfig& b) {
  return !(a == b);
}
/// Field-by-field equality of the settings.
bool operator==(const ZeroConfig& a, const ZeroConfig& b);
/// Negation of operator==.
inline bool operator!=(const ZeroConfig& a, const ZeroConfig& b) {
  return !(a == b);
}
/// Field-by-field equality of the settings; `source` is ignored.
bool operator==(const Config& a, const Config& b);
/// Negation of operator==.
inline bool operator!=(const Config& a, const Config& b) {
  return !(a == b);
}

/// One key of the config file, as documented (`accel-launch config --keys` prints them as a table).
struct ConfigKeyInfo {
  std::string path;           ///< with its section: "fsdp_config.fsdp_version"
  std::string default_value;  ///< as to_yaml writes it; "" for sections and keys never written
  std::string doc;            ///< one line
  std::string example;        ///< a valid non-default value (YAML); "" when the key has none
  bool setting = false;       ///< false: an alias, a derived key, or an Accelerate key accepted and ignored
};
/// Every key the reader accepts, from the one schema that also drives reading, writing and equality.
std::vector<ConfigKeyInfo> config_keys();

/// A real key of Accelerate's or DeepSpeed's files (some version of them) that accelerate-cpp does not
/// support. Loading one is an error "`<path>` is not supported by accelerate-cpp: <what>; <instead>", or a
/// notice with the same words where it is ignored (launcher-side and logging settings, and those whose job
/// is done here another way, such as a DeepSpeed JSON's optimizer block); a value that asks for nothing
/// (`accepted_when`) is accepted without a word.
struct UnsupportedKeyInfo {
  std::string file;     ///< "Accelerate YAML" or "DeepSpeed JSON" (a deepspeed_config_file)
  std::string path;     ///< with its section: "fsdp_config.fsdp_ignored_modules", "zero_optimization.zenflow"
  bool refused = true;  ///< false: ignored with a notice
  std::string accepted_when;  ///< the values that ask for nothing ("empty", "enabled: false", ...); "" none
  std::string what;           ///< what it does in Accelerate or DeepSpeed
  std::string instead;        ///< what to use instead, or "remove it"; for notices why it is ignored
};
/// Every key of that kind, in the order docs/config_keys.md lists them (`accel-launch config keys`): the
/// same table decides what loading them does.
std::vector<UnsupportedKeyInfo> unsupported_config_keys();

/// The fp16 loss-scaling policy a backend runs (BackendInfo::loss_scaling), torch-free; the Accelerator's
/// GradScaler follows it. The defaults are PyTorch's `torch.amp.GradScaler`, which Accelerate uses for DDP
/// and FSDP; the zero backend runs DeepSpeed's DynamicLossScaler (fp16/loss_scaler.py) with its file's
/// settings.
struct LossScaling {
  /// false: the scale stays `init_scale`; a step whose gradients overflow is still skipped.
  bool dynamic = true;
  double init_scale = 65536.0;
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  /// PyTorch: grow after this many clean steps in a row. DeepSpeed (`deepspeed_schedule`): grow when the
  /// clean steps since the last overflow, less one, are a positive multiple of it.
  std::int64_t growth_interval = 2000;
  bool deepspeed_schedule = false;
  /// Overflows before the scale backs off (1: every overflow); refilled when the scale grows, or at every
  /// clean step with `consecutive_hysteresis`.
  std::int64_t hysteresis = 1;
  bool consecutive_hysteresis = false;
  /// 0: none. Else the scale never backs off below it, and an overflow at it is an error.
  double min_scale = 0;
};

/// What a backend does with the three kinds of training state; the one answer to "is it sharded?".
struct BackendCapabilities {
  /// Each rank's optimizers hold only this rank's 1/N of the state (re-pointed at flat shards), saved per
  /// rank by save_state.
  bool shards_optimizer_state = false;
  /// Each rank keeps only its 1/N of the reduced gradients.
  bool shards_gradients = false;
  /// The model's parameters hold no memory at rest (gathered per unit on use): `torch::save(model)` throws
  /// with the call to use instead, and `get_state_dict` must run on every rank.
  bool shards_parameters = false;
  /// Gradients are communicated on accumulation micro-steps too (ZeRO-3 reduce-scatters every micro-step),
  /// instead of only on sync steps.
  bool communicates_on_micro_steps = false;
  /// What is sharded is split over the ranks of one shard group and replicated across the groups (FSDP's
  /// hybrid strategies): 1/L of it per rank, L the processes per machine or fsdp_hybrid_shard_size.
  bool shards_per_machine = false;
};

/// One layout a backend offers, chosen by one key of its section (`zero_stage: 1`).
struct BackendLayout {
  std::string key;                     ///< the key as written in the YAML ("zero_stage"); "" for none
  std::string value;                   ///< its value ("1", "NO_SHARD")
  std::function<void(Config&)> apply;  ///< sets it on a config (empty without a key)
};

/// How advice spells a layout: as YAML settings ("zero with zero_stage: 1") or as the flags of
/// `accel-launch estimate-memory` ("zero with --zero_stage 1").
enum class LayoutSpelling { Yaml, Flags };

/// What the torch-free side of accelerate-cpp (the config, accel-launch) knows about one backend. Each
/// backend folder (`backends/<name>/<name>_config.cpp`) describes itself, including the YAML section it owns,
/// how it reads, checks and writes that section, and the questions `accel-launch config` asks about it.
struct BackendInfo {
  std::string name;                            ///< the `backend:` value ("zero")
  std::string summary;                         ///< one line, shown by `accel-launch config`
  std::vector<std::string> aliases;            ///< other `backend:` spellings ("deepspeed")
  std::vector<std::string> distributed_types;  ///< Accelerate's `distributed_type:` values meaning it
  std::string section;    ///< the YAML section of its settings ("deepspeed_config"), or ""
  int max_processes = 0;  ///< 1 for a single-process backend; 0: any number
  /// With several processes this backend is replaced by that one (local -> ddp, as Accelerate infers
  /// MULTI_CPU / MULTI_GPU from the launcher); "" for none.
  std::string multi_process_replacement;
  /// Asks the questions of `accel-launch config` about this backend's settings (may be empty: none).
  std::function<void(Questions&, Config&)> ask_settings;
  /// The backend's fact sheet: what it shards under `config`. The only place where a stage or a strategy is
  /// mapped to sharding: the engines' capabilities, the refusals of pipelines and whole-parameter optimizers,
  /// their advice and the memory estimate all read it, so a new backend changes them by itself. Empty:
  /// nothing is sharded (local, ddp).
  std::function<BackendCapabilities(const Config&)> sharding;
  /// The setting of `config` that decides the layout, in words ("zero_stage 2", "FULL_SHARD"). Empty: none.
  std::function<std::string(const Config&)> layout_setting;
  /// The layouts it offers, one per distinct sharding, in the order advice lists them. Empty: one layout.
  std::vector<BackendLayout> layouts;
  /// The global gradient norm `backward` clips each prepared model to on sync steps under `config`, as
  /// DeepSpeed's engine clips before its step (`deepspeed_config.gradient_clipping`); 0 or empty: none.
  std::function<double(const Config&)> gradient_clipping;
  /// The fp16 loss scaler this backend runs under `config`, as its peer does (DeepSpeed's for zero). Empty:
  /// PyTorch's GradScaler defaults (LossScaling{}).
  std::function<LossScaling(const Config&)> loss_scaling;
};

/// The backends the config knows, in the order `accel-launch config` lists them.
const std::vector<BackendInfo>& config_backends();
/// The backend named `name` (canonical name; aliases are not followed), or nullptr.
const BackendInfo* find_backend(const std::string& name);
/// The backend a run of `num_processes` processes uses for `backend` (follows `multi_process_replacement`).
std::string backend_for_processes(const std::string& backend, int num_processes);
/// What `config` shards, from its backend's fact sheet (nothing for local, ddp or an unknown backend).
BackendCapabilities sharding_of(const Config& config);
/// The norm `backward` clips each model's gradients to on sync steps for `config`'s backend (0: none).
double automatic_gradient_clipping(const Config& config);
/// The fp16 loss-scaling policy of `config`'s backend (PyTorch's defaults for local, ddp, fsdp).
LossScaling loss_scaling_of(const Config& config);
/// The backend with the setting that decides its layout: "zero (zero_stage 2)", "fsdp (FULL_SHARD)", "ddp".
std::string describe_layout(const Config& config);
/// Every layout of every multi-process backend whose sharding `keep` accepts, as advice: with
/// LayoutSpelling::Yaml "backend: ddp, fsdp with fsdp_sharding_strategy: NO_SHARD, or zero with zero_stage: 0
/// or 1"; with LayoutSpelling::Flags "--backend ddp, fsdp with --fsdp_sharding_strategy NO_SHARD, ...".
std::string layouts_where(const std::function<bool(const BackendCapabilities&)>& keep,
                          LayoutSpelling spelling = LayoutSpelling::Yaml);

/// `no`, `fp16` or `bf16`.
std::string to_string(MixedPrecision mode);
/// `no`, `fp16` or `bf16`.
std::string to_string(CommHook hook);
/// The YAML spelling, e.g. `FULL_SHARD`.
std::string to_string(ShardingStrategy strategy);
/// The YAML spelling, e.g. `TRANSFORMER_BASED_WRAP`.
std::string to_string(AutoWrapPolicy policy);
/// The YAML spelling, e.g. `BACKWARD_PRE`.
std::string to_string(BackwardPrefetch prefetch);
/// The YAML spelling, e.g. `FULL_STATE_DICT`.
std::string to_string(StateDictType type);
/// `none` or `cpu`.
std::string to_string(OffloadDevice device);

/// The canonical name of a backend from `local|ddp|fsdp|zero` (case-insensitive; aliases such as `deepspeed`
/// for `zero` accepted). Throws ConfigError listing the allowed values.
std::string parse_backend(const std::string& text);
/// Parses `no|fp16|bf16` (case-insensitive; `false` means `no`). Throws ConfigError listing the allowed
/// values.
MixedPrecision parse_mixed_precision(const std::string& text);

}  // namespace accel
