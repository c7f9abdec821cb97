#pragma once
// Hugging Face-style model export: `model.safetensors`, or `model-0000k-of-0000n.safetensors` shards plus
// `model.safetensors.index.json`, written from a stream of tensors (one unit of a sharded model at a time),
// and read back. Local to the calling process; the Accelerator makes it collective.

#include <accel/backend/backend.hpp>
#include <accel/checkpoint/model_export.hpp>
#include <accel/parallel/tensor_parallel.hpp>

#include "checkpoint/xxh64.hpp"

#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <string>
#include <vector>

namespace accel::detail {

/// Bytes of a tensor's elements.
inline std::uint64_t tensor_bytes(const torch::Tensor& t) {
  return static_cast<std::uint64_t>(t.numel()) * t.element_size();
}

/// Every split parameter of a tensor-parallel layer in `piece` (named as in the model) replaced by the whole
/// parameter, gathered over the layer's group in rank order. Collective over each group: its ranks pass
/// pieces with the same names in the same order (the same model, split evenly).
void gather_tensor_parallel(NamedTensors& piece, const std::map<std::string, tp::SplitParameter>& splits);

/// Hands `sink` the whole model's state in pieces: the engine's, tensor-parallel layers gathered; with a
/// pipeline (`pipe` spans more than one stage) every stage's layers, in stage order, on every stage of this
/// replica: each stage broadcasts its tensors over `pipe` in turn (names, dtypes and shapes first). The
/// tensors may be the model's own (read them before returning). The engine is visited on every rank
/// (collective over its replicas); `share_stages` false skips the tensor-parallel gathers and the exchange
/// between stages (a replica whose ranks need no other stage's layers; the same for every rank of a
/// tensor-parallel group). Collective.
void visit_whole_model(Backend& engine, const std::map<std::string, tp::SplitParameter>& splits,
                       Communicator* pipe, bool share_stages, torch::Device device,
                       const std::function<void(NamedTensors)>& sink);

/// Puts `state` in the model's own order (`named_parameters()`, then `named_buffers()`), as one process's
/// model lists it, whatever order the engine handed it over in (ZeRO-3 and FULL_SHARD go unit by unit).
/// Unchanged when the module does not list every name (a pipeline stage cut from the model lists its own
/// layers only; the stages hand theirs over in the model's order).
void in_model_order(NamedTensors& state, const torch::nn::Module& module);

/// This rank's slices of the whole split parameters in `state`; CheckpointError starting with `where` and
/// naming the entry when a whole parameter has another size than its layer.
void slice_tensor_parallel(std::map<std::string, torch::Tensor>& state,
                           const std::map<std::string, tp::SplitParameter>& splits, const std::string& where);

/// Hugging Face's size strings: "10GB" (10^9), "500MB", "100KB", "5GiB" (2^30), "64MiB", "1KiB", or a plain
/// number of bytes. Throws UsageError naming the value and the accepted forms.
std::uint64_t parse_shard_size(const std::string& text);

/// Writes tensors as they come into shards of at most `max_shard_bytes` (a tensor larger than that gets a
/// shard of its own), as `huggingface_hub.split_torch_state_dict_into_shards` cuts a state dict. Shards go to
/// hidden temporary files first; `finish` then removes the weights of an earlier export (`model.safetensors`,
/// `model-*-of-*.safetensors`, the index, the manifest) and renames the new files into place, then writes
/// `model.safetensors.manifest.json` (each file's size and XXH64), which read_model_export verifies first: a
/// damaged, truncated, missing or foreign file is named and nothing is read.
class ShardedExportWriter {
 public:
  ShardedExportWriter(std::filesystem::path dir, std::uint64_t max_shard_bytes);
  ~ShardedExportWriter();
  ShardedExportWriter(const ShardedExportWriter&) = delete;
  ShardedExportWriter& operator=(const ShardedExportWriter&) = delete;

  /// Adds one tensor (copied to CPU, contiguous). Names must be unique.
  void add(const std::string& name, const torch::Tensor& tensor);
  /// Writes what is left, commits the files and returns what was written.
  ModelExport finish();
  /// Bytes of tensors held right now (the shard being filled).
  std::uint64_t held_bytes() const { return held_; }

 private:
  void flush(std::vector<std::pair<std::string, torch::Tensor>>& tensors);

  std::filesystem::path dir_;
  std::uint64_t max_;
  std::vector<std::pair<std::string, torch::Tensor>> current_;
  std::uint64_t held_ = 0;
  std::uint64_t total_ = 0;
  std::vector<std::filesystem::path> temp_files_;      // in shard order
  std::vector<std::vector<std::string>> shard_names_;  // tensor names of each shard
  std::vector<FileDigest> digests_;                    // of each shard, computed while writing
  std::map<std::string, bool> seen_;
  bool finished_ = false;
};

/// Every tensor of an export in `dir` (the index and its shards, or `model.safetensors`), on CPU. Throws
/// CheckpointError naming the directory or file and the fix.
std::map<std::string, torch::Tensor> read_model_export(const std::filesystem::path& dir);
/// The same checks, but the files are memory-mapped and each tensor is a read-only view of its bytes
/// (detail::mapped_tensor): nothing is copied, so a rank that reads only its slices of each tensor
/// (ZeRO-3, FULL_SHARD) touches only their pages.
std::map<std::string, torch::Tensor> map_model_export(const std::filesystem::path& dir);

}  // namespace accel::detail
