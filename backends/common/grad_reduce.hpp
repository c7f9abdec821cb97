#pragma once
// Gradient communication and its rules: the compressed reductions of `ddp_comm_hook`, the mean all-reduce of
// loose parameters and buffers, the end of a sharded sync step, and the unused-parameter check.

#include <accel/backend/backend.hpp>

#include <cstddef>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace accel::backends::detail {

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
/// The buffers broadcast_buffers sends, in module order: every module's own defined, non-empty buffers
/// except those of accel::ConstantBuffers modules (constant 4-bit codes).
std::vector<torch::Tensor> broadcast_buffer_list(torch::nn::Module& model);
/// Broadcasts broadcast_buffer_list(model) from rank 0 (PyTorch DDP's broadcast_buffers), one flat buffer per
/// dtype; a no-op on one process. Collective.
void broadcast_buffers(Communicator& comm, torch::nn::Module& model);
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
/// The one unused-parameter check of every engine: throws UsageError naming `who` and the parameters that
/// received no gradient in a backward that gave gradients to others of the same model, unless `tolerate`
/// (`ddp_find_unused_parameters: true`, then they are reduced as zeros).
void check_unused(const std::string& who, const std::vector<std::string>& unused, bool tolerate);
/// The gradients of a sharded engine: each rank's flat master slices (a norm sums over ranks), each held by
/// `copies` ranks (the machines, under hybrid sharding).
GradientTensors sharded_gradients(std::vector<torch::Tensor> masters, int copies,
                                  std::vector<torch::Tensor> loose);

}  // namespace accel::backends::detail
