#pragma once
/// \file pipeline.hpp
/// The pipeline-parallel runtime: a model's layers cut into stages, one stage per rank, and an engine that
/// runs one stage's action list of pipeline_schedule.hpp over the Communicator's point-to-point operations.
/// For now the pipeline spans every rank of the communicator: rank r runs stage r.
///
/// Example (every rank runs the same program):
///
///     auto comm = accel::Communicator::create(accel::ProcessState::from_environment(), torch::kCPU);
///     torch::manual_seed(0);
///     torch::nn::Sequential model(torch::nn::Linear(8, 16), torch::nn::ReLU(), torch::nn::Linear(16, 4));
///     accel::pipeline::PipelineStage stage(model, comm->rank(), comm->world_size());
///     accel::pipeline::PipelineEngine engine(stage, comm, accel::pipeline::Schedule::OneFOneB, 4);
///     torch::optim::SGD optimizer(stage.parameters(), 0.1);
///     optimizer.zero_grad();
///     double loss = engine.train_step(inputs, targets, [](const torch::Tensor& out, const torch::Tensor& y)
///     {
///       return torch::mse_loss(out, y);
///     });
///     optimizer.step();
///
/// Messages: before each activation or gradient a fixed-size int64 header (kind, micro-batch, micro-batch
/// count, step kind, dtype, shape) goes to the peer, so that the receiver allocates the tensor and checks
/// that both stages run the same step. A stage that fails (its layers or loss throw, a header does not match)
/// sends an abort message with its error to its neighbours, which fail at their next receive from it and pass
/// the message on: every rank throws, naming the stage and micro-batch that failed, instead of hanging. A
/// neighbour that expects nothing more from the failed stage in that step fails when its pending sends reach
/// the communicator's timeout. After a failure the ranks' message streams are out of step: the engine refuses
/// further steps (end the processes; accel-launch stops every rank when one exits with an error).

#include <accel/distributed/communicator.hpp>
#include <accel/parallel/pipeline_schedule.hpp>

#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/ordered_dict.h>

#include <cstdint>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace accel::pipeline {

/// The loss of one micro-batch: a tensor of one element from the last stage's output and the micro-batch's
/// targets (e.g. torch::mse_loss(output, target), a mean over the micro-batch).
using LossFunction = std::function<torch::Tensor(const torch::Tensor& output, const torch::Tensor& target)>;

/// The stage boundaries `method` gives for `model` on `stages` stages, from its layers' parameter counts and
/// type names (`partition` of pipeline_schedule.hpp).
std::vector<int> partition_model(const torch::nn::Sequential& model, int stages,
                                 const PartitionMethod& method = {});

/// The layers of one pipeline stage: layers [boundaries()[stage], boundaries()[stage + 1]) of the model.
class PipelineStage {
 public:
  /// Stage `stage` of `stages` of the whole `model`, partitioned by `method` (by default balanced by
  /// parameter counts). Every rank builds the same model (e.g. with the same seed) and keeps its own layers,
  /// which share their parameters with `model`. ConfigError for a bad partition, UsageError for a stage
  /// outside [0, stages).
  PipelineStage(const torch::nn::Sequential& model, int stage, int stages,
                const PartitionMethod& method = {});
  /// Builds only this stage's layers, `make_layer(i)` for each of its global layer indices i, of `layers`
  /// layers in all; `boundaries` (stages + 1 entries from 0 to `layers`) default to partition_uniform.
  PipelineStage(const std::function<torch::nn::AnyModule(int layer)>& make_layer, int layers, int stage,
                int stages, std::vector<int> boundaries = {});

  int stage() const noexcept { return stage_; }
  int stages() const noexcept { return static_cast<int>(boundaries_.size()) - 1; }
  /// Stage s holds layers [b[s], b[s + 1]) of the whole model.
  const std::vector<int>& boundaries() const noexcept { return boundaries_; }
  /// This stage's layers, each named by its global layer index ("3"): `module()->to(device)`, `train()`,
  /// `eval()` and the buffers are the usual Module calls.
  torch::nn::Sequential& module() noexcept { return layers_; }
  /// Runs this stage's layers in order.
  torch::Tensor forward(const torch::Tensor& input);
  /// This stage's parameters (hand them to the optimizer).
  std::vector<torch::Tensor> parameters() const;
  /// This stage's parameters named as in the whole model ("3.weight" for layer 3), so that per-stage
  /// checkpoints can be merged or re-partitioned.
  torch::OrderedDict<std::string, torch::Tensor> named_parameters() const;

  /// A parameter the whole model uses in layers that several stages hold (the same module at two places of
  /// the Sequential, as an embedding tied to the output layer): each of those stages holds a copy, and the
  /// engine sums their gradients over those stages after each train_step, so the copies stay equal, as
  /// DeepSpeed's TiedLayerSpec does. Found from the whole model (stages built from layer factories have
  /// none).
  struct Tie {
    std::vector<std::string> names;  ///< every global name of the parameter ("0.weight", "4.weight")
    std::vector<int> stages;         ///< the stages holding it, ascending (at least two)
    std::string name_on(int stage, const std::vector<int>& boundaries) const;
  };
  const std::vector<Tie>& ties() const noexcept { return ties_; }
  /// This stage's copy of `tie`'s parameter; undefined when the stage holds none.
  torch::Tensor tied_parameter(const Tie& tie) const;

  /// The whole model's parameters and buffers that no layer of this stage uses, named by global layer
  /// ("5.weight"): other stages train them, so this rank's values go stale (empty for a stage built from
  /// layer factories).
  const std::vector<std::pair<std::string, torch::Tensor>>& foreign_tensors() const noexcept {
    return foreign_;
  }
  /// Whether the stage was cut from a whole model (the Sequential constructor), whose other layers then
  /// exist on this rank too: the same on every rank of a pipeline.
  bool cut_from_model() const noexcept { return cut_from_model_; }
  /// Makes reading those tensors' memory (torch::save of the whole model, a forward through it) throw
  /// `message(name)` instead of giving stale values.
  void poison_foreign(const std::function<std::string(const std::string& name)>& message);
  /// Gives those tensors the values of `whole` (the whole current model, named by global layer) in fresh
  /// memory, which lifts the error; a name `whole` lacks stays poisoned.
  void restore_foreign(const std::map<std::string, torch::Tensor>& whole);

 private:
  int stage_;
  std::vector<int> boundaries_;
  torch::nn::Sequential layers_;
  std::vector<Tie> ties_;
  std::vector<std::pair<std::string, torch::Tensor>> foreign_;
  bool cut_from_model_ = false;
};

/// Runs this rank's stage through a pipeline step. Every rank of the communicator is one stage, rank r
/// stage r. Not thread-safe; the stage and the communicator must outlive the engine.
class PipelineEngine {
 public:
  /// UsageError when `stage` is not this rank's stage (its stage() must be comm->rank() and its stages()
  /// comm->world_size()); ConfigError for `micro_batches` < 1.
  PipelineEngine(PipelineStage& stage, std::shared_ptr<Communicator> comm, Schedule schedule,
                 int micro_batches);

  /// One training step (collective: every rank calls it). `inputs` (used on stage 0) and `targets` (used on
  /// the last stage, may be undefined elsewhere) are split into micro-batches along dim 0 (torch::chunk);
  /// their row count must be a multiple of micro_batches. Runs the stage's make_schedule list: the last stage
  /// backpropagates loss / micro_batches, so the gradients added to the stage's parameters' .grad equal those
  /// of the whole batch's mean loss (zero them before the step, as in a plain loop). Returns the mean of the
  /// micro-batches' losses on every rank (the last stage broadcasts it). Errors: see the file comment.
  double train_step(const torch::Tensor& inputs, const torch::Tensor& targets, const LossFunction& loss);

  /// Forward only, without autograd (make_forward_only_schedule; point to point: every rank calls it).
  /// Returns on the last stage its outputs of every micro-batch concatenated along dim 0, elsewhere an
  /// undefined tensor. Train/eval mode is the module's own (`stage.module()->eval()`).
  torch::Tensor evaluate(const torch::Tensor& inputs);
  /// Forward only: the mean of the micro-batches' losses on every rank (collective).
  double evaluate(const torch::Tensor& inputs, const torch::Tensor& targets, const LossFunction& loss);

  /// The most micro-batches whose saved activations this stage held at once during the last train_step:
  /// micro_batches under GPipe, min(stages - stage, micro_batches) under 1F1B (each micro-batch's input and
  /// output are freed after its backward).
  int peak_live_micro_batches() const noexcept { return peak_live_; }

  /// Where the last train_step's time went on this stage, and what it held for backward. Times are host
  /// wall clock (on CUDA the kernels run asynchronously: compute_s is then mostly launch time).
  struct StepStats {
    double step_s = 0;     ///< from the start of the step to the end of its action list, in seconds
    double compute_s = 0;  ///< in Forward and Backward (the stage's layers; the loss on the last stage)
    double wait_s = 0;     ///< blocked in receives and WaitSends, in seconds
    int peak_live = 0;     ///< peak_live_micro_batches()
    /// The most bytes of micro-batch inputs and outputs the stage held at once for backward (the tensors at
    /// the stage's boundaries; what autograd saves inside the layers is not counted), in bytes.
    std::int64_t peak_activation_bytes = 0;
  };
  /// The statistics of the last train_step on this rank (zero before the first).
  const StepStats& last_step_stats() const noexcept { return stats_; }

  /// What runs around each micro-batch's backward during train_step (the Accelerator's data-parallel
  /// backends and loss scaling plug in here).
  struct BackwardHooks {
    /// Before / after the backward of each micro-batch on this stage; `last` is true for the stage's last
    /// backward of the step, after which its gradients hold the whole batch's (a data-parallel backend
    /// reduces them then, and only then).
    std::function<void(bool last)> before, after;
    /// The factor the last stage multiplies each micro-batch's loss by before its backward (fp16 loss
    /// scaling); empty: 1. The returned mean loss is unscaled.
    std::function<double()> loss_scale;
  };
  void set_backward_hooks(BackwardHooks hooks) { hooks_ = std::move(hooks); }

  Schedule schedule() const noexcept { return schedule_; }
  int micro_batches() const noexcept { return micro_batches_; }

 private:
  struct Step;
  void reduce_ties();
  double run(Step& step, const torch::Tensor& inputs, const torch::Tensor& targets);
  // Runs the stage's action list, timing it in stats_ (train_step); `current` is the action running.
  void run_actions(const std::vector<Action>& actions, Step& step, std::optional<Action>& current);
  // After `e` ended a step at `current`: tells the neighbours, keeps the pending sends, and throws.
  [[noreturn]] void fail_step(const std::exception& e, Step& step, const std::optional<Action>& current);
  void execute(const Action& action, Step& step);
  // The Forward action of micro-batch `mb`, and its loss on the last stage.
  void forward(int mb, Step& step);
  // This stage's layers on `input` (without autograd unless `train`), naming the layers when they throw.
  torch::Tensor forward_layers(const torch::Tensor& input, bool train);
  // The last stage's loss of micro-batch `mb` from its output `out`, checked and recorded in the step.
  static torch::Tensor micro_batch_loss(Step& step, int mb, const torch::Tensor& out);
  // The Backward action of micro-batch `mb`, between the backward hooks.
  void backward(int mb, Step& step);
  void send_tensor(const torch::Tensor& tensor, int peer, int micro_batch, std::int64_t mode,
                   std::vector<std::unique_ptr<CollectiveHandle>>& into);
  torch::Tensor recv_tensor(Step& step, int peer, int micro_batch, const torch::Tensor* like);
  void send_abort(int peer, int stage, int micro_batch, const std::string& message);

  PipelineStage& stage_;
  std::shared_ptr<Communicator> comm_;
  Schedule schedule_;
  int micro_batches_;
  int peak_live_ = 0;
  BackwardHooks hooks_;
  std::vector<std::shared_ptr<Communicator>> tie_comms_;  ///< per stage_.ties(): the stages holding it
  StepStats stats_;
  std::string failed_;  ///< the error of a failed step; non-empty: no further steps
  /// After a failure: the abort messages to the neighbours and the step's pending sends, kept alive so that
  /// the transport can still deliver them when the peer posts its receive and never reads freed
  /// memory.
  std::vector<std::unique_ptr<CollectiveHandle>> kept_sends_;
};

}  // namespace accel::pipeline
