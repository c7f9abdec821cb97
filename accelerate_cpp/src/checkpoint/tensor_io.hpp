#pragma once
// Conversions between LibTorch tensors and the torch-free safetensors reader/writer.

#include <accel/backend/backend.hpp>
#include <accel/checkpoint/safetensors.hpp>

#include "checkpoint/xxh64.hpp"

#include <map>
#include <memory>
#include <string>

namespace torch::serialize {
class OutputArchive;
}  // namespace torch::serialize
namespace torch::optim {
class Optimizer;
}  // namespace torch::optim

namespace accel::detail {

/// Writes named tensors (any device, any layout) to a safetensors file; returns its size and XXH64
/// (computed while writing, for the checkpoint manifest). The writers below do the same.
FileDigest write_tensors(const std::string& path, const NamedTensors& tensors,
                         const std::map<std::string, std::string>& metadata = {});
/// Writes a LibTorch archive (a .pt file) through a checked stream: a failed write (a full disk, a file-size
/// limit) is a CheckpointError naming the file, the bytes written and the reason, never an abort. LibTorch's
/// own `save_to(path)` aborts the process there: its zip writer throws again from its destructor ("unexpected
/// pos"). A partly written file is removed.
FileDigest write_archive(torch::serialize::OutputArchive& archive, const std::string& path);
/// `torch::save(optimizer, path)` through write_archive.
FileDigest write_optimizer(const torch::optim::Optimizer& optimizer, const std::string& path);

/// Reads every tensor of a safetensors file into CPU tensors that own their memory.
std::map<std::string, torch::Tensor> read_tensors(const safetensors::File& file);
/// One tensor of a safetensors file as an owning CPU tensor; throws CheckpointError if missing.
torch::Tensor read_tensor(const safetensors::File& file, const std::string& name);
/// One tensor of a memory-mapped safetensors file (safetensors::File::map) as a CPU tensor over the mapped
/// bytes, without a copy: pages are read as the tensor is read. Read-only (writing into it is a fault); it
/// keeps `file` mapped while it lives. Throws CheckpointError if missing.
torch::Tensor mapped_tensor(const std::shared_ptr<const safetensors::File>& file, const std::string& name);

}  // namespace accel::detail
