#pragma once
/// \file tied_embeddings.hpp
/// The interface through which accel::peft::get_peft_model unties a model's output head from its input
/// embedding (PEFT's modules_to_save semantics for a tied embedding, LoraConfig::ensure_weight_tying). Kept
/// apart from lora.hpp so that model headers can implement it without LibTorch's whole API.

#include <string>
#include <utility>

namespace accel::peft {

/// A model whose output head may share its input embedding's weight (transformers' tie_word_embeddings),
/// so that get_peft_model can give a tied embedding in modules_to_save PEFT's semantics. The model class
/// inherits it beside torch::nn::Module (accel::llm::CausalLM does).
class TiedEmbeddings {
 public:
  virtual ~TiedEmbeddings() = default;
  /// When tied: the dotted paths of the output head (transformers' get_output_embeddings, e.g. `lm_head`) and
  /// of the input embedding whose weight it uses (e.g. `model.embed_tokens`); empty strings when not tied.
  virtual std::pair<std::string, std::string> tied_embeddings() const = 0;
  /// Gives the head its own weight, a copy of the shared one (frozen as the embedding's was), and makes the
  /// model untied from then on (its config says so, as PEFT's merge sets tie_word_embeddings false).
  virtual void untie_word_embeddings() = 0;
};

}  // namespace accel::peft
