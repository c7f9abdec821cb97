// Accelerator's pipeline parallelism: prepare_pipeline cuts the model into this rank's stage as the config's
// pipeline_config says, pipeline_step / pipeline_evaluate run the stage's schedule (pipeline.hpp).
#include <accel/accelerator/accelerator.hpp>
#include <accel/parallel/pipeline.hpp>

#include "accelerator/move_module.hpp"

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
  const auto reduced_once = [](const BackendCapabilities& c) {
    return !c.shards_gradients && !c.shards_parameters && !c.communicates_on_micro_steps;
  };
  if (reduced_once(backend_.descriptor->capabilities(config_))) return;
  throw UnsupportedOperation(fmt::format(
      "pipeline_config.stages is {} with backend {}, which shards gradients or parameters across the "
      "data-parallel ranks; as in DeepSpeed (\"ZeRO-2 and ZeRO-3 are incompatible with pipeline "
      "parallelism\"), a pipeline is combined only with backends that reduce each stage's gradients once per "
      "step: a pipeline accumulates gradients over its micro-batches, which gradient sharding would "
      "reduce-scatter (and parameter sharding gather) once per micro-batch, tens of times per step; use {}",
      config_.pipeline.stages, backend_.descriptor->name, layouts_where(reduced_once)));
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
  if (pc.stages < 1 || state_.world_size % (pc.stages * groups_.tensor->world_size()) != 0) {
    throw UsageError(fmt::format(
        "prepare_pipeline: pipeline_config.stages is {} but {} process(es) run; every stage runs in "
        "num_processes / stages processes (one per data-parallel replica), so num_processes must be a "
        "multiple of the stages: run {} x k processes or change pipeline_config.stages",
        pc.stages, state_.world_size, pc.stages));
  }
  if (pipeline_.engine) {
    throw UsageError(
        "prepare_pipeline: this Accelerator already runs a pipeline; prepare one model per "
        "Accelerator");
  }
  if (!prepared_.loaders.empty())
    throw UsageError(fmt::format("prepare_pipeline: {}", kPipelineLoaderMessage));
  // Through Gloo on host copies (ACCEL_CUDA_COLLECTIVES=gloo) the stages' sends and receives match by tag, as
  // on the CPU.
  if (device_.is_cuda() && groups_.job->options().cuda_collectives == CudaCollectives::Nccl) {
    throw UnsupportedOperation(
        "prepare_pipeline: pipeline stages over NCCL are not supported yet (NCCL matches point-to-point "
        "operations in issue order, which the 1F1B interpreter does not group); run on CPU (use_cpu: true), "
        "or set ACCEL_CUDA_COLLECTIVES=gloo (the stages' transfers through Gloo on host copies)");
  }
  refuse_sharding_with_pipeline();
  // Rank = stage x lanes + lane, lane = replica x tp + tp rank (pipe-major, then data, tensor innermost):
  // the ranks of one stage are neighbours (one machine, where the data-parallel reduction and the tensor-
  // parallel all-reduces move the most bytes); the stages of one lane form a pipeline, each tensor-parallel
  // rank passing its activations to the same tensor-parallel rank of the next stage.
  const int tp = groups_.tensor->world_size();
  const int lanes = state_.world_size / pc.stages, stage = state_.rank / lanes;
  std::vector<std::vector<int>> pipes(static_cast<std::size_t>(lanes)),
      data(static_cast<std::size_t>(pc.stages * tp));
  for (int r = 0; r < state_.world_size; ++r) {
    pipes[static_cast<std::size_t>(r % lanes)].push_back(r);
    data[static_cast<std::size_t>(r / lanes * tp + r % tp)].push_back(r);
  }
  groups_.pipeline = groups_.job->split(pipes);
  groups_.data = groups_.job->split(data);
  pipeline_.stage = make_stage(stage, pc.stages);
  if (!pipeline_.stage->ties().empty() && backend_.descriptor->capabilities(config_).shards_optimizer_state) {
    const auto& tie = pipeline_.stage->ties().front();
    throw UnsupportedOperation(fmt::format(
        "prepare_pipeline: the model uses one parameter in layers of several stages ({}), whose gradients "
        "are summed over those stages after the step; backend {} hands them to the sharded optimizer "
        "before that, which is not supported; use {}, or untie the layers",
        fmt::join(tie.names, ", "), backend_.descriptor->name,
        layouts_where([](const BackendCapabilities& c) { return !c.shards_optimizer_state; })));
  }
  auto module = pipeline_.stage->module().ptr();
  detail::move_module(*module, device_);
  // Each of the stage's layers recomputes its activations in backward (as prepare does for a whole model).
  if (backend_.descriptor->activation_checkpointing && backend_.descriptor->activation_checkpointing(config_))
    enable_activation_checkpointing(*module);
  // The stage is a prepared model whose backend engine spans the stage's replicas: the user's optimizer is
  // prepared against it, and its gradients are reduced across the replicas once, during the stage's last
  // backward of each step.
  BackendContext context = backend_.context;
  context.comm = groups_.data.get();
  context.rank = groups_.data->rank();
  context.world_size = groups_.data->world_size();
  detail::PreparedModel prepared{module, backend_.descriptor->factory(context), 0, nullptr};
  prepared.engine->prepare_model(*module);
  if (groups_.data->world_size() > 1) connect_sync_batchnorm(*module, groups_.data.get());
  prepared_.models.push_back(std::move(prepared));
  pipeline_.model = prepared_.models.size() - 1;
  pipeline_.engine = std::make_unique<pipeline::PipelineEngine>(*pipeline_.stage, groups_.pipeline,
                                                                pc.schedule, pipeline_micro_batches());
  // The whole model's other layers stay at their initial values on this rank: reading them (torch::save of
  // the whole Sequential, a forward through it) throws until free_memory() makes every rank's model current.
  pipeline_.stage->poison_foreign([stage](const std::string& name) {
    return fmt::format(
        "accelerate-cpp: '{}' of the whole model is trained by another pipeline stage (this rank runs stage "
        "{}), so this rank's copy is not current; to save or use the whole model, call "
        "accelerator.free_memory() on every rank first (it makes every rank's model whole and current), or "
        "use accelerator.get_state_dict(stage.module()), save_model or save_state",
        name, stage);
  });
  pipeline::PipelineEngine::BackwardHooks hooks;
  hooks.before = [this](bool last) { prepared_.models[pipeline_.model].engine->before_backward(last); };
  hooks.after = [this](bool last) { prepared_.models[pipeline_.model].engine->after_backward(last); };
  if (scaler_) hooks.loss_scale = [this] { return scaler_->get_scale(); };
  pipeline_.engine->set_backward_hooks(std::move(hooks));
  enable_autocast();
  return *pipeline_.stage;
}

int Accelerator::pipeline_micro_batches() const noexcept {
  return config_.pipeline.micro_batches > 0 ? config_.pipeline.micro_batches
                                            : config_.gradient_accumulation_steps;
}

pipeline::PipelineEngine& Accelerator::pipeline_engine(const char* what) {
  if (!pipeline_.engine) {
    throw UsageError(
        fmt::format("{}: no pipeline is prepared; call accelerator.prepare_pipeline(model) first", what));
  }
  return *pipeline_.engine;
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
  if (groups_.data->world_size() == 1) return value;
  auto t = torch::tensor({value}, torch::kFloat64);
  groups_.data->all_reduce(t, ReduceOp::Mean);
  return t.item<double>();
}

double Accelerator::pipeline_step(const torch::Tensor& inputs, const torch::Tensor& targets,
                                  const pipeline::LossFunction& loss) {
  auto& engine = pipeline_engine("pipeline_step");
  // Batches of a prepared loader are already this replica's (it shards over the replicas); others are the
  // global batch, of which each replica takes its rows.
  const int replica = groups_.data->rank(),
            replicas = prepared_.loaders.empty() ? groups_.data->world_size() : 1;
  auto& prepared = prepared_.models[pipeline_.model];
  if (prepared.engine->capabilities().shards_optimizer_state &&
      std::find(prepared_.optimizer_model.begin(), prepared_.optimizer_model.end(), pipeline_.model) ==
          prepared_.optimizer_model.end()) {
    throw UsageError(fmt::format(
        "pipeline_step: backend {} keeps each replica's share of the optimizer state, but no optimizer over "
        "the stage's parameters is prepared; call accelerator.prepare(optimizer) after prepare_pipeline",
        backend_name()));
  }
  std::fill(prepared_.skipped.begin(), prepared_.skipped.end(), false);
  double mean = engine.train_step(on(replica_rows(inputs, replica, replicas, "inputs"), device_),
                                  on(replica_rows(targets, replica, replicas, "targets"), device_), loss);
  if (autocast_.on) at::autocast::clear_cache();
  // fp16: every stage unscales its gradients; an overflow on any stage skips the step on all of them (the
  // flags are reduced over the whole job).
  unscale_and_check();
  clip_configured_gradients();
  mean = replica_mean(mean);
  clock_.pipeline_step(engine.micro_batches(), prepared_.optimizers.empty() || !optimizer_step_was_skipped());
  return mean;
}

double Accelerator::pipeline_evaluate(const torch::Tensor& inputs, const torch::Tensor& targets,
                                      const pipeline::LossFunction& loss) {
  auto& engine = pipeline_engine("pipeline_evaluate");
  const int replica = groups_.data->rank(),
            replicas = prepared_.loaders.empty() ? groups_.data->world_size() : 1;
  double mean = engine.evaluate(on(replica_rows(inputs, replica, replicas, "inputs"), device_),
                                on(replica_rows(targets, replica, replicas, "targets"), device_), loss);
  mean = replica_mean(mean);
  return mean;
}

torch::Tensor Accelerator::pipeline_predict(const torch::Tensor& inputs) {
  auto& engine = pipeline_engine("pipeline_predict");
  if (!inputs.defined() || inputs.dim() == 0 || inputs.size(0) == 0) {
    throw UsageError(
        "pipeline_predict: the inputs must be a tensor with at least one row along dim 0, given on every "
        "stage (each stage narrows the outputs to the batch's rows)");
  }
  const int replica = groups_.data->rank(),
            replicas = prepared_.loaders.empty() ? groups_.data->world_size() : 1;
  auto mine = replica_rows(inputs, replica, replicas, "inputs");
  const auto rows = mine.size(0), m = static_cast<std::int64_t>(engine.micro_batches());
  if (const auto pad = (m - rows % m) % m; pad > 0) {
    std::vector<std::int64_t> repeat(static_cast<std::size_t>(mine.dim()), 1);
    repeat[0] = pad;
    mine = torch::cat({mine, mine.narrow(0, rows - 1, 1).repeat(repeat)});
  }
  torch::Tensor out = engine.evaluate(on(mine, device_));
  if (autocast_.on) at::autocast::clear_cache();
  auto& pipe = *groups_.pipeline;
  if (pipe.world_size() > 1) {
    // The last stage sends the outputs' shape and dtype, then the outputs, to the replica's other stages.
    constexpr std::int64_t kMaxDims = 8;
    const int last = pipe.world_size() - 1;
    auto header = torch::zeros({kMaxDims + 2}, torch::kInt64);
    if (pipe.rank() == last) {
      auto* h = header.data_ptr<std::int64_t>();
      if (out.dim() > kMaxDims) {
        h[0] = -1;  // every stage throws; none waits for outputs that do not come
        h[1] = out.dim();
      } else {
        h[0] = out.dim();
        h[1] = static_cast<std::int64_t>(out.scalar_type());
        for (std::int64_t d = 0; d < out.dim(); ++d)
          h[2 + d] = out.size(d);
        out = out.contiguous();
      }
    }
    header = header.to(device_);
    pipe.broadcast(header, last);
    header = header.cpu();
    if (header[0].item<std::int64_t>() < 0) {
      throw UsageError(
          fmt::format("pipeline_predict: the last stage's outputs have {} dimensions; at most {}",
                      header[1].item<std::int64_t>(), kMaxDims));
    }
    if (pipe.rank() != last) {
      const auto* h = header.data_ptr<std::int64_t>();
      const std::vector<std::int64_t> sizes(h + 2, h + 2 + h[0]);
      out = torch::empty(sizes,
                         torch::TensorOptions().dtype(static_cast<c10::ScalarType>(h[1])).device(device_));
    }
    pipe.broadcast(out, last);
  }
  return out.narrow(0, 0, rows);
}

}  // namespace accel
