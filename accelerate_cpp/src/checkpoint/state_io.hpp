#pragma once
// Checkpoint state I/O: what Accelerator::save_state / load_state write and read, as a collaborator the
// accelerator lends its prepared objects to for one save or load. Orchestration (temporary directory, hooks,
// every rank reporting, commit) and the file format live here; the accelerator keeps only its own counters.
//
// Layout of a checkpoint directory (format version 1):
//   model.safetensors, model_1.safetensors ...   full weights and buffers of each prepared model
//   model_16bit.safetensors ...                   the same in fp16/bf16 (zero3_save_16bit_model: true)
//   optimizer.pt, optimizer_1.pt ...              LibTorch archives of each optimizer's state (sharded
//                                                  backends: optimizer_rank<r>.pt per rank)
//   optimizer_full.safetensors ...                 the same state per model parameter
//   (optimizer_reshard.hpp),
//                                                  world-size and backend independent (built-in optimizers):
//                                                  what resuming on another world size or backend reads
//   accelerator_state.safetensors                 counters, scaler, schedulers, loader positions + metadata
//   random_states_<rank>.safetensors              RNG states of each rank
//   custom_checkpoint_<i>.pt                      objects registered with register_for_checkpointing
//   manifest.json                                 written last: every other file's size and XXH64 and the
//                                                  checkpoint id accelerator_state.safetensors repeats
//                                                  (manifest.hpp); load verifies it before touching anything
//
// With tensor parallelism the files are those of the unsplit model (the split parameters and their optimizer
// state gathered over each tensor-parallel group; no LibTorch optimizer archives, which hold one rank's
// slices): loading cuts each rank's slices back out, so any tensor_parallel_size, or none, resumes from it.
//
// With a pipeline (prepare_pipeline) the model and optimizer files are one per global layer instead, written
// by the first replica of the stage that holds the layer, so that a run with another number of stages (or
// replicas), or without a pipeline, loads the layers its stages hold (and a pipeline loads a checkpoint saved
// without one from model.safetensors and optimizer_full.safetensors):
//   layers/layer_<i>.safetensors                  weights and buffers of layer i ("3.weight")
//   layers/optimizer_<o>_layer_<i>.safetensors    optimizer o's per-parameter state of layer i

#include <accel/accelerator/accelerator_parts.hpp>
#include <accel/accelerator/gradient_state.hpp>
#include <accel/backend/backend.hpp>
#include <accel/checkpoint/safetensors.hpp>
#include <accel/config/config.hpp>
#include <accel/data/data_loader.hpp>
#include <accel/distributed/communicator.hpp>
#include <accel/optim/grad_scaler.hpp>
#include <accel/parallel/tensor_parallel.hpp>

#include "checkpoint/xxh64.hpp"

#include <torch/optim/optimizer.h>
#include <torch/optim/schedulers/lr_scheduler.h>
#include <torch/serialize/archive.h>

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace accel::detail {

/// The accelerator's own position in training (its GradientState's counters), saved and restored with the
/// objects.
using TrainingCounters = GradientCounters;

/// What one save or load works on: the accelerator's collaborators, borrowed (not copied) for the call.
struct StateParts {
  const PreparedObjects* prepared = nullptr;                 ///< models, optimizers, schedulers, loaders
  const std::vector<CheckpointedObject>* objects = nullptr;  ///< registered with register_for_checkpointing
  GradScaler* scaler = nullptr;                              ///< fp16 only
  Communicator* comm = nullptr;
  int rank = 0;
  int world_size = 1;
  std::string backend;
  bool shards_optimizer_state = false;
  MixedPrecision mixed_precision = MixedPrecision::No;
  /// With a pipeline: the stage model is models[0] (the only one), its parameters named by global layer.
  struct Pipeline {
    int stages = 1;
    Communicator* replicas = nullptr;  ///< the stage's data-parallel replicas
  };
  std::optional<Pipeline> pipeline;
  /// The ranks the backend engines span (the data-parallel replicas), which hold the slices of sharded
  /// optimizer state; null: `comm`.
  Communicator* replicas = nullptr;
  /// With tensor parallelism (tensor_parallel_size > 1): each model's split parameters (split_parameters).
  int tensor_parallel_size = 1;
  int tensor_parallel_rank = 0;
  std::vector<std::map<std::string, tp::SplitParameter>> tensor_parallel_splits;
  /// Says something once to the user (the accelerator's notices); may be empty.
  std::function<void(std::string)> notice;
  /// Model files hold only the parameters that require grad (Accelerator::set_checkpoint_trainable_only).
  bool trainable_only = false;
};

class StateIO {
 public:
  explicit StateIO(StateParts parts) : p_(std::move(parts)) {}

  /// Writes a checkpoint into `dir` (collective): the main process writes into a temporary directory every
  /// rank adds its own files to, runs `hooks` on it first, and commits it only when every rank succeeded; a
  /// failure on any rank throws on every rank and keeps the previous checkpoint.
  void save(const std::string& dir, const TrainingCounters& counters,
            const std::vector<std::function<void(const std::string&)>>& hooks);
  /// Why `dir` must not be replaced by a checkpoint (it is a file, or a directory holding files that are no
  /// checkpoint's), or empty when it may.
  static std::string foreign_content(const std::string& dir);
  /// The file every checkpoint has (counters, positions, metadata): what marks a directory as one.
  static constexpr const char* kStateFile = "accelerator_state.safetensors";
  /// Loads a checkpoint written by save, converting the optimizer state when the world size, backend or
  /// sharding layout differ; returns the saved counters. Collective.
  TrainingCounters load(const std::string& dir,
                        const std::vector<std::function<void(const std::string&)>>& hooks);

 private:
  std::vector<OptimizerTensorLayout> layouts(std::size_t optimizer) const;
  std::string fingerprints() const;
  std::vector<torch::nn::Module*> modules() const;
  void write_files(const std::string& tmp, const TrainingCounters& counters);
  void write_main_files(const std::string& tmp, const std::vector<NamedTensors>& model_states,
                        const TrainingCounters& counters);
  void load_converted(std::size_t optimizer, const std::string& path);
  void write_layer_files(const std::string& tmp);
  void write_random_states(const std::string& tmp);
  /// The model and optimizer state per global layer: from a pipeline's per-layer files (`per_layer`), or, for
  /// a pipeline stage, from the whole model's files of a checkpoint saved without a pipeline.
  void load_layer_files(const std::string& dir, bool per_layer);
  /// The files load_layer_files reads (state_io.cpp).
  struct LayerFiles;
  /// load_layer_files: the stage model's tensors `names`, each from the file of its layer.
  void load_layer_weights(LayerFiles& files, const std::vector<std::string>& names, const std::string& dir);
  /// load_layer_files: optimizer o's per-parameter state, from the files of the parameters' layers.
  void load_layer_optimizer(LayerFiles& files, const std::vector<std::string>& names, std::size_t o,
                            const std::string& dir);
  /// load: whether the optimizer state must be converted (read per parameter) rather than loaded from the
  /// LibTorch archives.
  bool needs_conversion(const safetensors::File& state_file, bool saved_pipeline,
                        const std::string& saved_world, const std::string& saved_backend) const;
  /// load: checks that the checkpoint holds as many objects of each kind as are prepared and registered.
  void check_counts(const safetensors::File& state_file, const std::string& dir) const;
  /// load without a pipeline: each model's weights, and each optimizer's state (`convert`: per parameter).
  void load_models(const std::string& dir);
  void load_optimizers(const std::string& dir, bool convert, const std::string& saved_world,
                       const std::string& saved_backend);
  /// load: the schedulers', loaders' and loss scaler's positions from accelerator_state.safetensors.
  void load_schedulers(const safetensors::File& state_file);
  void load_loaders(const safetensors::File& state_file, const std::string& dir);
  void load_scaler(const safetensors::File& state_file, const std::string& dir);
  /// load: the objects registered with register_for_checkpointing, and this rank's RNG states.
  void load_custom_objects(const std::string& dir);
  void load_random_states(const std::string& dir, bool convert);
  Communicator& replicas() const { return p_.replicas != nullptr ? *p_.replicas : *p_.comm; }
  /// The split parameters of every model by qualified name (empty without tensor parallelism).
  std::map<std::string, tp::SplitParameter> qualified_splits() const;
  /// Optimizer o's per-parameter state consolidated over `replicas` (kept where `keep`), with tensor
  /// parallelism the split parameters' state gathered over their groups: the unsplit model's. Collective.
  NamedTensors consolidated_state(std::size_t o, const std::vector<OptimizerTensorLayout>& layouts,
                                  const std::map<std::string, std::vector<std::int64_t>>& shapes,
                                  Communicator& replicas, bool keep) const;
  /// `t`, the saved state `key` of the unsplit model, cut to this rank's slice when it belongs to a split
  /// parameter; contiguous.
  static torch::Tensor tensor_parallel_slice(const std::map<std::string, tp::SplitParameter>& splits,
                                             const std::string& key, torch::Tensor t);

  /// load: verifies every file the checkpoint's manifest lists (each rank a share) before anything is
  /// touched; returns the manifest's checkpoint id, or nullopt when there is no manifest. Collective.
  std::optional<std::string> verify(const std::string& dir);
  /// load: the state file belongs to the verified manifest; without a manifest, the checkpoint predates
  /// manifests (a notice) or is damaged (an error).
  void check_identity(const safetensors::File& state_file, const std::optional<std::string>& verified,
                      const std::string& dir) const;
  /// load, before anything is touched: counters and positions within their ranges.
  void check_ranges(const safetensors::File& state_file, const TrainingCounters& counters,
                    const std::string& dir) const;

  StateParts p_;
  /// save: the files this rank wrote (path -> size and XXH64, computed while writing), for the manifest.
  std::map<std::string, FileDigest> written_;
  std::string checkpoint_id_;  ///< save on rank 0: the new checkpoint's id
};

}  // namespace accel::detail
