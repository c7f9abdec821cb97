#pragma once
/// \file activation_memory.hpp
/// What one training step of an accel::llm::CausalLM keeps for backward (its activations), from the model's
/// config.json, the sequence length, the micro-batch and the training type alone (torch-free): the term
/// `accel-launch estimate-memory --max_length ... --per_device_train_batch_size ...` adds to the training
/// state. Derived from what this library's modules save (causal_lm.cpp, fused_layer_ops.cpp, LoRA's adapters,
/// the fused linear + cross-entropy loss), not from transformers' modules, and checked against
/// CpuMemoryCounter on tiny models (tests/llm/models_test.cpp, "activation memory").

#include <accel/llm/models/model_config.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace accel::llm {

/// How a step runs, as the activation estimate needs it.
struct ActivationMemoryOptions {
  std::int64_t sequence_length = 0;   ///< tokens per row (TRL's max_length; the collator pads to the longest)
  std::int64_t micro_batch_size = 1;  ///< rows per forward (per_device_train_batch_size)
  bool gradient_checkpointing = false;
  /// The model's dtype: float32 | bfloat16 | float16 (a 4-bit base: its compute dtype). LoRA adapters are
  /// float32 whatever the base's (PEFT's autocast_adapter_dtype).
  std::string dtype = "float32";
  /// LoRA: the adapted projections (PEFT's list form, or {"all-linear"}); empty: full fine-tuning (every
  /// parameter trains, the embedding and the head included).
  std::vector<std::string> lora_target_modules;
  std::int64_t lora_r = 8;
  double lora_dropout = 0.0;
};

/// Bytes of activations of one training step, per rank (one micro-batch).
struct ActivationMemory {
  /// What one decoder block keeps for backward: the first block (whose input, under LoRA, is the frozen
  /// embedding's output and needs no gradient) and each other block. With gradient checkpointing, the block's
  /// input only.
  std::uint64_t first_block = 0;
  std::uint64_t per_block = 0;
  /// The final norm's saved input, the rotary tables and the fused loss's gradient of the hidden states
  /// (computed in forward, kept until backward).
  std::uint64_t head = 0;
  /// Held only while the fused loss runs (beside the saved bytes): the hidden states, one chunk of float32
  /// logits over the vocabulary and its work.
  std::uint64_t loss_working = 0;
  /// Gradient checkpointing: one block's recomputed activations while its backward runs (0 without).
  std::uint64_t recompute = 0;
  std::int64_t layers = 0;      ///< decoder blocks
  std::int64_t chunk_rows = 0;  ///< rows of one chunk of the fused loss
  /// What autograd keeps at the end of forward: first_block + (layers - 1) x per_block + head.
  std::uint64_t saved() const;
  /// saved() + the larger of loss_working and recompute: the step's activation peak (backward's own
  /// temporaries, a few [tokens, intermediate] gradients of one block at a time, are not counted).
  std::uint64_t peak() const;
};

/// The activations of a step of `config`'s CausalLM under `options`, with the fused linear + cross-entropy
/// loss (the recipe's default; the unfused loss's [tokens, vocabulary] logits are not modelled), no padding
/// mask (one row per sequence, or rows of equal length), SDPA's CPU flash kernel (it keeps q, k, v, the
/// output and the log-sum-exp, never the [T, T] scores). Throws accel::ConfigError naming a bad option
/// (sequence length or micro-batch not positive, an unknown dtype, a LoRA target that names no projection).
ActivationMemory estimate_activation_memory(const ModelConfig& config,
                                            const ActivationMemoryOptions& options);

}  // namespace accel::llm
