#pragma once
// Typed access to the per-parameter state of LibTorch's built-in optimizers, by name: what memory_report
// counts and what checkpoints convert between world sizes and backends.

#include <torch/optim/optimizer.h>

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace accel::detail {

/// "adam", "adamw", "sgd", "rmsprop" or "adagrad"; "" for other optimizer types.
std::string optimizer_kind(const torch::optim::Optimizer& optimizer);

/// The state tensors of one parameter by name (undefined ones included), plus "step" as a 0-d int64 tensor
/// where the state has a step counter. Empty for unknown state types.
std::vector<std::pair<std::string, torch::Tensor>> named_state(
    const torch::optim::OptimizerParamState& state);

/// A state of the optimizer kind built from `named` (as named_state returns it; missing names stay
/// undefined).
std::unique_ptr<torch::optim::OptimizerParamState> make_state(
    const std::string& kind, const std::map<std::string, torch::Tensor>& named);

/// Puts every state tensor of `optimizer` on the device of its parameter, as PyTorch's
/// Optimizer.load_state_dict does. LibTorch's torch::load keeps each tensor on the device it was saved from,
/// so without this a checkpoint written on a GPU would step a CPU run with CUDA state (and the other way
/// round). State of optimizer kinds named_state does not know is left as loaded.
void place_state_on_parameters(torch::optim::Optimizer& optimizer);

}  // namespace accel::detail
