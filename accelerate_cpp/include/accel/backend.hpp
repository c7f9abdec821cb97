#pragma once
/// \file backend.hpp
/// The interface every training backend implements (local, ddp, fsdp, zero), and the registry the
/// Accelerator picks one from by the config's `backend`. See backends/README.md for how to add one.

#include <accel/communicator.hpp>
#include <accel/config.hpp>

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace accel {

/// What a backend gets to know about the process it runs in.
struct BackendContext {
  const Config* config = nullptr;
  torch::Device device = torch::kCPU;
  int rank = 0;
  int world_size = 1;
  /// The process group wrapper; backends communicate only through it. Never null; lives longer than the
  /// backend.
  Communicator* comm = nullptr;
};

/// A named tensor of a state dict, in a stable order.
using NamedTensors = std::vector<std::pair<std::string, torch::Tensor>>;

/// Where the elements of one tensor an optimizer updates come from, so that checkpoints can be converted
/// between world sizes and backends: the flat vector [0, flat_numel) is the concatenation of `pieces` (named
/// model parameters, flattened) padded with zeros, and this rank's tensor holds [begin, begin + length).
struct OptimizerTensorLayout {
  struct Piece {
    std::string param;        ///< name in the model's named_parameters()
    std::int64_t offset = 0;  ///< where it starts in the flat vector
    std::int64_t numel = 0;
  };
  std::vector<Piece> pieces;
  std::int64_t flat_numel = 0;
  std::int64_t begin = 0;
  std::int64_t length = 0;
};

/// How gradients, parameters and optimizer state are laid out and synchronised across ranks.
/// All methods marked "collective" are called on every rank in the same order.
class Backend {
 public:
  virtual ~Backend() = default;
  /// Short name as in YAML ("local", "ddp", ...).
  virtual std::string name() const = 0;
  /// Takes over a model whose parameters are already on the device (collective).
  virtual void prepare_model(torch::nn::Module& model) = 0;
  /// Takes over an optimizer over (some of) the prepared model's parameters (collective).
  virtual void prepare_optimizer(torch::optim::Optimizer& optimizer) = 0;
  /// Before the user's backward; `sync` is false on accumulation micro-steps, which must not communicate.
  virtual void before_backward(bool sync) = 0;
  /// After the backward of a sync step: gradients seen by the optimizers are now the global mean
  /// (collective).
  virtual void after_backward(bool sync) = 0;
  /// Clips the global gradient norm in place; returns the norm before clipping (collective).
  virtual double clip_grad_norm(double max_norm, double norm_type) = 0;
  /// Brings the model's parameters up to date after the user's `optimizer.step()` updated sharded copies;
  /// called at step boundaries (a prepared loader fetching the next batch or ending an epoch, save_state).
  /// Must be cheap when nothing changed. Collective.
  virtual void sync_parameters() {}
  /// Communication buffers that hold gradients (DDP buckets ...), counted by memory_report.
  virtual std::vector<torch::Tensor> gradient_buffers() const { return {}; }
  /// Buffers that hold parameters but are no parameter's storage yet (a unit being gathered), counted by
  /// memory_report.
  virtual std::vector<torch::Tensor> parameter_buffers() const { return {}; }
  /// Whether each rank's optimizer holds only its own shard of the state (saved per rank by save_state).
  virtual bool shards_optimizer_state() const { return false; }
  /// The layout of every tensor in `optimizer`'s parameter groups, in order, when the backend re-pointed the
  /// optimizer at flat shards; empty when the optimizer updates the model's parameters themselves.
  virtual std::vector<OptimizerTensorLayout> optimizer_layout(
      const torch::optim::Optimizer& /*optimizer*/) const {
    return {};
  }
  /// Full (unsharded) model parameters and buffers by name (collective).
  virtual NamedTensors model_state() = 0;
  /// Loads full model parameters and buffers; throws CheckpointError on missing or mis-shaped entries.
  virtual void load_model_state(const std::map<std::string, torch::Tensor>& state) = 0;
};

/// Makes a backend for a context.
using BackendFactory = std::function<std::unique_ptr<Backend>(const BackendContext&)>;

/// Maps backend kinds to factories. Filled explicitly by `register_builtin_backends`, never by static
/// initialisers, so a program links exactly the backends it names.
class BackendRegistry {
 public:
  /// Registers (or replaces) the factory of a kind.
  void add(BackendKind kind, BackendFactory factory);
  /// Builds the backend of a kind; throws UnsupportedOperation naming the kind and the registered ones.
  std::unique_ptr<Backend> create(BackendKind kind, const BackendContext& context) const;
  bool contains(BackendKind kind) const;

 private:
  std::map<BackendKind, BackendFactory> factories_;
};

/// Registers every backend this build of accelerate-cpp ships.
void register_builtin_backends(BackendRegistry& registry);

}  // namespace accel
