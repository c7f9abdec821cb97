#pragma once
/// \file pipeline_stages.hpp
/// A CausalLM as the torch::nn::Sequential that accel's pipeline engine cuts into stages
/// (Accelerator::prepare_pipeline, the Trainer's Sequential constructor): the token embedding, one layer per
/// block, then the final norm and the output projection. The blocks are the units of the stages.
///
///   accel::llm::CausalLM model(model_config);
///   auto layers = accel::llm::pipeline_layers(model);
///   accel::Config config;  // or the Accelerate YAML: pipeline_config {stages: 2, partition: ...}
///   config.pipeline.stages = 2;
///   config.pipeline.partition = accel::llm::pipeline_partition(model, 2);  // "0,2,4" for 2 blocks
///   accel::Accelerator accelerator(accel::AcceleratorOptions().config(config));
///   auto& stage = accelerator.prepare_pipeline(layers);
///   torch::optim::SGD optimizer(stage.parameters(), 0.1);
///   accelerator.prepare(optimizer);
///   double loss = accelerator.pipeline_step(input_ids, labels, accel::llm::pipeline_loss());
///
/// Local to a rank: no collective.

#include <torch/nn/modules/container/sequential.h>
#include <torch/types.h>

#include <functional>
#include <string>

#include "accel/llm/models/causal_lm.hpp"

namespace accel::llm {

/// The layers of `model` for a pipeline, sharing its parameters (training them trains `model`):
///   layer 0       `embed_tokens`: input_ids [B, T] int64 -> hidden [B, T, hidden]
///   layers 1..L   `block` (model.layers.i) with its rotary tables: hidden -> hidden
///   layer L + 1   `norm` and the head: hidden -> logits [B, T, vocab]
/// With tied embeddings the last layer holds the embedding module itself (child `embed_tokens`), so that
/// PipelineStage finds the tie and the engine sums its gradient over the first and the last stage after
/// each step, as Megatron's embedding group and DeepSpeed's TiedLayerSpec do.
/// Limits: one tensor crosses the stages, so there is no attention mask and no position ids: every row is
/// causal over positions 0..T-1 (batches without padding; labels of -100 still drop positions from the
/// loss). No KV cache (training only). Throws UsageError when `lm_head` is not a plain Linear (quantised or
/// adapted heads are not supported here), or a block is not a DecoderLayer.
torch::nn::Sequential pipeline_layers(const CausalLM& model);

/// The pipeline_config `partition` boundaries for pipeline_layers(model) on `stages` stages: the embedding
/// on the first stage, the norm and head on the last, the blocks spread evenly (the first stages take one
/// more when they do not divide), e.g. "0,2,4" for 2 blocks on 2 stages. UsageError when `stages` is below 1
/// or above the number of blocks.
std::string pipeline_partition(const CausalLM& model, int stages);

/// The loss of one micro-batch for Accelerator::pipeline_step: causal_lm_loss(logits, labels), the mean over
/// the micro-batch's label tokens. The engine averages the micro-batches' losses, so the step's loss is the
/// mean over all label tokens when every micro-batch holds as many (no -100 labels, or as many per
/// micro-batch).
std::function<torch::Tensor(const torch::Tensor& logits, const torch::Tensor& labels)> pipeline_loss();

}  // namespace accel::llm
