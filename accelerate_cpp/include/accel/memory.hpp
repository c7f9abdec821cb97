#pragma once
/// \file memory.hpp
/// Per-rank memory of training state: what `Accelerator::memory_report()` measures and what
/// `accel-launch estimate-memory` predicts, in the same three categories. Torch-free.

#include <cstdint>
#include <string>

namespace accel {

/// Bytes of training state held by one rank.
struct MemoryReport {
  std::uint64_t parameters = 0;  ///< model parameters plus sharded master copies, in bytes
  std::uint64_t gradients = 0;   ///< gradients of both, in bytes
  std::uint64_t optimizer_state =
      0;  ///< optimizer state tensors (Adam moments, momentum buffers ...), in bytes
  std::uint64_t total() const noexcept { return parameters + gradients + optimizer_state; }
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
  std::uint64_t num_parameters = 0;                      ///< P, trainable elements of the model
  int num_processes = 1;                                 ///< N
  std::string backend = "ddp";                           ///< local | ddp | zero | fsdp
  int zero_stage = 2;                                    ///< for zero: 0, 1, 2 or 3
  std::string fsdp_sharding_strategy = "SHARD_GRAD_OP";  ///< for fsdp: NO_SHARD, SHARD_GRAD_OP or FULL_SHARD
  std::string optimizer = "adam";      ///< adam | adamw | sgd | sgd_momentum | rmsprop | adagrad
  std::string mixed_precision = "no";  ///< no | bf16 | fp16 (weights stay fp32: autocast)
};

/// Predicted per-rank bytes right after a sync backward (gradients present) with the optimizer state created,
/// for accelerate-cpp's own layouts: whole fp32 parameters on every rank (stages 1-2 add a fp32 master slice
/// of S = ceil(P/N) elements; stage 3 and FULL_SHARD keep only the slice at rest, padded per unit, which
/// the estimate ignores), gradients whole (local, ddp) or S elements (zero 1-2, SHARD_GRAD_OP),
/// optimizer state k x P or k x S elements (k = 2 for Adam/AdamW, 1 for SGD with momentum, RMSprop and
/// Adagrad, 0 for SGD). Throws ConfigError naming the bad field.
MemoryReport estimate_memory(const MemoryEstimateInput& input);

}  // namespace accel
