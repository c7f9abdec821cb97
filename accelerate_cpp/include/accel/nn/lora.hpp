#pragma once
/// \file lora.hpp
/// LoRA adapters (Hu et al. 2021; Hugging Face PEFT's `LoraConfig` / `get_peft_model`) for LibTorch models,
/// without touching the model's code: `get_peft_model(model, config)` freezes the model and gives each
/// matching `torch::nn::Linear` two small trainable children, `lora_A` (r x in, Kaiming-uniform as PEFT) and
/// `lora_B` (out x r, zeros), so that the layer computes `W x + b + (alpha / r) * B A dropout(x)`.
///
///   accel::peft::LoraConfig lora;
///   lora.r = 8; lora.lora_alpha = 16; lora.target_modules = {"q_proj", "v_proj"};
///   auto peft = accel::peft::get_peft_model(model, lora);   // 2 lines; the forward code is unchanged
///   torch::optim::AdamW opt(model->parameters(), ...);     // frozen parameters get no gradient
///
/// How, since a LibTorch Linear's forward is not virtual: the adapted layer's weight is watched by an ATen
/// operator observer (RecordFunction), which adds the adapter term in place to the output of the operator
/// that applies the weight (`aten::linear`, or `aten::addmm` / `aten::matmul` with the weight's transpose, as
/// `torch::nn::functional::linear` calls them). The in-place add is recorded by autograd, so gradients reach
/// A and B exactly; backward and other uses of the weight are untouched. Every backend sees the adapters as
/// ordinary parameters (prepared, sharded and checkpointed like any other).
///
/// Tensor-parallel layers (accel::tp::ColumnParallelLinear / RowParallelLinear) are adapted as PEFT's
/// LoraParallelLinear adapts Megatron's: under a column split, B is split by output rows as the weight and A
/// is whole; under a row split, A is split by input columns and B is whole; the whole adapter's gradient is
/// summed over the tensor-parallel group, so every rank holds the same. A is drawn whole on every rank (seed
/// the ranks alike, as for the layers), so N ranks start from one process's adapters. The split adapters are
/// listed by tp::split_parameters (the Accelerator gathers them whole in get_state_dict). A QLoRA base
/// (quant::Linear4bit) adds the term through its output_hook instead.
///
/// Limits: the term is added where the weight goes through those three operators (the module's forward,
/// `F::linear`, `torch::linear`); `W.mm(...)` written by hand is not adapted. Needs RecordFunction enabled
/// (the default) and a Release build of this library (ATen keeps observer inputs only with NDEBUG, as the
/// ZeRO-3 engine's trigger does).

#include <torch/torch.h>
#include <accel/nn/tied_embeddings.hpp>

#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace accel::peft {

/// PEFT's LoraConfig (the fields that change what is trained).
struct LoraConfig {
  int r = 8;
  double lora_alpha = 8;
  double lora_dropout = 0.0;
  /// Module names: a Linear whose dotted path equals one or ends with "." + one is adapted (PEFT's list
  /// form). PEFT's shorthand `{"all-linear"}` (also as target_modules_regex, any case) adapts every Linear
  /// (4-bit and tensor-parallel ones too) except the output head, as peft's _maybe_include_all_linear_layers:
  /// `output_head` when the model has it, else under task_type SEQ_CLS a top-level `score` or `classifier`;
  /// the adapted paths then become target_modules (as PEFT writes them into adapter_config.json).
  std::vector<std::string> target_modules;
  /// Or a regular expression matched against the whole dotted path (PEFT's string form).
  std::string target_modules_regex;
  /// "none": every bias frozen; "all": every bias trained; "lora_only": the adapted layers' biases trained.
  std::string bias = "none";
  /// Modules (by name, as target_modules) trained in full besides the adapters. Naming the input embedding
  /// of a model whose output head shares its weight (TiedEmbeddings, e.g. accel::llm::CausalLM with
  /// tie_word_embeddings) follows ensure_weight_tying.
  std::vector<std::string> modules_to_save;
  /// PEFT's ensure_weight_tying, for a tied embedding in modules_to_save. false (PEFT's default): the lookup
  /// trains its own copy and the head keeps the original weight, frozen (PEFT's ModulesToSaveWrapper; the
  /// model is untied, TiedEmbeddings::untie_word_embeddings: merged, it saves as an untied model). true: the
  /// head stays tied to the trained weight (the adapter then also holds `<head>.weight`, as PEFT writes it).
  /// Written into adapter_config.json; load_adapter refuses a file that says otherwise where it matters: on a
  /// model whose embeddings get_peft_model found tied with one of them in modules_to_save (a file without the
  /// key means false, as PEFT reads it). On an untied model the key changes nothing (PEFT warns), and any
  /// value loads.
  bool ensure_weight_tying = false;
  /// Rank-stabilised LoRA (PEFT's use_rslora): the adapters' scaling is lora_alpha / sqrt(r), not / r.
  bool use_rslora = false;
  /// What all-linear leaves out: the dotted path of the model's output head (transformers'
  /// get_output_embeddings() of a causal LM is `lm_head`); empty: no head.
  std::string output_head = "lm_head";
  /// PEFT's task_type (CAUSAL_LM, SEQ_CLS, ...): under SEQ_CLS without an output head, all-linear leaves out
  /// the classification head (a top-level `score` or `classifier`, PEFT's SEQ_CLS_HEAD_NAMES).
  std::string task_type;
  /// PEFT's get_peft_model(..., autocast_adapter_dtype=True) (peft/tuners/tuners_utils.py
  /// cast_adapter_dtype): true (PEFT's default): the adapters of a bf16 / fp16 base are float32 (drawn in
  /// float32, rounded to the base's dtype and widened again, as PEFT makes them), and the adapter term is
  /// computed as PEFT's Linear.forward computes it: the input cast to float32, `base output + delta` summed
  /// in float32 and rounded once to the output's dtype. false: the adapters keep the base's dtype (TRL's
  /// SFTTrainer passes false under DeepSpeed ZeRO-3 for a model that is not quantised). A 4-bit base's
  /// adapters are float32 either way. Not written into adapter_config.json (PEFT does not write it either);
  /// load_adapter copies the file's values into the adapters' dtype.
  bool autocast_adapter_dtype = true;
};

/// The adapters put on one model: what get_peft_model returns. The adapters live in the model (its
/// children); this handle only names them and offers PEFT's operations. Dropping it changes nothing.
class LoraModel {
 public:
  struct Layer;
  /// `tied_saved`: get_peft_model found the model's head tied to its input embedding with one of them in
  /// modules_to_save (before untying it, without ensure_weight_tying); load_adapter then checks the file's
  /// ensure_weight_tying.
  LoraModel(std::shared_ptr<torch::nn::Module> model, LoraConfig config,
            std::vector<std::shared_ptr<Layer>> layers, bool tied_saved = false);
  ~LoraModel();

  const LoraConfig& config() const noexcept { return config_; }
  /// Dotted paths of the adapted Linear layers, in module order.
  std::vector<std::string> adapted_modules() const;
  /// (trainable, all) parameter element counts.
  std::pair<std::int64_t, std::int64_t> trainable_parameters() const;
  /// PEFT's line: "trainable params: 1,536 || all params: 110,914 || trainable%: 1.3848"; printed and
  /// returned.
  std::string print_trainable_parameters() const;
  /// W += (alpha / r) B A in every adapted layer and stop adding the term (outputs unchanged), with PEFT's
  /// arithmetic bit for bit (peft/tuners/lora/layer.py Linear.get_delta_weight, merge): the delta
  /// (B A) * scaling is computed in the adapters' dtype, except that bf16 / fp16 adapters on the CPU are
  /// multiplied in float32 and the delta rounded to their dtype; then W += delta in W's dtype (a bf16 W with
  /// bf16 adapters is rounded twice, with float32 adapters once). On an unprepared model (before prepare, or
  /// after free_memory): sharded backends hold only a slice of W; merge their gathered state with
  /// merged_state. A tensor-parallel layer merges this rank's part. A 4-bit base (QLoRA) is merged as PEFT
  /// merges it: dequantised, the product added, quantised again (the rounding moves its outputs a little; a
  /// notice on stderr says so).
  void merge();
  /// The inverse of merge: W -= (alpha / r) B A, the term added again (a 4-bit base: quantised again). As
  /// PEFT's unmerge, the delta is rounded to W's dtype before the subtraction.
  void unmerge();
  /// merge(), then remove the adapters: the model is a plain model again, with the merged weights.
  void merge_and_unload();
  /// The merged model's tensors from this adapted model's whole state, where no rank holds a whole weight to
  /// merge into (ZeRO-3 / FULL_SHARD: `accelerator.get_state_dict(model)`, gathered to the main process):
  /// each adapted layer's `<path>.weight` merged by merge()'s arithmetic (the same function: equal bit for
  /// bit), its `lora_A` / `lora_B` tensors dropped, every other tensor passed on, in the state's order. The
  /// given tensors are not changed (each merged weight is a copy; move the state in to free each original as
  /// its copy replaces it). Throws UsageError when an adapted layer's weight or adapters are missing from the
  /// state (a 4-bit base has no float weight: merge it unsharded, accel::llm::merge_and_dequantize).
  std::vector<std::pair<std::string, torch::Tensor>> merged_state(
      std::vector<std::pair<std::string, torch::Tensor>> state) const;
  /// PEFT's files: `dir/adapter_model.safetensors` (keys `base_model.model.<path>.lora_A.weight`, ...) and
  /// `dir/adapter_config.json`, loadable by Python's `PeftModel.from_pretrained`; modules_to_save go in under
  /// their own names (`base_model.model.<path>.weight`), as PEFT writes them. `state`: the model's whole
  /// state when it is prepared on a sharded backend or holds tensor-parallel layers
  /// (`accelerator.get_state_dict(model)`); empty: the model's own tensors (refused for split adapters).
  void save_adapter(const std::string& dir,
                    const std::vector<std::pair<std::string, torch::Tensor>>& state = {}) const;
  /// Reads PEFT adapter files (written by save_adapter or by Python's PEFT) into the adapters: keys, shapes
  /// and lora_alpha / r must match this config. A tensor-parallel layer takes its part of the whole adapter.
  void load_adapter(const std::string& dir);

 private:
  std::shared_ptr<torch::nn::Module> model_;
  LoraConfig config_;
  std::vector<std::shared_ptr<Layer>> layers_;
  bool tied_saved_ = false;
};

/// Adapts `model` in place (see the file comment) and returns the handle. Throws UsageError when no Linear
/// matches the targets, when a target names a module that is not a Linear (or Linear4bit,
/// ColumnParallelLinear, RowParallelLinear), or on an invalid config.
std::shared_ptr<LoraModel> get_peft_model(const std::shared_ptr<torch::nn::Module>& model,
                                          const LoraConfig& config);
template <class M>
std::shared_ptr<LoraModel> get_peft_model(torch::nn::ModuleHolder<M>& model, const LoraConfig& config) {
  return get_peft_model(std::static_pointer_cast<torch::nn::Module>(model.ptr()), config);
}

}  // namespace accel::peft
