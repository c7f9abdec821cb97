#pragma once
/// \file backend.hpp
/// The interface every training backend implements (local, ddp, fsdp, zero), and the registry the
/// Accelerator picks one from by the config's backend name. See backends/README.md for how to add one.
///
/// A backend is a *descriptor* (name, capabilities, notices about the config, and a factory) plus an
/// *engine* per prepared model: `prepare(G, D, opt_g, opt_d)` makes two engines, each serving one model and
/// the optimizers over its parameters. An engine must implement preparing and the backward hooks; the other
/// operations either have a default that is right for an unsharded backend (no buffers to report, nothing to
/// refresh) or throw `UnsupportedOperation("<backend> does not support <op>")`, as c10d's backends do, so a
/// new backend runs a training loop before it can save, load or clip.

#include <accel/config/config.hpp>
#include <accel/distributed/communicator.hpp>

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
  /// engines.
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

/// The tensors whose `.grad()` hold a model's gradients after a sync step, for clipping and norms.
struct GradientTensors {
  std::vector<torch::Tensor> tensors;
  /// true: each rank holds disjoint slices (a norm sums over ranks); false: every rank holds the same values.
  bool sharded = false;
  /// With `sharded`: how many ranks hold each slice (the machines under hybrid sharding; the norm's sum over
  /// ranks counts every slice this many times).
  int copies = 1;
  /// With `sharded`: gradients every rank holds whole beside the slices (trainable parameters outside the
  /// optimizer, reduced like DDP's); a norm counts them once and clipping scales them too.
  std::vector<torch::Tensor> replicated;
};

/// The engine of one prepared model: how its gradients, parameters and optimizer state are laid out and
/// synchronised across ranks. Methods marked "collective" are called on every rank in the same order.
///
/// The micro-step contract, true for every backend: on `before_backward(false)` / `after_backward(false)`
/// (accumulation micro-steps and `no_sync`) no gradient is reduced unless
/// `capabilities().communicates_on_micro_steps`, and nothing at all moves unless `shards_parameters` too
/// (such engines still gather parameters for backward; tested by counting bytes per collective);
/// gradients add up across any number of backward calls until the user's `optimizer.step()` or
/// `zero_grad()`, and after a sync step the gradients the optimizers see are the mean over all ranks of
/// everything accumulated. A model that receives no gradient at all in one backward takes no part in its
/// synchronisation (the generator during the discriminator's backward).
class Backend {
 public:
  virtual ~Backend() = default;
  /// Short name as in YAML ("local", "ddp", ...).
  virtual std::string name() const = 0;
  virtual BackendCapabilities capabilities() const = 0;
  /// Takes over the model whose parameters are already on the device; called once (collective).
  virtual void prepare_model(torch::nn::Module& model) = 0;
  /// Takes over an optimizer over (some of) this model's parameters; may be called for several optimizers
  /// (collective).
  virtual void prepare_optimizer(torch::optim::Optimizer& optimizer) = 0;
  /// Before the user's backward; `sync` is false on accumulation micro-steps.
  virtual void before_backward(bool sync) = 0;
  /// After the user's backward (collective on sync steps; on every step when communicating on micro-steps).
  virtual void after_backward(bool sync) = 0;
  /// Where this model's gradients are after a sync step (clip_grad_norm_). Default: unsupported.
  virtual GradientTensors gradients() const;
  /// Brings the model's parameters up to date after the user's `optimizer.step()` updated sharded copies.
  /// Called at step boundaries (prepared loaders, wait_for_everyone, save_state, get_state_dict); sharded
  /// backends also do it by themselves before the next operator reads a parameter. Cheap when nothing
  /// changed. Collective.
  virtual void sync_parameters() {}
  /// While `hold` is true, optimizer state the engine keeps out of memory between steps (ZeRO's NVMe offload)
  /// is in memory, in the optimizer's own tensors: save_state and load_state read and replace it whole. When
  /// it turns false, the engine takes the (possibly replaced) state out again. Default: nothing to do.
  virtual void hold_optimizer_state(bool /*hold*/) {}
  /// Communication buffers that hold gradients (DDP buckets ...), counted by memory_report.
  virtual std::vector<torch::Tensor> gradient_buffers() const { return {}; }
  /// Buffers that hold parameters but are no parameter's storage yet (a unit being gathered), counted by
  /// memory_report.
  virtual std::vector<torch::Tensor> parameter_buffers() const { return {}; }
  /// The layout of every tensor in `optimizer`'s parameter groups, in order, when the backend re-pointed the
  /// optimizer at flat shards; empty when the optimizer updates the model's parameters themselves.
  virtual std::vector<OptimizerTensorLayout> optimizer_layout(
      const torch::optim::Optimizer& /*optimizer*/) const {
    return {};
  }
  /// Full (unsharded) model parameters and buffers by name, as copies that later training leaves alone
  /// (collective; get_state_dict, save_state). Default: unsupported.
  virtual NamedTensors model_state();
  /// Hands the full parameters and buffers to `sink` in pieces (names unique across pieces) so that an export
  /// never holds the whole model gathered: engines that shard parameters gather one unit per piece and
  /// release it before the next. The tensors may be the model's own (read them before returning). `sink`
  /// must not communicate. Default: one piece, `model_state()`. Collective.
  virtual void visit_model_state(const std::function<void(NamedTensors piece)>& sink) { sink(model_state()); }
  /// Loads full model parameters and buffers; throws CheckpointError on missing or mis-shaped entries.
  /// Default: unsupported.
  virtual void load_model_state(const std::map<std::string, torch::Tensor>& state);
  /// Extra consolidated files save_state writes beside `model.safetensors` (stem, tensors), made from the
  /// full state (for example ZeRO's `zero3_save_16bit_model`).
  virtual std::vector<std::pair<std::string, NamedTensors>> extra_model_files(
      const NamedTensors& /*full_state*/) const {
    return {};
  }
};

/// Makes the engine of one prepared model.
using BackendFactory = std::function<std::unique_ptr<Backend>(const BackendContext&)>;

/// Everything the Accelerator and the tools know about one backend: its identity, what it does with the
/// config, and how to make an engine.
struct BackendDescriptor {
  /// The `backend:` name ("zero").
  std::string name;
  /// Capabilities the engines will have for this config (before any model is prepared): the backend's fact
  /// sheet (config.hpp, `BackendInfo::sharding`) unless a backend registered by a program says otherwise.
  std::function<BackendCapabilities(const Config&)> capabilities = sharding_of;
  /// Settings of the config that have no effect in this run, each with the reason (CPU offload on a CPU run,
  /// ...). May be empty.
  std::function<std::vector<std::string>(const BackendContext&)> notices;
  /// Notes about one optimizer as `prepare` hands it to an engine (CPU offload stepping LibTorch's unfused
  /// optimizer on the CPU shard, ...), added to the Accelerator's notices. May be empty.
  std::function<std::vector<std::string>(const BackendContext&, const torch::optim::Optimizer&)>
      optimizer_notices;
  /// Makes one engine per prepared model.
  BackendFactory factory;
  /// Whether the config asks for activation checkpointing of the Sequential blocks (may be empty: no).
  std::function<bool(const Config&)> activation_checkpointing;
};

/// Backend descriptors by name. Filled explicitly by `register_builtin_backends`, never by static
/// initialisers, so a program links exactly the backends it names.
class BackendRegistry {
 public:
  /// Registers (or replaces) a descriptor under its name.
  void add(BackendDescriptor descriptor);
  /// The descriptor a run with `world_size` processes uses for `name` (following the config's
  /// `BackendInfo::multi_process_replacement`: local -> ddp); throws UnsupportedOperation naming the
  /// registered ones.
  const BackendDescriptor& resolve(const std::string& name, int world_size) const;
  bool contains(const std::string& name) const;
  /// Registered names, sorted.
  std::vector<std::string> names() const;

 private:
  std::map<std::string, BackendDescriptor> descriptors_;
};

/// Registers every backend this build of accelerate-cpp ships.
void register_builtin_backends(BackendRegistry& registry);

}  // namespace accel
