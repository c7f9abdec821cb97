#pragma once
/// \file memory.hpp
/// Per-rank memory of training state: what `Accelerator::memory_report()` measures and what
/// `accel-launch estimate-memory` predicts, in the same three categories. Torch-free.

#include <cstdint>
#include <string>
#include <vector>

namespace accel {

/// Bytes of training state held by one rank.
struct MemoryReport {
  std::uint64_t parameters = 0;  ///< model parameters plus sharded master copies, in bytes
  std::uint64_t gradients = 0;   ///< gradients of both, in bytes
  std::uint64_t optimizer_state =
      0;  ///< optimizer state tensors (Adam moments, momentum buffers ...), in bytes
  /// Optimizer state kept in NVMe offload's files (offload_optimizer_device: nvme), not in memory; not part
  /// of total().
  std::uint64_t nvme = 0;
  /// Parameter shards kept in NVMe offload's files (offload_param_device: nvme), not in memory; not part of
  /// total().
  std::uint64_t nvme_parameters = 0;
  /// Estimates only: while training, the layouts that shard parameters (ZeRO-3, FSDP FULL_SHARD and the
  /// hybrid strategies) also hold, for a moment each, the unit computing and the next one prefetched (whole)
  /// and the unit's flat gradient before its reduce-scatter: 3 x the largest unit's fp32 bytes (from
  /// MemoryEstimateInput::largest_unit_parameters or layer_parameters; 0 when unknown or nothing is
  /// gathered). With a frozen base (LoRA) the two whole units are in the base's dtype and the gradient buffer
  /// covers only the trainable parameters (frozen flats are never reduced); a 4-bit base is never gathered.
  /// Not part of total(); activations come on top.
  std::uint64_t gathered = 0;
  std::uint64_t total() const noexcept { return parameters + gradients + optimizer_state; }
  /// total() + gathered: the peak while training, activations aside.
  std::uint64_t peak() const noexcept { return total() + gathered; }
  /// One line per category, human-readable ("parameters: 12.3 MiB ...").
  std::string to_string() const;
};

/// Counts every byte LibTorch allocates on the CPU, by wrapping its CPU allocator (one per process, so this
/// is process-wide state LibTorch forces on us). Tensors allocated before `install()` are not counted.
class CpuMemoryCounter {
 public:
  /// Wraps LibTorch's CPU allocator; idempotent. Not for CUDA memory (use CUDA's allocator statistics).
  static void install();
  static bool installed() noexcept;
  /// Bytes currently allocated through the wrapper.
  static std::uint64_t current() noexcept;
  /// Highest `current()` since install or the last `reset_peak()`.
  static std::uint64_t peak() noexcept;
  /// Sets the peak to the current value.
  static void reset_peak() noexcept;
};

/// What `estimate_memory` needs to know.
struct MemoryEstimateInput {
  std::uint64_t num_parameters = 0;  ///< P, trainable elements of the model
  int num_processes = 1;             ///< N
  /// Machines the processes are spread over (hybrid sharding shards over each machine's N / machines).
  int num_machines = 1;
  /// Ranks per shard group under hybrid sharding (fsdp_hybrid_shard_size); 0: one machine's N / machines.
  int hybrid_shard_size = 0;
  std::string backend = "ddp";  ///< local | ddp | zero | fsdp
  int zero_stage = 2;           ///< for zero: 0, 1, 2 or 3
  std::string fsdp_sharding_strategy =
      "SHARD_GRAD_OP";                 ///< for fsdp: NO_SHARD, SHARD_GRAD_OP, FULL_SHARD, HYBRID_*
  std::string optimizer = "adam";      ///< adam | adamw | sgd | sgd_momentum | rmsprop | adagrad
  std::string mixed_precision = "no";  ///< no | bf16 | fp16 (weights stay fp32: autocast)
  /// Pipeline parallelism (`pipeline_config:`): p stages, each run by num_processes / p data-parallel ranks
  /// (num_processes must be a multiple of p); 1: no pipeline.
  int pipeline_stages = 1;
  /// Micro-batches per step, m (the schedule's activation bound needs it); 0: unknown.
  int micro_batches = 0;
  std::string pipeline_schedule = "1f1b";  ///< 1f1b | gpipe
  /// `partition` of pipeline_config (parameters | uniform | boundaries "0,3,6"); used with layer_parameters.
  std::string partition = "parameters";
  /// Trainable elements of each layer of the Sequential, in order (optional): the stages' shares follow the
  /// partition of these counts. Empty: each stage gets 1/p of num_parameters. When given, their sum must be
  /// num_parameters (a zero num_parameters is taken from the sum).
  std::vector<std::uint64_t> layer_parameters;
  /// Bytes autograd keeps for backward for one micro-batch through the whole model (optional; 0: unknown),
  /// spread evenly over the layers (over the stages without layer_parameters).
  std::uint64_t activation_bytes = 0;
  /// Frozen elements beside the trainable ones (a LoRA or QLoRA base): no gradient, no optimizer state,
  /// in `frozen_dtype`; whole on every rank, except that layouts sharding parameters (ZeRO-3, FULL_SHARD,
  /// HYBRID_SHARD) hold 1/N of them (of the shard group), as DeepSpeed's ZeRO-3 and FSDP do.
  std::uint64_t frozen_parameters = 0;
  /// fp32 | bf16 | fp16 | 4bit (NF4/FP4 with double quantisation: 0.516 bytes) | 4bit_single (0.5625 bytes).
  std::string frozen_dtype = "bf16";
  /// Where the zero backend keeps the optimizer state: none (or cpu: the same bytes, in CPU memory) | nvme
  /// (in files; memory holds `nvme_buffer_count` sub-group buffers of it).
  std::string offload_optimizer = "none";
  std::uint64_t sub_group_size = 4000000;  ///< elements per optimizer sub-group (deepspeed_config)
  int nvme_buffer_count = 4;               ///< offload_optimizer.buffer_count
  /// Where stage 3 keeps the parameter shards: none (or cpu) | nvme (in files; memory holds
  /// `param_nvme_buffer_count` of them, each the largest unit's shard).
  std::string offload_param = "none";
  int param_nvme_buffer_count = 5;            ///< offload_param.buffer_count
  std::uint64_t largest_unit_parameters = 0;  ///< elements of the largest unit (0: the largest layer)
};

/// One pipeline stage's share of training memory, per rank of that stage (estimate_pipeline_memory).
struct StageMemoryEstimate {
  int first_layer = 0;  ///< the stage holds layers [first_layer, end_layer) (both 0 without layer_parameters)
  int end_layer = 0;
  std::uint64_t num_parameters = 0;  ///< the stage's trainable elements
  MemoryReport state;  ///< parameters, gradients and optimizer state, sharded as the backend does
  /// Micro-batches whose activations the stage holds at most: min(p - s, m) under 1F1B, m under GPipe (p - s
  /// when m is unknown under 1F1B, 0 under GPipe); 1 without a pipeline.
  int live_micro_batches = 0;
  /// live_micro_batches x the stage's share of activation_bytes, in bytes; 0 when activation_bytes is 0.
  std::uint64_t activation_bytes = 0;
};

/// Predicted per-rank bytes right after a sync backward (gradients present) with the optimizer state created,
/// for accelerate-cpp's own layouts: whole fp32 parameters on every rank (stages 1-2 add a fp32 master slice
/// of S = ceil(P/N) elements; stage 3 and FULL_SHARD keep only the slice at rest, padded per unit, which
/// the estimate ignores), gradients whole (local, ddp) or S elements (zero 1-2, SHARD_GRAD_OP),
/// optimizer state k x P or k x S elements (k = 2 for Adam/AdamW, 1 for SGD with momentum, RMSprop and
/// Adagrad, 0 for SGD). With pipeline_stages > 1: the report of the stage with the largest total (see
/// estimate_pipeline_memory). Throws ConfigError naming the bad field.
MemoryReport estimate_memory(const MemoryEstimateInput& input);

/// One entry per pipeline stage (one entry, the whole model, for pipeline_stages 1): the stage's parameters
/// (its layers' by `partition` when layer_parameters are given, else 1/p, the first stages taking the
/// remainder), estimated as estimate_memory does for num_processes / p ranks, and the schedule's bound on
/// its activations. Backends that shard gradients or parameters (zero_stage 2 or 3, fsdp other than
/// NO_SHARD) are refused with a pipeline, as the Accelerator refuses them. Throws ConfigError naming the bad
/// field.
std::vector<StageMemoryEstimate> estimate_pipeline_memory(const MemoryEstimateInput& input);
/// The backend with the setting that decides its layout, as the estimates read them: "zero (zero_stage 2)",
/// "fsdp (FULL_SHARD)", "ddp". Throws ConfigError as estimate_memory does on a bad backend setting.
std::string describe_backend(const MemoryEstimateInput& input);

}  // namespace accel
