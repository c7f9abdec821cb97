#pragma once
// Helpers shared by the backends: state dicts of whole modules, local gradient clipping, diffing signatures.

#include <accel/backend.hpp>

#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace accel::backends::detail {

/// Parameters then buffers of `module`, detached, by name (the module's own tensors: for exports that read
/// them at once).
NamedTensors module_state(torch::nn::Module& module);
/// The same, copied: what model_state() returns (get_state_dict's snapshot must not follow training).
NamedTensors module_state_copy(torch::nn::Module& module);
/// The module's buffers by name (detached, not copied).
NamedTensors module_buffers(torch::nn::Module& module);
/// Copies every parameter and buffer of `module` from `state`; CheckpointError on a missing or mis-shaped
/// entry.
void load_module_state(torch::nn::Module& module, const std::map<std::string, torch::Tensor>& state);
/// The one unused-parameter check of every engine: throws UsageError naming `who` and the parameters that
/// received no gradient in a backward that gave gradients to others of the same model, unless `tolerate`
/// (`ddp_find_unused_parameters: true`, then they are reduced as zeros).
void check_unused(const std::string& who, const std::vector<std::string>& unused, bool tolerate);
/// The note for an optimizer stepped on CPU-offloaded shards (`key`: the config key that offloads) when it is
/// LibTorch's unfused AdamW / Adam / SGD: names the accel::optim drop-in (DeepSpeed's CPU-Adam role). Empty
/// otherwise.
std::vector<std::string> offload_step_notices(const std::string& key,
                                              const torch::optim::Optimizer& optimizer);
/// The dtype gradients travel in under `hook` (`ddp_comm_hook`), or nullopt for no compression.
std::optional<c10::ScalarType> wire_dtype(CommHook hook);
/// Throws for `ddp_comm_hook: power_sgd` on an engine that reduces gradients to their owners (`who`), which
/// a low-rank all-reduce cannot do, naming what to set instead.
void refuse_power_sgd(const Config& config, const std::string& who);
/// Gradient reductions with compression (PyTorch's fp16/bf16 compress hooks): the fp32 input is divided by
/// the world size and cast to `wire` for the collective; `wait()` casts the result back and multiplies it by
/// the world size, so every caller still gets the sum it gets uncompressed (and divides as before). Without a
/// wire dtype, or for gradients no wider than it (fp16, bf16), these are the plain collectives. Collective.
std::unique_ptr<CollectiveHandle> all_reduce_grads(Communicator& comm, torch::Tensor flat,
                                                   std::optional<c10::ScalarType> wire);
std::unique_ptr<CollectiveHandle> reduce_scatter_grads(Communicator& comm, torch::Tensor output,
                                                       torch::Tensor input,
                                                       std::optional<c10::ScalarType> wire);
std::unique_ptr<CollectiveHandle> reduce_grads(Communicator& comm, torch::Tensor tensor, int root,
                                               std::optional<c10::ScalarType> wire);
/// All-reduces (mean) the defined gradients of `params` in place, one flat buffer per dtype: trainable
/// parameters no sharded optimizer owns keep DDP's semantics. Collective.
void all_reduce_mean_grads(Communicator& comm, const std::vector<torch::Tensor>& params);
/// Trainable parameters among `params` that no sharded optimizer owns (`owned(index)` false): they stay
/// whole and keep DDP's semantics.
std::vector<torch::Tensor> loose_parameters(const std::vector<torch::Tensor>& params,
                                            const std::function<bool(std::size_t)>& owned);
/// Whether any of `params` has a gradient.
bool any_grad(const std::vector<torch::Tensor>& params);
/// The end of every sharded engine's sync step in which the model took part: the loose parameters'
/// gradients all-reduced (mean) and, with `ddp_broadcast_buffers`, rank 0's buffers broadcast. Collective.
void end_sync_step(Communicator& comm, torch::nn::Module& model, const Config& config,
                   const std::vector<torch::Tensor>& loose);
/// `state` with every floating tensor converted to `dtype` (other tensors as they are).
NamedTensors converted(const NamedTensors& state, c10::ScalarType dtype);
/// The sharded engines' extra save_state file: DeepSpeed's `zero3_save_16bit_model` copy of the full state in
/// `dtype` ("model_16bit"), or nothing when unset.
std::vector<std::pair<std::string, NamedTensors>> model_16bit_files(
    const NamedTensors& full_state, const std::optional<c10::ScalarType>& dtype);
/// The gradients of a sharded engine: each rank's flat master slices (a norm sums over ranks).
GradientTensors sharded_gradients(std::vector<torch::Tensor> masters);
/// Broadcasts every buffer of `model` from rank 0 (PyTorch DDP's broadcast_buffers), one flat buffer per
/// dtype; a no-op on one process. Collective.
void broadcast_buffers(Communicator& comm, torch::nn::Module& model);
/// What every sharded backend does first in prepare_model: checks that every rank has the same model,
/// broadcasts rank 0's weights, and returns the parameters by name in model order (collective).
std::vector<std::pair<std::string, torch::Tensor>> take_over_model(Communicator& comm,
                                                                   torch::nn::Module& model,
                                                                   const std::string& who);
/// The position of `p` (the same tensor, not an equal one) in `params`; UsageError naming `who` if absent.
std::size_t parameter_index(const std::vector<torch::Tensor>& params, const torch::Tensor& p,
                            const std::string& who);
/// ceil(numel / world), at least 1: the elements of each rank's slice of a flat vector.
std::int64_t shard_size(std::int64_t numel, int world);
/// This rank's slice [rank * shard, (rank + 1) * shard) of the zero-padded concatenation of the (flattened)
/// `params[indices[m]]` placed at `offsets[m]`, as a new tensor (in CPU memory when `to_cpu`).
torch::Tensor flat_slice(const std::vector<torch::Tensor>& params, const std::vector<std::size_t>& indices,
                         const std::vector<std::int64_t>& offsets, std::int64_t shard,
                         const Communicator& comm, bool to_cpu = false);
/// The checks every sharded backend makes before re-pointing an optimizer at flat slices: the model was
/// prepared first and the optimizer has no state yet. UsageError naming `who`.
void check_shardable_optimizer(const torch::nn::Module* model, const torch::optim::Optimizer& optimizer,
                               const std::string& who);
/// The layout of a flat vector made of `params[indices[m]]` (named `names[indices[m]]`) at `offsets[m]`,
/// sharded `shard` elements per rank.
OptimizerTensorLayout flat_layout(const std::vector<std::string>& names,
                                  const std::vector<torch::Tensor>& params,
                                  const std::vector<std::size_t>& indices,
                                  const std::vector<std::int64_t>& offsets, std::int64_t shard,
                                  const Communicator& comm);
/// The layouts of `optimizer`'s tensors, in order, looked up among `known` (master tensor, layout) pairs;
/// UsageError naming `who` for a tensor the backend did not create.
std::vector<OptimizerTensorLayout> layouts_for(
    const torch::optim::Optimizer& optimizer,
    const std::vector<std::pair<torch::Tensor, OptimizerTensorLayout>>& known, const std::string& who);
/// Compares every rank's parameter and buffer names and shapes; DistributedError naming the first difference.
/// `who` prefixes the message ("ddp", "zero"). Collective.
void check_same_model_everywhere(Communicator& comm, torch::nn::Module& model, const std::string& who);
/// Broadcasts every parameter and buffer from rank 0 (collective).
void broadcast_module(Communicator& comm, torch::nn::Module& model);
/// The first ';'-separated entry in which two signatures differ, as "'a' vs 'b'".
std::string first_difference(const std::string& a, const std::string& b);

}  // namespace accel::backends::detail
