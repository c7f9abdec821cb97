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
///   // then accel::peft::get_peft_model (LoRA on the split layers), prepare, train as usual
///
/// Parameter names stay transformers' (`model.layers.0.self_attn.q_proj.weight`): the Accelerator's
/// get_state_dict / save_model and PEFT's adapter files gather the slices to the full names and shapes
/// (accel::tp::split_parameters). What stays whole on every rank: the embedding, lm_head, every RMSNorm (the
/// Qwen3 q/k norms are per head_dim; their gradient, a sum over this rank's heads only, is summed over the
/// group in backward) and o_proj / down_proj biases (added once, after the sum).

#include <memory>

#include "accel/llm/models/causal_lm.hpp"

namespace accel {
class Communicator;
}

namespace accel::llm {

/// Replaces the projections of every block of `model` by tensor-parallel layers over `group`, each holding
/// this rank's slice of the current weights (see the file comment); the full layers are freed. A group of one
/// leaves the model unchanged. Call it on every rank of the group with the same weights, before
/// accel::peft::get_peft_model and before prepare; no collective runs here (each rank copies its slices).
///
/// UsageError, before any change, naming the numbers: num_attention_heads, num_key_value_heads or
/// intermediate_size not divisible by the group's size; a projection that is no longer a torch::nn::Linear
/// (4-bit: load without load_in_4bit; already split; LoRA adapters: apply tensor parallelism first).
void apply_tensor_parallel(CausalLMImpl& model, const std::shared_ptr<Communicator>& group);

}  // namespace accel::llm
