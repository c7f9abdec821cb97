// Accelerator's pipeline parallelism: prepare_pipeline cuts the model into this rank's stage as the config's
// pipeline_config says, pipeline_step / pipeline_evaluate run the stage's schedule (pipeline.hpp).
#include <accel/accelerator.hpp>
#include <accel/pipeline.hpp>

#include <ATen/autocast_mode.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>

namespace accel {

const char* const Accelerator::kPipelineLoaderMessage =
    "a pipeline needs the same batches on every stage of a replica (the first stage reads the inputs, the "
    "last the targets), which a data loader prepared after prepare_pipeline gives (it shards the data over "
    "the replicas); one prepared before cannot: prepare the data loaders after prepare_pipeline";

namespace {

torch::Tensor on(const torch::Tensor& t, torch::Device device) {
  return t.defined() ? t.to(device) : t;  // undefined: the inputs or targets a stage does not read
}

}  // namespace

void Accelerator::refuse_sharding_with_pipeline() const {
  const auto caps = descriptor_->capabilities(config_);
  if (!caps.shards_gradients && !caps.shards_parameters && !caps.communicates_on_micro_steps) return;
  throw UnsupportedOperation(fmt::format(
      "pipeline_config.stages is {} with backend {}, which shards gradients or parameters across the "
      "data-parallel ranks; as in DeepSpeed (\"ZeRO-2 and ZeRO-3 are incompatible with pipeline "
      "parallelism\"), a pipeline is combined only with backends that reduce each stage's gradients once per "
      "step: a pipeline accumulates gradients over its micro-batches, which gradient sharding would "
      "reduce-scatter (and parameter sharding gather) once per micro-batch, tens of times per step; use "
      "backend: ddp, zero with zero_stage: 1, or fsdp with fsdp_sharding_strategy: NO_SHARD",
      config_.pipeline.stages, descriptor_->name));
}

pipeline::PipelineStage& Accelerator::prepare_pipeline(const torch::nn::Sequential& model) {
  return prepare_pipeline_stage([&](int stage, int stages) {
    return std::make_unique<pipeline::PipelineStage>(model, stage, stages,
                                                     pipeline::parse_partition(config_.pipeline.partition));
  });
}

pipeline::PipelineStage& Accelerator::prepare_pipeline(
    const std::function<torch::nn::AnyModule(int stage)>& build_stage) {
  return prepare_pipeline_stage([&](int stage, int stages) {
    // One "layer" per stage: the stage's module is layer `stage` of the pipeline.
    return std::make_unique<pipeline::PipelineStage>(build_stage, stages, stage, stages);
  });
}

pipeline::PipelineStage& Accelerator::prepare_pipeline_stage(
    const std::function<std::unique_ptr<pipeline::PipelineStage>(int stage, int stages)>& make_stage) {
  const PipelineConfig& pc = config_.pipeline;
  if (pc.stages < 1 || world_size_ % (pc.stages * tp_comm_->world_size()) != 0) {
    throw UsageError(fmt::format(
        "prepare_pipeline: pipeline_config.stages is {} but {} process(es) run; every stage runs in "
        "num_processes / stages processes (one per data-parallel replica), so num_processes must be a "
        "multiple of the stages: run {} x k processes or change pipeline_config.stages",
        pc.stages, world_size_, pc.stages));
  }
  if (pipeline_engine_) {
    throw UsageError(
        "prepare_pipeline: this Accelerator already runs a pipeline; prepare one model per "
        "Accelerator");
  }
  if (!loaders_.empty()) throw UsageError(fmt::format("prepare_pipeline: {}", kPipelineLoaderMessage));
  if (device_.is_cuda()) {
    throw UnsupportedOperation(
        "prepare_pipeline: pipeline stages on CUDA are not supported yet (NCCL matches point-to-point "
        "operations in issue order, which the 1F1B interpreter does not group); run on CPU (use_cpu: true)");
  }
  refuse_sharding_with_pipeline();
  // Rank = stage x lanes + lane, lane = replica x tp + tp rank (pipe-major, then data, tensor innermost):
  // the ranks of one stage are neighbours (one machine, where the data-parallel reduction and the tensor-
  // parallel all-reduces move the most bytes); the stages of one lane form a pipeline, each tensor-parallel
  // rank passing its activations to the same tensor-parallel rank of the next stage.
  const int tp = tp_comm_->world_size();
  const int lanes = world_size_ / pc.stages, stage = rank_ / lanes;
  std::vector<std::vector<int>> pipes(static_cast<std::size_t>(lanes)),
      data(static_cast<std::size_t>(pc.stages * tp));
  for (int r = 0; r < world_size_; ++r) {
    pipes[static_cast<std::size_t>(r % lanes)].push_back(r);
    data[static_cast<std::size_t>(r / lanes * tp + r % tp)].push_back(r);
  }
  pipe_comm_ = comm_->split(pipes);
  data_comm_ = comm_->split(data);
  pipeline_stage_ = make_stage(stage, pc.stages);
  if (!pipeline_stage_->ties().empty() && descriptor_->capabilities(config_).shards_optimizer_state) {
    const auto& tie = pipeline_stage_->ties().front();
    throw UnsupportedOperation(fmt::format(
        "prepare_pipeline: the model uses one parameter in layers of several stages ({}), whose gradients "
        "are summed over those stages after the step; backend {} hands them to the sharded optimizer "
        "before that, which is not supported; use backend: ddp, or untie the layers",
        fmt::join(tie.names, ", "), descriptor_->name));
  }
  auto module = pipeline_stage_->module().ptr();
  module->to(device_);
  // The stage is a prepared model whose backend engine spans the stage's replicas: the user's optimizer is
  // prepared against it, and its gradients are reduced across the replicas once, during the stage's last
  // backward of each step.
  BackendContext context = context_;
  context.comm = data_comm_.get();
  context.rank = data_comm_->rank();
  context.world_size = data_comm_->world_size();
  PreparedModel prepared{module, descriptor_->factory(context), 0};
  prepared.engine->prepare_model(*module);
  if (data_comm_->world_size() > 1) connect_sync_batchnorm(*module, data_comm_.get());
  models_.push_back(std::move(prepared));
  pipeline_model_ = models_.size() - 1;
  const int micro_batches = pc.micro_batches > 0 ? pc.micro_batches : config_.gradient_accumulation_steps;
  pipeline_engine_ =
      std::make_unique<pipeline::PipelineEngine>(*pipeline_stage_, pipe_comm_, pc.schedule, micro_batches);
  pipeline::PipelineEngine::BackwardHooks hooks;
  hooks.before = [this](bool last) { models_[pipeline_model_].engine->before_backward(last); };
  hooks.after = [this](bool last) { models_[pipeline_model_].engine->after_backward(last); };
  if (scaler_) hooks.loss_scale = [this] { return scaler_->get_scale(); };
  pipeline_engine_->set_backward_hooks(std::move(hooks));
  enable_autocast();
  return *pipeline_stage_;
}

pipeline::PipelineEngine& Accelerator::pipeline_engine(const char* what) {
  if (!pipeline_engine_) {
    throw UsageError(
        fmt::format("{}: no pipeline is prepared; call accelerator.prepare_pipeline(model) first", what));
  }
  return *pipeline_engine_;
}

namespace {

// This replica's rows of a batch every replica passed whole (undefined stays undefined).
torch::Tensor replica_rows(const torch::Tensor& t, int replica, int replicas, const char* what) {
  if (!t.defined() || replicas == 1) return t;
  const auto rows = t.dim() == 0 ? 0 : t.size(0);
  if (rows % replicas != 0) {
    throw UsageError(fmt::format(
        "pipeline: the {} have {} rows, which do not split into {} data-parallel replicas (num_processes / "
        "pipeline_config.stages); pass a batch whose size is a multiple of {} x the micro-batches",
        what, rows, replicas, replicas));
  }
  const auto per = rows / replicas;
  return t.slice(0, per * replica, per * (replica + 1));
}

}  // namespace

double Accelerator::replica_mean(double value) {
  if (data_comm_->world_size() == 1) return value;
  auto t = torch::tensor({value}, torch::kFloat64);
  data_comm_->all_reduce(t, ReduceOp::Mean);
  return t.item<double>();
}

double Accelerator::pipeline_step(const torch::Tensor& inputs, const torch::Tensor& targets,
                                  const pipeline::LossFunction& loss) {
  auto& engine = pipeline_engine("pipeline_step");
  // Batches of a prepared loader are already this replica's (it shards over the replicas); others are the
  // global batch, of which each replica takes its rows.
  const int replica = data_comm_->rank(), replicas = loaders_.empty() ? data_comm_->world_size() : 1;
  auto& prepared = models_[pipeline_model_];
  if (prepared.engine->capabilities().shards_optimizer_state &&
      std::find(optimizer_model_.begin(), optimizer_model_.end(), pipeline_model_) ==
          optimizer_model_.end()) {
    throw UsageError(fmt::format(
        "pipeline_step: backend {} keeps each replica's share of the optimizer state, but no optimizer over "
        "the stage's parameters is prepared; call accelerator.prepare(optimizer) after prepare_pipeline",
        backend_name()));
  }
  sync_gradients_ = true;
  std::fill(skipped_.begin(), skipped_.end(), false);
  double mean = engine.train_step(on(replica_rows(inputs, replica, replicas, "inputs"), device_),
                                  on(replica_rows(targets, replica, replicas, "targets"), device_), loss);
  if (autocast_on_) at::autocast::clear_cache();
  // fp16: every stage unscales its gradients; an overflow on any stage skips the step on all of them (the
  // flags are reduced over the whole job).
  unscale_and_check();
  mean = replica_mean(mean);
  if (optimizers_.empty() || !optimizer_step_was_skipped()) completed_steps_ += 1;
  micro_steps_ += engine.micro_batches();
  return mean;
}

double Accelerator::pipeline_evaluate(const torch::Tensor& inputs, const torch::Tensor& targets,
                                      const pipeline::LossFunction& loss) {
  auto& engine = pipeline_engine("pipeline_evaluate");
  const int replica = data_comm_->rank(), replicas = loaders_.empty() ? data_comm_->world_size() : 1;
  double mean = engine.evaluate(on(replica_rows(inputs, replica, replicas, "inputs"), device_),
                                on(replica_rows(targets, replica, replicas, "targets"), device_), loss);
  mean = replica_mean(mean);
  return mean;
}

}  // namespace accel
