#pragma once
/// \file accelerator_parts.hpp
/// The collaborators an `Accelerator` delegates to, one per concern: the process groups, the chosen backend,
/// the prepared objects, the pipeline runner, checkpoint registrations, trackers and autocast. (The
/// accumulation clock is `GradientState`, gradient_state.hpp.) Internal: their layout may change.

#include <accel/backend/backend.hpp>
#include <accel/checkpoint/project_configuration.hpp>
#include <accel/distributed/communicator.hpp>
#include <accel/monitor/tracking.hpp>

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/schedulers/lr_scheduler.h>
#include <torch/serialize/archive.h>

#include <atomic>
#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace accel {
namespace pipeline {
class PipelineStage;
class PipelineEngine;
}  // namespace pipeline
namespace detail {
struct LoaderState;
}  // namespace detail

namespace detail {

/// The process groups of one accelerator. `job` spans every rank; the others are the same group without
/// tensor or pipeline parallelism.
struct ProcessGroups {
  std::shared_ptr<Communicator> job;       ///< every rank of the job
  std::shared_ptr<Communicator> replicas;  ///< what the engines of prepare(model) reduce over (context.comm)
  std::shared_ptr<Communicator>
      data;  ///< this rank's data-parallel replicas (prepared loaders shard over it)
  std::shared_ptr<Communicator> tensor;  ///< this rank's tensor-parallel group (one rank without)
  /// The ranks sharing one batch's positions (sequence or context parallelism; one rank without).
  std::shared_ptr<Communicator> sequence;
  std::shared_ptr<Communicator> pipeline;  ///< this replica's stages, rank = stage (prepare_pipeline)
};

/// The backend plug-in chosen by `backend:` and what its engines share.
struct BackendChoice {
  std::shared_ptr<const BackendRegistry> registry;
  const BackendDescriptor* descriptor = nullptr;
  BackendContext context;
};

/// One prepared model and its backend engine.
struct PreparedModel {
  std::shared_ptr<torch::nn::Module> module;
  std::unique_ptr<Backend> engine;
  int no_sync = 0;  ///< open NoSync scopes
  /// On several ranks: hooks that stop a backward not run by Accelerator::backward (a plain
  /// `loss.backward()` would skip the gradient synchronisation). Type-erased GradReadyHooks.
  std::shared_ptr<void> backward_watch;
};

/// Everything `prepare` took over, in the order it was prepared.
struct PreparedObjects {
  std::vector<PreparedModel> models;
  std::vector<torch::optim::Optimizer*> optimizers;
  std::vector<std::size_t> optimizer_model;  ///< the model (index into models) each optimizer belongs to
  std::vector<bool> skipped;                 ///< per optimizer: its step after the last sync is skipped
  std::vector<torch::optim::LRScheduler*> schedulers;
  std::vector<std::shared_ptr<LoaderState>> loaders;
  std::vector<torch::Tensor> stashed_grads;  ///< parallel to the optimizers' parameters while a cycle is open
  /// Nonzero while Accelerator::backward runs the user's backward (read by the backward watch's hooks, which
  /// may run on autograd's device threads).
  std::shared_ptr<std::atomic<int>> in_backward = std::make_shared<std::atomic<int>>(0);
};

/// prepare_pipeline's stage and the engine that runs it.
struct PipelineRunner {
  std::unique_ptr<pipeline::PipelineStage> stage;
  std::unique_ptr<pipeline::PipelineEngine> engine;
  std::size_t model = 0;  ///< the stage's entry in PreparedObjects::models
};

/// An object registered with register_for_checkpointing.
struct CheckpointedObject {
  std::function<void(torch::serialize::OutputArchive&)> save;
  std::function<void(torch::serialize::InputArchive&)> load;
};

/// What save_state and load_state carry besides the prepared objects.
struct CheckpointRegistry {
  ProjectConfiguration project;
  std::vector<CheckpointedObject> objects;
  std::vector<std::function<void(const std::string&)>> save_hooks, load_hooks;
  bool trainable_only = false;  ///< set_checkpoint_trainable_only
};

/// The experiment trackers of `log_with` and the program's own.
struct TrackerSet {
  std::vector<std::string> names;                 ///< built-in trackers of log_with
  std::vector<std::shared_ptr<Tracker>> custom;   ///< the program's own
  std::vector<std::shared_ptr<Tracker>> started;  ///< started by init_trackers (main process)
  bool is_started = false;
  bool ended = false;  ///< end_training() closed them
};

/// The thread's autocast state before the accelerator switched it on (restored at destruction).
struct AutocastState {
  bool on = false;
  bool prev_enabled = false;
  c10::ScalarType prev_dtype = c10::ScalarType::Undefined;
};

}  // namespace detail
}  // namespace accel
