#pragma once
// Optimizer state independent of world size and backend: what a checkpoint converts through when it is loaded
// with another number of processes, another backend or another sharding layout. Free functions over an
// optimizer and the layouts of its tensors (OptimizerTensorLayout), so each is unit-tested without ranks.
//
// The per-parameter form names each state tensor "<param>/<state>" ("fc1.weight/exp_avg", "1:fc.bias/step"
// for the second prepared model), shaped as the parameter, plus "param_groups/<g>/lr".

#include <accel/backend/backend.hpp>

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

namespace accel::detail {

/// A parameter's name in a checkpoint: `name` for the first prepared model, "<model>:<name>" for the others.
std::string qualified_name(std::size_t model, const std::string& name);

/// Layouts of an optimizer that updates model parameters directly (each tensor one whole parameter of one
/// of `models`); empty when some tensor is not a parameter of them (no conversion is possible).
std::vector<OptimizerTensorLayout> identity_layouts(const torch::optim::Optimizer& optimizer,
                                                    const std::vector<torch::nn::Module*>& models);

/// Every parameter's shape by qualified name.
std::map<std::string, std::vector<std::int64_t>> parameter_shapes(
    const std::vector<torch::nn::Module*>& models);

/// A short fingerprint of how an optimizer's tensors map onto model parameters (stage, wrap policy, world
/// size ...): a checkpoint with another fingerprint is converted, never loaded slice for slice.
std::string layout_fingerprint(const std::vector<OptimizerTensorLayout>& layouts);

/// The per-parameter state of `optimizer` (a LibTorch built-in: optimizer_kind is not empty), whose tensors
/// are laid out as `layouts` say. `all_gather` joins the slices every rank holds of a sharded tensor
/// (collective: called for the same tensors in the same order on every rank; it is never called for a tensor
/// that is not sharded). Only where `keep` is true are tensors returned (the main process writes them); the
/// other ranks take part in the gathers and get an empty list.
NamedTensors consolidate_optimizer_state(const torch::optim::Optimizer& optimizer,
                                         const std::vector<OptimizerTensorLayout>& layouts,
                                         const std::map<std::string, std::vector<std::int64_t>>& shapes,
                                         const std::function<torch::Tensor(const torch::Tensor&)>& all_gather,
                                         bool keep);

/// Replaces `optimizer`'s state (and its groups' learning rates) with the slices of the per-parameter state
/// that `lookup` returns (an undefined tensor for a missing key) that its tensors hold according to
/// `layouts`. Pieces whose parameter had no state when saved start from zero, as a fresh state would; the
/// step is the largest saved step of the tensor's pieces.
void restore_optimizer_state(torch::optim::Optimizer& optimizer,
                             const std::vector<OptimizerTensorLayout>& layouts,
                             const std::function<torch::Tensor(const std::string& key)>& lookup);

}  // namespace accel::detail
