#pragma once
/// \file model_arguments.hpp
/// `accel::ModelArguments`: which model a fine-tuning program loads and how it trains it (full, LoRA, QLoRA),
/// with the keys and defaults of TRL's `ModelConfig` (trl/trainer/model_config.py, TRL 1.16), read from a
/// YAML or JSON file (a training type's `TYPE.model.yaml`, which `accel-launch train -t TYPE` passes as
/// `--model_config FILE`) and overridden from the command line (`--model_name_or_path DIR`). Unknown keys are
/// ConfigErrors naming the file, line and the closest key; values this library cannot honour (DoRA, 8-bit
/// LLM.int8 bases) are refused with the reason. Torch-free.
///
///   std::vector<std::string> rest;
///   auto args = accel::TrainingArguments::from_command_line(argc, argv, &rest);
///   auto model_args = accel::ModelArguments::from_command_line(rest, &rest);   // --model_config FILE ...
///   if (model_args.use_peft) { accel::peft::LoraConfig lora = ...; }

#include <accel/trainer/training_arguments.hpp>

#include <optional>
#include <string>
#include <vector>

namespace accel {

/// TRL's ModelConfig keys, with TRL's defaults.
struct ModelArguments {
  std::optional<std::string> model_name_or_path;  ///< a Hugging Face model directory
  std::string model_revision = "main";            ///< accepted; Hub revisions are not downloaded here
  /// float32 | bfloat16 | float16 | auto (TRL's `dtype`; `torch_dtype`, its older name, is read too). Also
  /// the compute dtype of a 4-bit base, as TRL's get_quantization_config passes it (bnb_4bit_compute_dtype).
  std::string dtype = "float32";
  /// null | eager | sdpa (attention runs through scaled_dot_product_attention either way; flash_attention_2
  /// is accepted with a notice: SDPA picks its flash kernel itself where the device has one).
  std::optional<std::string> attn_implementation;
  bool use_peft = false;
  int lora_r = 16;
  double lora_alpha = 32;
  double lora_dropout = 0.05;
  /// Module names (PEFT's list form), or one string: "all-linear" (every Linear but the output head) or a
  /// regular expression (PEFT's string form). TRL turns a one-element list into that string, as here.
  std::vector<std::string> lora_target_modules;
  std::optional<std::string> lora_target_modules_string;
  std::vector<std::string> lora_modules_to_save;
  std::string lora_task_type = "CAUSAL_LM";
  bool use_rslora = false;  ///< scaling lora_alpha / sqrt(r) instead of lora_alpha / r
  /// PEFT's LoraConfig.ensure_weight_tying (TRL's ModelConfig has no key for it; accepted under PEFT's name,
  /// not listed in keys()): a tied embedding in lora_modules_to_save keeps the head tied to it when true;
  /// false (PEFT's default) trains a copy for the lookup and leaves the head frozen (peft::LoraConfig).
  bool ensure_weight_tying = false;
  bool use_dora = false;      ///< refused when true (DoRA's magnitude vector is not implemented)
  bool load_in_8bit = false;  ///< refused when true (LLM.int8 bases are not implemented: use load_in_4bit)
  bool load_in_4bit = false;
  std::string bnb_4bit_quant_type = "nf4";            ///< nf4 | fp4
  bool use_bnb_nested_quant = false;                  ///< double quantisation of the 4-bit absmax
  std::optional<std::string> bnb_4bit_quant_storage;  ///< null | uint8 (the codes are stored as uint8)

  /// Reads a YAML or JSON file. Unknown keys are ConfigErrors naming the file, line and closest key.
  static ModelArguments load_file(const std::string& path);
  static ModelArguments load_string(const std::string& text, const std::string& source = "<string>");
  /// `[--model_config FILE] [--key value | --key=value | --bool_key]...` over `args` (a program's
  /// arguments without argv[0]): the file first, then the overrides in order; validated. Arguments that are
  /// not ModelArguments keys go to `remaining` when given (one edit away from a key is still an error),
  /// else are errors. `remaining` may be `&args`.
  static ModelArguments from_command_line(const std::vector<std::string>& args,
                                          std::vector<std::string>* remaining = nullptr);
  /// Sets one key from its text ("16", "true", "[q_proj, v_proj]").
  void set(const std::string& key, const std::string& value, const std::string& source = "command line");
  /// TRL's __post_init__ rules and this library's: throws ConfigError naming the key and value.
  void validate();

  std::string source;                ///< where the keys came from, for messages
  std::vector<std::string> notices;  ///< keys accepted with a remark (flash_attention_2, model_revision)
  /// The keys this struct reads, with defaults and one-line docs.
  static const std::vector<TrainingKey>& keys();
};

}  // namespace accel
