#pragma once
/// \file tensor_parallel.hpp
/// Tensor parallelism for the accel::llm model family (Megatron's split of a transformer block, DeepSpeed
/// AutoTP's plan for Llama / Qwen): in every block, q_proj, k_proj, v_proj, gate_proj and up_proj become
/// accel::tp::ColumnParallelLinear (output rows split) and o_proj and down_proj accel::tp::RowParallelLinear
/// (input columns split, input already this rank's), so that each rank of the tensor-parallel group computes
/// num_attention_heads / N query heads, num_key_value_heads / N key/value heads and intermediate_size / N MLP
/// features; one all-reduce after o_proj and one after down_proj in forward, one of the input gradient of
/// each split pair in backward.
///
///   accel::Accelerator acc;                               // parallelism_config_tp_size: 2 or autotp_size 2
///   auto model = accel::llm::from_pretrained(dir);       // every rank loads the whole checkpoint ...
///   accel::llm::apply_tensor_parallel(*model, acc.tensor_parallel_group());  // ... and keeps its slices
///   // (or from_pretrained_tensor_parallel below: each rank reads only its slices)
///   // then accel::peft::get_peft_model (LoRA on the split layers), prepare, train as usual
///
/// Parameter names stay transformers' (`model.layers.0.self_attn.q_proj.weight`): the Accelerator's
/// get_state_dict / save_model and PEFT's adapter files gather the slices to the full names and shapes
/// (accel::tp::split_parameters). What stays whole on every rank: every RMSNorm (the Qwen3 q/k norms are per
/// head_dim; their gradient, a sum over this rank's heads only, is summed over the group in backward), the
/// o_proj / down_proj biases (added once, after the sum) and, by default, the embedding and lm_head.
///
/// The embedding and the head by default stay whole, as DeepSpeed AutoTP training keeps them (its
/// `tensor_parallel.vocab_parallel_lm_head` is false by default, and its plan splits only the blocks' Linear
/// layers) and as transformers' Qwen2 / Llama `base_model_tp_plan` keeps the embedding. With
/// `TensorParallelOptions().vocab_parallel(true)` they are split over the vocabulary as Megatron's
/// VocabParallelEmbedding and parallel head: rank r holds rows [r V / N, (r + 1) V / N) of
/// `model.embed_tokens.weight` (and of `lm_head.weight` when untied; tied, the head uses the embedding's one
/// shard, still one parameter); each rank looks up the ids it holds (zeros for the others, one all-reduce),
/// and the loss of `sft_loss` is computed vocabulary-parallel (vocab_parallel_loss.hpp: the maximum and the
/// sum of exponentials all-reduced, the target's logit from the rank that holds it), fused or not, so that no
/// rank ever holds [tokens, V] logits; `CausalLM::forward` gathers the logits to [B, T, V] (generation,
/// evaluation). `TensorParallelOptions().vocab_parallel_lm_head(true)` is DeepSpeed's variant of it (its
/// JSON key of that name, which tensor_parallel_options(config) reads): the same split head and loss, but an
/// untied model's embedding stays whole (DeepSpeed returns the rank's logits from forward; here forward
/// still gathers them, and the loss never does).
///
/// Loading straight into the slices (each rank reads only its part of every split tensor from the
/// memory-mapped checkpoint, never the whole model):
///
///   auto model = accel::llm::from_pretrained_tensor_parallel(dir, acc.tensor_parallel_group());
///   // = from_pretrained_empty(dir) + apply_tensor_parallel(...) + load_pretrained_slices(*model, dir)

#include <memory>
#include <string>

#include "accel/llm/models/causal_lm.hpp"

namespace accel {
class Communicator;
struct Config;
}  // namespace accel

namespace accel::llm {

/// How apply_tensor_parallel splits a model. Example: `TensorParallelOptions().vocab_parallel(true)`.
struct TensorParallelOptions {
  /// false (the default, DeepSpeed AutoTP's and transformers' plan for these models): embed_tokens and
  /// lm_head whole on every rank. true: both split over the vocabulary (see the file comment); vocab_size
  /// must then be divisible by the group's size.
  TensorParallelOptions& vocab_parallel(bool value) {
    vocab_parallel_ = value;
    return *this;
  }
  /// DeepSpeed AutoTP's `tensor_parallel.vocab_parallel_lm_head: true` (deepspeed/runtime/tensor_parallel/
  /// config.py, the AutoTP training tutorial's "Vocabulary-parallel LM Loss"): the head split over the
  /// vocabulary and the loss computed vocabulary-parallel, the embedding as DeepSpeed leaves it: an untied
  /// lm_head is split alone (rows [r V / N, (r + 1) V / N)) while embed_tokens stays whole on every rank; a
  /// tied head is split together with embed_tokens (one parameter), which is then vocab_parallel(true)'s
  /// plan. vocab_size must be divisible by the group's size (DeepSpeed also splits unevenly; refused here).
  /// Exclusive with vocab_parallel(true) (UsageError when both are set: they differ for untied models).
  TensorParallelOptions& vocab_parallel_lm_head(bool value) {
    vocab_parallel_lm_head_ = value;
    return *this;
  }
  bool vocab_parallel_ = false;
  bool vocab_parallel_lm_head_ = false;
};

/// The options a run's config asks for: `vocab_parallel_lm_head` from a DeepSpeed JSON's
/// `tensor_parallel.vocab_parallel_lm_head` (Config::zero, zero backend only); everything else default.
/// Example: `apply_tensor_parallel(*model, acc.tensor_parallel_group(),
/// tensor_parallel_options(acc.config()))`.
TensorParallelOptions tensor_parallel_options(const Config& config);

/// Replaces the projections of every block of `model` by tensor-parallel layers over `group`, each holding
/// this rank's slice of the current weights (see the file comment), and with `options.vocab_parallel` the
/// embedding and the head too; the full layers are freed. A group of one leaves the model unchanged. Call it
/// on every rank of the group with the same weights, before accel::peft::get_peft_model and before prepare;
/// no collective runs here (each rank copies its slices). A model built by from_pretrained_empty stays empty:
/// its split layers get empty slices (no memory) for load_pretrained_slices to fill.
///
/// UsageError, before any change, naming every number that does not divide: num_attention_heads,
/// num_key_value_heads, intermediate_size (and vocab_size with vocab_parallel) not divisible by the group's
/// size; a projection that is no longer a torch::nn::Linear (4-bit: load without load_in_4bit; already split;
/// LoRA adapters: apply tensor parallelism first). A vocabulary that does not divide is refused rather than
/// padded as Megatron pads it: the checkpoints of these families already pad vocab_size (Qwen2 / Qwen3
/// 151,936 = 2^7 x 1,187, Llama 3 128,256 = 2^8 x 501), and padded rows would change the shapes that
/// save_model writes and transformers reloads.
void apply_tensor_parallel(CausalLMImpl& model, const std::shared_ptr<Communicator>& group,
                           const TensorParallelOptions& options = {});

/// Fills every empty parameter of `model` (from_pretrained_empty, then apply_tensor_parallel) from the
/// checkpoint in `dir` (model.safetensors or its index's shards, memory-mapped): a split parameter
/// (accel::tp::split_parameters) gets only this rank's slice, read from its part of the mapped tensor, so a
/// rank allocates and reads the replicated parameters plus 1 / N of the split ones. Parameters that already
/// hold memory are overwritten in place. Every tensor is checked first (present, of the full model's shape,
/// floating dtype): CheckpointError naming the file and the tensor, before anything is written. Local to a
/// rank: no collective.
void load_pretrained_slices(CausalLMImpl& model, const std::string& dir);

/// The model of `dir` split over `group` without any rank holding the whole model: from_pretrained_empty,
/// apply_tensor_parallel, then load_pretrained_slices. Building still holds, for a moment, the embedding and
/// one block with their initial values (as from_pretrained_empty does). Not collective, but every rank of the
/// group must call it. `load.load_in_4bit` is refused (UsageError).
CausalLM from_pretrained_tensor_parallel(const std::string& dir, const std::shared_ptr<Communicator>& group,
                                         const LoadOptions& load = {},
                                         const TensorParallelOptions& options = {});

}  // namespace accel::llm
