#pragma once
/// \file merge_export.hpp
/// The merged model a LoRA or QLoRA run ships: PEFT's `merge_and_unload()` and, for a 4-bit base (QLoRA),
/// transformers' `dequantize()`, so that the model holds only ordinary tensors that transformers'
/// `from_pretrained` loads without bitsandbytes.
///
///   accel::llm::merge_and_dequantize(*model, *lora);   // then save_pretrained / Accelerator::save_model
///
/// Local to a rank: no collective (call it on every rank of a replicated model, or on an unprepared one).

#include <accel/nn/lora.hpp>

#include <torch/nn/module.h>

#include <string>
#include <vector>

namespace accel::llm {

/// Merges every adapter of `lora` into `model` and removes the adapters (LoraModel::merge_and_unload). Each
/// adapted 4-bit layer (accel::quant::Linear4bit: QLoRA) is replaced by a `torch::nn::Linear` whose weight is
/// its NF4 / FP4 weight dequantised in float32 plus the adapters' `scale * B A` (float32), cast to the dtype
/// the weight had before it was quantised (bitsandbytes' `quant_state.dtype`, the model's `torch_dtype`:
/// what transformers' `dequantize()` gives), with its bias; the 4-bit layers no adapter touches are
/// dequantised alike. PEFT's own merge into a bitsandbytes 4-bit layer quantises the sum again (rounding it
/// off); this keeps the sum exact, so the merged model computes what the trained model computed. Returns
/// the dotted paths of the layers replaced. `lora` must not be used afterwards (as after merge_and_unload).
std::vector<std::string> merge_and_dequantize(torch::nn::Module& model, peft::LoraModel& lora);

}  // namespace accel::llm
