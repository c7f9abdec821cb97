#pragma once
// Whole-module state and model identity: a module's parameters and buffers as named tensors (read, copied,
// loaded, converted), and the checks and broadcasts that make every rank hold the same model.

#include <accel/backend/backend.hpp>

#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace accel::backends::detail {

/// Parameters then buffers of `module`, detached, by name (the module's own tensors: for exports that read
/// them at once).
NamedTensors module_state(torch::nn::Module& module);
/// The same, copied: what model_state() returns (get_state_dict's snapshot must not follow training).
NamedTensors module_state_copy(torch::nn::Module& module);
/// The module's buffers by name (detached, not copied).
NamedTensors module_buffers(torch::nn::Module& module);
/// CheckpointError when `state` lacks a parameter or buffer of `module`, or holds one with another shape or
/// kind (integer vs floating point); reads no tensor's data.
void check_module_state(const torch::nn::Module& module, const std::map<std::string, torch::Tensor>& state);
/// Copies every parameter and buffer of `module` from `state`; CheckpointError on a missing or mis-shaped
/// entry.
void load_module_state(torch::nn::Module& module, const std::map<std::string, torch::Tensor>& state);
/// `state` with every floating tensor converted to `dtype` (other tensors as they are).
NamedTensors converted(const NamedTensors& state, c10::ScalarType dtype);
/// The sharded engines' extra save_state file: DeepSpeed's `zero3_save_16bit_model` copy of the full state in
/// `dtype` ("model_16bit"), or nothing when unset.
std::vector<std::pair<std::string, NamedTensors>> model_16bit_files(
    const NamedTensors& full_state, const std::optional<c10::ScalarType>& dtype);
/// What every sharded backend does first in prepare_model: checks that every rank has the same model,
/// broadcasts rank 0's weights, and returns the parameters by name in model order (collective).
std::vector<std::pair<std::string, torch::Tensor>> take_over_model(Communicator& comm,
                                                                   torch::nn::Module& model,
                                                                   const std::string& who);
/// Compares every rank's parameter and buffer names and shapes; DistributedError naming the first difference.
/// `who` prefixes the message ("ddp", "zero"). Collective.
void check_same_model_everywhere(Communicator& comm, torch::nn::Module& model, const std::string& who);
/// Broadcasts every parameter and buffer from rank 0 (collective).
void broadcast_module(Communicator& comm, torch::nn::Module& model);
/// The first ';'-separated entry in which two signatures differ, as "'a' vs 'b'".
std::string first_difference(const std::string& a, const std::string& b);

}  // namespace accel::backends::detail
