#pragma once
/// \file sync_batchnorm.hpp
/// `accel::nn::SyncBatchNorm`: batch normalisation whose training statistics are those of the global batch
/// (every rank's samples), as PyTorch's `torch.nn.SyncBatchNorm`; LibTorch has none. Use it where the model
/// has `torch::nn::BatchNorm1d/2d/3d` (same options, same parameter and buffer names, so checkpoints and
/// state dicts interchange): N ranks with batch B then normalise, train and track running statistics exactly
/// like one process with batch N*B, which per-rank BatchNorm does not.
///
///   torch::nn::Sequential net(torch::nn::Conv2d(1, 32, 3), accel::nn::SyncBatchNorm(32), ...);
///   accelerator.prepare(net, optimizer);  // connects it to the ranks
///
/// `Accelerator::prepare` connects every SyncBatchNorm in a prepared model to its Communicator when there
/// are several processes (and disconnects it when the Accelerator is destroyed); unconnected, or in eval
/// mode with running statistics, it is plain BatchNorm. Training costs one all-reduce of 2C+1 values in
/// forward and one of 2C in backward per layer.

#include <torch/nn/cloneable.h>
#include <torch/nn/options/batchnorm.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <ostream>

namespace accel {

class Communicator;

namespace nn {

class SyncBatchNormImpl : public torch::nn::Cloneable<SyncBatchNormImpl> {
 public:
  explicit SyncBatchNormImpl(std::int64_t num_features)
      : SyncBatchNormImpl(torch::nn::BatchNormOptions(num_features)) {}
  explicit SyncBatchNormImpl(const torch::nn::BatchNormOptions& options_);

  void reset() override;
  /// Running statistics to their initial values, weight to one and bias to zero.
  void reset_parameters();
  /// `input` is (N, C, ...) with C = num_features.
  torch::Tensor forward(const torch::Tensor& input);
  void pretty_print(std::ostream& stream) const override;

  /// Statistics over the ranks of `comm` from now on (nullptr: this process's batch only). Called by
  /// Accelerator::prepare; `comm` must outlive the connection.
  void set_communicator(Communicator* comm) noexcept { comm_ = comm; }
  Communicator* communicator() const noexcept { return comm_; }

  torch::nn::BatchNormOptions options;
  torch::Tensor weight, bias, running_mean, running_var, num_batches_tracked;

 private:
  Communicator* comm_ = nullptr;
};

TORCH_MODULE(SyncBatchNorm);

}  // namespace nn
}  // namespace accel
