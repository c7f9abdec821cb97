// Accelerator's pipeline parallelism: prepare_pipeline cuts the model into this rank's stage as the config's
// pipeline_config says, pipeline_step / pipeline_evaluate run the stage's schedule (pipeline.hpp).
#include <accel/accelerator.hpp>
#include <accel/pipeline.hpp>

#include <fmt/format.h>

namespace accel {

const char* const Accelerator::kPipelineLoaderMessage =
    "a pipeline needs the same batch on every stage (the first stage reads its inputs, the last its "
    "targets), but accelerator.prepare_data_loader() gives each rank its own batches: read the data with "
    "torch::data::make_data_loader on every rank instead";

const char* const Accelerator::kPipelineSaveAdvice =
    "save each stage's stage.named_parameters() (the whole model's names) with torch::save";

void Accelerator::refuse_with_pipeline(const char* what, const char* why) const {
  if (pipeline_engine_)
    throw UnsupportedOperation(fmt::format("{} is not supported with a pipeline yet; {}", what, why));
}

namespace {

torch::Tensor on(const torch::Tensor& t, torch::Device device) {
  return t.defined() ? t.to(device) : t;  // undefined: the inputs or targets a stage does not read
}

}  // namespace

pipeline::PipelineStage& Accelerator::prepare_pipeline(const torch::nn::Sequential& model) {
  const PipelineConfig& pc = config_.pipeline;
  if (pc.stages != world_size_) {
    throw UsageError(fmt::format(
        "prepare_pipeline: pipeline_config.stages is {} but {} process(es) run, and each stage runs in one "
        "process; set pipeline_config: {{stages: {}}} in the config (or run {} process(es))",
        pc.stages, world_size_, world_size_, pc.stages));
  }
  if (pipeline_engine_) {
    throw UsageError(
        "prepare_pipeline: this Accelerator already runs a pipeline; prepare one model per "
        "Accelerator");
  }
  if (!loaders_.empty()) throw UsageError(fmt::format("prepare_pipeline: {}", kPipelineLoaderMessage));
  if (config_.mixed_precision != MixedPrecision::No) {
    throw UnsupportedOperation(fmt::format(
        "prepare_pipeline: mixed_precision: {} is not supported with a pipeline yet (no autocast or loss "
        "scaling across stages); set mixed_precision: 'no'",
        to_string(config_.mixed_precision)));
  }
  if (device_.is_cuda()) {
    throw UnsupportedOperation(
        "prepare_pipeline: pipeline stages on CUDA are not supported yet (NCCL matches point-to-point "
        "operations in issue order, which the 1F1B interpreter does not group); run on CPU (use_cpu: true)");
  }
  pipeline_stage_ = std::make_unique<pipeline::PipelineStage>(model, rank_, pc.stages,
                                                              pipeline::parse_partition(pc.partition));
  pipeline_stage_->module()->to(device_);
  const int micro_batches = pc.micro_batches > 0 ? pc.micro_batches : config_.gradient_accumulation_steps;
  pipeline_engine_ =
      std::make_unique<pipeline::PipelineEngine>(*pipeline_stage_, comm_, pc.schedule, micro_batches);
  return *pipeline_stage_;
}

pipeline::PipelineEngine& Accelerator::pipeline_engine(const char* what) {
  if (!pipeline_engine_) {
    throw UsageError(
        fmt::format("{}: no pipeline is prepared; call accelerator.prepare_pipeline(model) first", what));
  }
  return *pipeline_engine_;
}

double Accelerator::pipeline_step(const torch::Tensor& inputs, const torch::Tensor& targets,
                                  const pipeline::LossFunction& loss) {
  auto& engine = pipeline_engine("pipeline_step");
  const double mean = engine.train_step(on(inputs, device_), on(targets, device_), loss);
  completed_steps_ += 1;
  micro_steps_ += engine.micro_batches();
  return mean;
}

double Accelerator::pipeline_evaluate(const torch::Tensor& inputs, const torch::Tensor& targets,
                                      const pipeline::LossFunction& loss) {
  return pipeline_engine("pipeline_evaluate").evaluate(on(inputs, device_), on(targets, device_), loss);
}

}  // namespace accel
