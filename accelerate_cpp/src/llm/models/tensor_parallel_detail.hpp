#pragma once
// What the models' forward and the training loss need of a vocabulary-parallel model (apply_tensor_parallel
// with TensorParallelOptions().vocab_parallel(true)), and what from_pretrained's reading gives
// load_pretrained_slices. Private to accel_llm.
#include <torch/nn/module.h>
#include <torch/types.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "accel/llm/models/causal_lm.hpp"

namespace accel {
class Communicator;
}

namespace accel::llm::detail {

/// `ids` looked up in `embedding` (the registered `embed_tokens`) when it is a vocabulary-parallel
/// embedding: each rank its rows (transformers' padding_idx row getting no gradient), summed over the group;
/// an undefined tensor when it is not one. Collective when defined.
torch::Tensor vocab_parallel_embed(torch::nn::Module& embedding, const torch::Tensor& ids);

/// The group a model's head is split over by vocabulary, or null when the head is whole.
std::shared_ptr<Communicator> vocab_parallel_group(const CausalLMImpl& model);

/// This rank's logits [B, T, V / N] of the final hidden states `hidden` (the same on every rank of the
/// group): through lm_head (a ColumnParallelLinear, LoRA included) or the tied embedding's rows, with
/// Megatron's f in front so that `hidden`'s gradient is the whole head's. Only when vocab_parallel_group.
torch::Tensor vocab_parallel_logits(CausalLMImpl& model, const torch::Tensor& hidden);

/// This rank's rows of the head when they are a plain weight (the tied embedding's, or an lm_head without
/// adapters or bias) that vocab_parallel_fused_linear_cross_entropy can use; undefined otherwise.
torch::Tensor vocab_parallel_plain_weight(CausalLMImpl& model);

/// One tensor of a checkpoint to read into a parameter: the whole tensor, or (dim >= 0) the part
/// [first, first + length) of dimension `dim`. `into` has the part's shape; an empty one (no memory,
/// from_pretrained_empty) gets its memory here.
struct CheckpointPart {
  std::string name;
  torch::Tensor into;
  std::vector<std::int64_t> full_shape;  ///< the checkpoint tensor's shape (checked before anything is read)
  std::int64_t dim = -1;
  std::int64_t first = 0;
  std::int64_t length = 0;
};

/// Reads `parts` from the checkpoint of `dir` (pretrained.cpp): every named tensor and shape checked against
/// the checkpoint first (CheckpointError naming the file and the tensor), then each part copied from the
/// mapped file. `model_config` names the tensors the model may lack (the tied head's).
void read_checkpoint_parts(const std::string& dir, std::vector<CheckpointPart>& parts,
                           const ModelConfig& model_config);

/// Whether `t` was built empty (from_pretrained_empty: a storage without memory).
bool is_empty_parameter(const torch::Tensor& t);

/// Gives every parameter of `module` a storage without memory on `device`, as from_pretrained_empty does.
void empty_parameters(torch::nn::Module& module, torch::Device device);

}  // namespace accel::llm::detail
