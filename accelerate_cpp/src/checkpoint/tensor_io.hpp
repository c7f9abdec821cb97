#pragma once
// Conversions between LibTorch tensors and the torch-free safetensors reader/writer.

#include <accel/backend/backend.hpp>
#include <accel/checkpoint/safetensors.hpp>

#include <map>
#include <string>

namespace accel::detail {

/// Writes named tensors (any device, any layout) to a safetensors file.
void write_tensors(const std::string& path, const NamedTensors& tensors,
                   const std::map<std::string, std::string>& metadata = {});
/// Reads every tensor of a safetensors file into CPU tensors that own their memory.
std::map<std::string, torch::Tensor> read_tensors(const safetensors::File& file);
/// One tensor of a safetensors file as an owning CPU tensor; throws CheckpointError if missing.
torch::Tensor read_tensor(const safetensors::File& file, const std::string& name);

}  // namespace accel::detail
