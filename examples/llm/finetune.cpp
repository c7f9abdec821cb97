// Supervised fine-tuning of a Hugging Face causal LM (Llama / Qwen2 / Qwen3 checkpoint directory) on a JSONL
// dataset, as TRL's SFTTrainer over transformers + PEFT does it: the training type comes from the files
// `accel-launch train -t TYPE` passes (TYPE.yaml: TrainingArguments; TYPE.accelerate.yaml: the backend;
// TYPE.model.yaml: TRL's ModelConfig keys: full, LoRA or QLoRA), never from this code.
//
//   accel-launch train -t lora build/examples/llm/finetune --model_name_or_path DIR --dataset data.jsonl
//
// This program's own options (SFTConfig's data keys, TRL's names): --dataset FILE|DIR (required),
// --eval_dataset FILE|DIR, --max_length N (1024), --packing (bfd; --packing_strategy bfd|bfd_split|wrapped),
// --completion_only_loss true|false, --assistant_only_loss (a chat template without {% generation %} markers
// is swapped for TRL 1.16's training variant when TRL ships one for its exact text, as SFTTrainer does;
// logged; otherwise refused), --save_merged (a LoRA run also writes the merged model),
// --fused_linear_cross_entropy true|false (true: the loss chunk by chunk from the hidden states, the
// vocabulary's logits never whole; docs/llm.md), --adapter_init DIR (a LoRA run starts from these PEFT
// adapter files, loaded after get_peft_model, instead of a fresh initialisation: to continue from an adapter,
// or to start from exactly Python PEFT's), --vocab_parallel true|false (under tensor parallelism, also split
// the embedding and the head over the vocabulary, the loss computed vocabulary-parallel; docs/llm.md). It
// writes what users ship into output_dir: the PEFT adapter (adapter/) or the full model (model/), each with
// the tokenizer files beside it.
#include <accel/accelerator/resolved_config.hpp>
#include <accel/checkpoint/safetensors.hpp>
#include <accel/config/weight_loading.hpp>
#include <accel/llm/data/chat_template.hpp>
#include <accel/llm/data/jsonl_dataset.hpp>
#include <accel/llm/models/causal_lm.hpp>
#include <accel/llm/models/empty_weights.hpp>
#include <accel/llm/models/sequence_parallel.hpp>
#include <accel/llm/models/tensor_parallel.hpp>
#include <accel/llm/tokenizers/tokenizer.hpp>
#include <accel/llm/training/merge_export.hpp>
#include <accel/llm/training/sequence_shard.hpp>
#include <accel/llm/training/sft_batches.hpp>
#include <accel/monitor/memory.hpp>
#include <accel/nn/lora.hpp>
#include <accel/trainer/model_arguments.hpp>
#include <accel/trainer/trainer.hpp>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <set>

#include <nlohmann/json.hpp>

namespace {

namespace fs = std::filesystem;
namespace llm = accel::llm;

struct SftOptions {
  std::string dataset, eval_dataset, adapter_init;
  llm::SftDataOptions data;
  bool save_merged = false;
  bool vocab_parallel = false;
  llm::SftLossOptions loss;
};

// SFTConfig's max_length as TRL's parser reads it: a whole integer, or None (no truncation).
std::optional<std::int64_t> max_length(const std::string& text) {
  if (text == "None" || text == "null") return std::nullopt;
  std::size_t used = 0;
  std::int64_t n = 0;
  try {
    n = std::stoll(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used == 0 || used != text.size())
    throw accel::UsageError(
        "finetune: --max_length takes a whole number of tokens or None (no truncation), got '" + text + "'");
  return n;
}

// A boolean flag as HfArgumentParser reads it (string_to_bool: yes/true/t/y/1, no/false/f/n/0, any case;
// alone, `--packing`, it is true). Anything else is refused naming the flag and value
// (`--completion_only_loss True` was read as false).
bool flag(const std::vector<std::string>& rest, std::size_t& i) {
  const std::string& key = rest[i];
  if (i + 1 >= rest.size() || rest[i + 1].rfind("--", 0) == 0) return true;
  std::string v = rest[++i];
  std::transform(v.begin(), v.end(), v.begin(), [](unsigned char c) { return std::tolower(c); });
  if (v == "yes" || v == "true" || v == "t" || v == "y" || v == "1") return true;
  if (v == "no" || v == "false" || v == "f" || v == "n" || v == "0") return false;
  throw accel::UsageError("finetune: " + key + " takes true or false (alone: true), got '" + rest[i] + "'");
}

SftOptions parse_sft_options(const std::vector<std::string>& rest) {
  SftOptions o;
  for (std::size_t i = 0; i < rest.size(); ++i) {
    const std::string& key = rest[i];
    auto value = [&]() -> const std::string& {
      if (i + 1 >= rest.size()) throw accel::UsageError("finetune: " + key + " needs a value");
      return rest[++i];
    };
    if (key == "--dataset") {
      o.dataset = value();
    } else if (key == "--eval_dataset") {
      o.eval_dataset = value();
    } else if (key == "--max_length") {
      o.data.max_length = max_length(value());
    } else if (key == "--packing") {
      o.data.packing = flag(rest, i);
    } else if (key == "--packing_strategy") {
      o.data.packing_strategy = value();
    } else if (key == "--completion_only_loss") {
      o.data.completion_only_loss = flag(rest, i);
    } else if (key == "--assistant_only_loss") {
      o.data.assistant_only_loss = flag(rest, i);
    } else if (key == "--adapter_init") {
      o.adapter_init = value();
    } else if (key == "--save_merged") {
      o.save_merged = flag(rest, i);
    } else if (key == "--fused_linear_cross_entropy") {
      const std::string& v = value();
      if (v != "true" && v != "false")
        throw accel::UsageError("finetune: --fused_linear_cross_entropy takes true or false, got '" + v +
                                "'");
      o.loss.fused_linear_cross_entropy(v == "true");
    } else if (key == "--vocab_parallel") {
      const std::string& v = value();
      if (v != "true" && v != "false")
        throw accel::UsageError("finetune: --vocab_parallel takes true or false, got '" + v + "'");
      o.vocab_parallel = v == "true";
    } else {
      throw accel::UsageError(
          "finetune: unknown option '" + key +
          "' (this program's: --dataset, --eval_dataset, --max_length, --packing, "
          "--packing_strategy, --completion_only_loss, --assistant_only_loss, --adapter_init, --save_merged, "
          "--fused_linear_cross_entropy, --vocab_parallel; "
          "the rest are TrainingArguments and ModelArguments keys)");
    }
  }
  if (o.dataset.empty())
    throw accel::UsageError("finetune: give the training data with --dataset FILE.jsonl");
  return o;
}

// The dtype to load in; none for `auto`: the checkpoint config's dtype (float32 if it names none), as TRL
// passes "auto" to from_pretrained (a bf16 checkpoint trains in bf16, not float32).
std::optional<torch::ScalarType> dtype_of(const accel::ModelArguments& m) {
  if (m.dtype == "auto") return std::nullopt;
  if (m.dtype == "bfloat16") return torch::kBFloat16;
  if (m.dtype == "float16") return torch::kFloat16;
  return torch::kFloat32;
}

// `empty`: the parameters hold no memory until the Trainer has prepared (sharded) the model
// (LoadShardedWeights).
llm::CausalLM load_model(const accel::ModelArguments& m, const std::string& dir, bool empty) {
  llm::LoadOptions options;
  if (const auto dtype = dtype_of(m)) options.dtype(*dtype);
  if (empty) return llm::from_pretrained_empty(dir, options);
  if (m.load_in_4bit) {
    accel::quant::Quant4bitOptions q;
    q.type = m.bnb_4bit_quant_type == "fp4" ? accel::quant::QuantType::FP4 : accel::quant::QuantType::NF4;
    q.double_quant = m.use_bnb_nested_quant;
    options.load_in_4bit(q);  // each tensor read, quantised and freed: the full-precision base never exists
  }
  return llm::from_pretrained(dir, options);
}

// TRL's SFTTrainer (trl/trainer/sft_trainer.py): get_peft_model with PEFT's default autocast_adapter_dtype
// (float32 adapters on a bf16 / fp16 base), except under DeepSpeed ZeRO-3 for a model that is not quantised
// (-t stage3, -t minimal), where TRL passes false and the adapters keep the base's dtype.
std::shared_ptr<accel::peft::LoraModel> adapt(llm::CausalLM& model, const accel::ModelArguments& m,
                                              const accel::Config& config) {
  if (!m.use_peft) return nullptr;
  accel::peft::LoraConfig c;
  c.r = m.lora_r;
  c.lora_alpha = m.lora_alpha;
  c.lora_dropout = m.lora_dropout;
  c.target_modules = m.lora_target_modules;
  if (m.lora_target_modules_string) c.target_modules_regex = *m.lora_target_modules_string;
  c.modules_to_save = m.lora_modules_to_save;
  c.use_rslora = m.use_rslora;
  c.ensure_weight_tying = m.ensure_weight_tying;
  c.task_type = m.lora_task_type;
  c.autocast_adapter_dtype = !(config.backend == "zero" && config.zero.stage == 3 && !m.load_in_4bit);
  return accel::peft::get_peft_model(model.ptr(), c);
}

// Every id the data encodes to must have a row in the model's embedding: a tokenizer with added tokens the
// embedding was not resized for fails deep in the lookup otherwise (transformers: "IndexError: index out of
// range in self").
void check_vocabulary(const std::vector<llm::SftExample>& examples, const std::string& path,
                      const std::string& model_dir, const llm::Tokenizer& tok) {
  const auto config = (fs::path(model_dir) / "config.json").string();
  const auto vocab = llm::ModelConfig::from_file(config).vocab_size;
  for (const auto& example : examples) {
    for (const auto id : example.input_ids) {
      if (id < vocab) continue;
      throw accel::ConfigError("finetune: the dataset " + path + " encodes to token id " +
                                   std::to_string(id) + " ('" + tok.id_to_token(id).value_or("?") +
                                   "'), but " + config + " has vocab_size " + std::to_string(vocab) +
                                   ": the tokenizer has tokens the model's embedding lacks; resize the "
                                   "embeddings (transformers' resize_token_embeddings, then save_pretrained) "
                                   "or use the model's own tokenizer",
                               config);
    }
  }
}

// TRL's SFTTrainer under assistant_only_loss: a chat template without {% generation %} markers is swapped for
// TRL's training variant when its text is one TRL knows, else refused (llm::training_chat_template); then, as
// TRL's is_chat_template_stop_token_trained, a warning when the assistant's end-of-turn token gets no loss.
// The saved tokenizer files keep the model's own template, as TRL's do.
void assistant_only_template(std::optional<llm::ChatTemplate>& chat, const std::string& model_dir,
                             const llm::Tokenizer& tok, const llm::EncodeFn& encode,
                             std::vector<std::string>& notices) {
  if (auto training = llm::training_chat_template(*chat)) {
    notices.push_back("assistant_only_loss: " + chat->origin() +
                      " has no {% generation %} markers; it is TRL's " + training->matched +
                      ", so the data is rendered with TRL's " + training->training +
                      " (as SFTTrainer's get_training_chat_template swaps it in)");
    chat = std::move(training->chat_template);
  }
  std::set<int64_t> added;  // transformers' get_added_vocab: tokenizer.json's added_tokens
  std::ifstream in(fs::path(model_dir) / "tokenizer.json");
  const auto tokenizer_json = nlohmann::json::parse(in, nullptr, false);
  if (tokenizer_json.is_object() && tokenizer_json.contains("added_tokens")) {
    for (const auto& t : tokenizer_json["added_tokens"])
      added.insert(t.value("id", int64_t{-1}));
  }
  const bool trained = llm::chat_template_stop_token_trained(
      *chat, encode, [&tok](int64_t id) { return tok.decode({id}); },
      [&added](int64_t id) { return added.count(id) != 0; });
  if (!trained) {
    notices.push_back(
        "warning: the chat template (" + chat->origin() +
        ") does not include the assistant turn's end-of-turn token in the loss mask; the model may not learn "
        "to stop (TRL's SFTTrainer warns the same). Set --assistant_only_loss false to train on the full "
        "sequence, or edit the chat template so the end-of-turn token falls inside "
        "{% generation %}...{% endgeneration %}");
  }
}

llm::SftBatches prepare_data(const std::string& path, const std::string& model_dir, const llm::Tokenizer& tok,
                             llm::SftDataOptions options, std::vector<std::string>& notices) {
  const auto dataset = llm::JsonlDataset::read(path);
  std::optional<llm::ChatTemplate> chat;
  const auto form = dataset.form();
  if (form == llm::RecordForm::kConversational || form == llm::RecordForm::kConversationalPromptCompletion)
    chat = llm::ChatTemplate::from_pretrained(model_dir);
  if (options.eos_token.empty() && tok.eos_token_id())
    options.eos_token = tok.id_to_token(*tok.eos_token_id()).value_or("");
  const llm::EncodeFn encode = [&tok](const std::string& text, bool special) {
    return tok.encode(text, special);
  };
  if (chat && options.assistant_only_loss) assistant_only_template(chat, model_dir, tok, encode, notices);
  auto examples = llm::prepare_sft_examples(dataset, chat ? &*chat : nullptr, encode, options);
  if (examples.empty()) {  // TRL drops the examples left without labels too, then has nothing to train on
    throw accel::ConfigError(
        "finetune: none of the " + std::to_string(dataset.records.size()) + " examples of " + path +
            " keeps a token with a label" +
            (options.max_length ? " within --max_length " + std::to_string(*options.max_length) : "") +
            " (the loss is on completions / assistant turns only, and truncation keeps the first tokens): "
            "raise "
            "--max_length, or shorten the prompts",
        path);
  }
  check_vocabulary(examples, path, model_dir, tok);
  const auto pad = tok.pad_token_id().value_or(tok.eos_token_id().value_or(0));
  return llm::SftBatches(std::move(examples), llm::sft_collator_options(options, pad));
}

// The checkpoint's config.json beside the saved model, its `dtype` (and an older `torch_dtype`) made the
// saved tensors' dtype, as save_pretrained writes it: a float32 run of a bf16 checkpoint must not reload in
// transformers (whose default dtype is the config's) as bf16.
// `tied`: the saved model's tie_word_embeddings (false after LoRA untied a tied embedding it trains, PEFT's
// modules_to_save default: lm_head.weight is written, and the config says so as PEFT's merge sets it).
void write_config(const std::string& from, const fs::path& to, torch::ScalarType dtype, bool tied) {
  const auto src = fs::path(from) / "config.json";
  std::ifstream in(src);
  nlohmann::ordered_json config;
  try {
    config = nlohmann::ordered_json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    throw accel::CheckpointError(src.string() + ": not valid JSON (" + e.what() + ")");
  }
  const std::string name = dtype == torch::kBFloat16  ? "bfloat16"
                           : dtype == torch::kFloat16 ? "float16"
                                                      : "float32";
  if (config.contains("torch_dtype")) config["torch_dtype"] = name;
  config["dtype"] = name;
  if (!tied && config.value("tie_word_embeddings", false)) config["tie_word_embeddings"] = false;
  std::ofstream out(to / "config.json", std::ios::trunc);
  out << config.dump(2) << "\n";
  if (!out) throw accel::CheckpointError("cannot write " + (to / "config.json").string());
}

// adapter_config.json's base_model_name_or_path, as PEFT writes it (the path the base was loaded from), so
// that PEFT's AutoPeftModelForCausalLM.from_pretrained(adapter) finds the base (with null it looks on the
// Hub).
void name_base_model(const fs::path& adapter_config, const std::string& model_dir) {
  std::ifstream in(adapter_config);
  auto config = nlohmann::ordered_json::parse(in);
  in.close();
  config["base_model_name_or_path"] = model_dir;
  std::ofstream out(adapter_config, std::ios::trunc);
  out << config.dump(2) << "\n";
  if (!out) throw accel::CheckpointError("cannot write " + adapter_config.string());
}

// The tokenizer files beside a saved model or adapter, as Hugging Face's Trainer saves them: the model's own
// chat templates (never the training variant assistant_only_loss renders with), the named ones of
// additional_chat_templates/ (tool_use.jinja ...) included, as save_pretrained writes a template set.
void copy_tokenizer_files(const std::string& from, const fs::path& to) {
  for (const char* name : {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                           "chat_template.jinja", "generation_config.json"}) {
    if (fs::exists(fs::path(from) / name))
      fs::copy_file(fs::path(from) / name, to / name, fs::copy_options::overwrite_existing);
  }
  const fs::path templates = fs::path(from) / "additional_chat_templates";
  if (!fs::is_directory(templates)) return;
  fs::create_directories(to / "additional_chat_templates");
  for (const auto& entry : fs::directory_iterator(templates)) {
    if (entry.is_regular_file() && entry.path().extension() == ".jinja")
      fs::copy_file(entry.path(), to / "additional_chat_templates" / entry.path().filename(),
                    fs::copy_options::overwrite_existing);
  }
}

// The merged model of a LoRA run whose parameters are sharded (ZeRO-3 / FULL_SHARD: -t minimal, -t stage3
// with use_peft), where no rank holds a whole weight to merge into: LoraModel::merged_state of the whole
// state gathered to the main process (`state`, transformers' names plus the adapters': merge()'s arithmetic,
// PEFT's), written as `dir/model.safetensors`. Main process only.
void write_merged_state(accel::NamedTensors state, const accel::peft::LoraModel& lora, const fs::path& dir) {
  auto merged = lora.merged_state(std::move(state));
  std::vector<accel::safetensors::TensorView> views;
  for (auto& [name, t] : merged) {
    t = t.detach().to(torch::kCPU).contiguous();
    const auto type = t.scalar_type();
    if (type != torch::kFloat32 && type != torch::kBFloat16 && type != torch::kFloat16)
      throw accel::UsageError("finetune --save_merged: tensor '" + name + "' is " +
                              std::string(c10::toString(type)) + "; a merged model holds float tensors only");
    const auto dt = type == torch::kBFloat16  ? accel::safetensors::DType::BF16
                    : type == torch::kFloat16 ? accel::safetensors::DType::F16
                                              : accel::safetensors::DType::F32;
    views.push_back({name, dt, t.sizes().vec(), t.data_ptr(), t.nbytes()});
  }
  fs::create_directories(dir);
  accel::safetensors::write_file((dir / "model.safetensors").string(), views, {{"format", "pt"}});
}

// `dtype`: the dtype the model was loaded in (a 4-bit base's other parameters, and its merged export, are in
// it).
void save_outputs(accel::Accelerator& acc, llm::CausalLM& model, accel::peft::LoraModel* lora,
                  const std::string& model_dir, const fs::path& out, bool save_merged,
                  torch::ScalarType dtype) {
  accel::NamedTensors state;  // the whole state on the main process, where it is gathered
  if (lora != nullptr) {
    // The adapters from the model's own tensors where they are whole on every rank (no copy of the model);
    // gathered to the main process, one unit at a time, where they are sharded or split (as the Trainer's
    // checkpoints write them). A whole-model get_state_dict on every rank doubled each rank's memory at the
    // end of the run: a Qwen2.5-1.5B LoRA run was killed there for want of memory, its training done.
    if (acc.capabilities().shards_parameters || acc.tensor_parallel_group()->world_size() > 1)
      state = acc.get_state_dict(model, accel::StateDictOn::MainProcess);  // collective
    if (acc.is_main_process()) lora->save_adapter((out / "adapter").string(), state);
    acc.wait_for_everyone();
    if (acc.is_main_process()) {
      name_base_model(out / "adapter" / "adapter_config.json", model_dir);
      copy_tokenizer_files(model_dir, out / "adapter");
    }
    acc.print("finetune: PEFT adapter written to ", (out / "adapter").string());
    if (!save_merged) return;
  }
  if (lora != nullptr && acc.capabilities().shards_parameters) {
    // Sharded parameters: merged from the state already gathered to the main process (a rank's shards cannot
    // be merged in place; merging them wrote the unmerged base with the adapters' keys).
    if (acc.is_main_process()) write_merged_state(std::move(state), *lora, out / "model");
  } else {
    if (lora != nullptr) {
      // A 4-bit base (QLoRA) is dequantised with the adapters added in float32: ordinary tensors in the dtype
      // the base was loaded in, which transformers loads (the 4-bit buffers would load as nothing).
      const auto replaced = llm::merge_and_dequantize(*model, *lora);
      if (!replaced.empty())
        acc.print("finetune: ", replaced.size(),
                  " 4-bit layers merged in float32 and written dequantised (not quantised again)");
    }
    acc.save_model(model, (out / "model").string());
  }
  if (acc.is_main_process()) {
    write_config(model_dir, out / "model", dtype, model->config().tie_word_embeddings);
    copy_tokenizer_files(model_dir, out / "model");
  }
  acc.wait_for_everyone();
  acc.print("finetune: model written to ", (out / "model").string());
}

std::pair<std::int64_t, std::int64_t> count_parameters(torch::nn::Module& model) {
  std::int64_t trainable = 0, total = 0;
  for (const auto& p : model.parameters()) {
    total += p.numel();
    if (p.requires_grad()) trainable += p.numel();
  }
  return {trainable, total};
}

// zero3_init_flag / fsdp_cpu_ram_efficient_loading on ZeRO-3 / FULL_SHARD: the model was built empty; once
// the Trainer has prepared it, each rank reads the slices it owns from the checkpoint
// (Accelerator::load_model), so that no rank holds the whole model. A run resumed from a checkpoint
// (global_step > 0) has its weights from there.
class LoadShardedWeights : public accel::TrainerCallback {
 public:
  LoadShardedWeights(accel::Accelerator& acc, llm::CausalLM model, std::string dir)
      : acc_(acc), model_(std::move(model)), dir_(std::move(dir)) {}
  std::string name() const override { return "LoadShardedWeights"; }
  void on_train_begin(const accel::TrainingArguments&, accel::TrainerState& state,
                      accel::TrainerControl&) override {
    if (done_) return;
    done_ = true;
    if (state.global_step == 0) acc_.load_model(model_, dir_);
  }

 private:
  accel::Accelerator& acc_;
  llm::CausalLM model_;
  std::string dir_;
  bool done_ = false;
};

// Whether the model is built empty and loaded sharded: the config asks for it (accel::loads_weights_sharded),
// on a full fine-tuning or LoRA (ZeRO-3 / FULL_SHARD shard the frozen base too; the adapters, added to the
// empty model, keep their values), not on a 4-bit base (buffers, never sharded), a tensor-parallel split (it
// reads the weights), a LoRA run that resumes (its checkpoints hold the adapters only: the base is read
// whole) or a LoRA run with modules_to_save (get_peft_model copies those modules, and the tied embedding when
// it unties the model, from their loaded values; an empty model has none yet).
bool sharded_loading(const accel::TrainingArguments& args, const accel::ModelArguments& m) {
  const auto config = accel::resolved_config({});
  return accel::loads_weights_sharded(config) && !m.load_in_4bit && config.tensor_parallel_size <= 1 &&
         !(m.use_peft && args.resume_from_checkpoint) && !(m.use_peft && !m.lora_modules_to_save.empty());
}

// Tensor parallelism reads each rank's slices only: the model is built empty, split, then filled
// (accel::llm::load_pretrained_slices). A 4-bit model is refused by the split.
bool tensor_parallel_loading(const accel::ModelArguments& m) {
  return accel::resolved_config({}).tensor_parallel_size > 1 && !m.load_in_4bit;
}

// Fills the split model from its checkpoint and says what this rank allocated for it (CpuMemoryCounter).
void load_slices(accel::Accelerator& acc, llm::CausalLMImpl& model, const std::string& dir) {
  accel::CpuMemoryCounter::install();
  const auto before = accel::CpuMemoryCounter::current();
  accel::CpuMemoryCounter::reset_peak();
  llm::load_pretrained_slices(model, dir);
  acc.print("finetune: tensor-parallel slices loaded: ", accel::CpuMemoryCounter::current() - before,
            " bytes allocated for the weights on the main process (peak ",
            accel::CpuMemoryCounter::peak() - before, ")");
}

bool on_command_line(int argc, char** argv, const std::string& key) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--" + key || a.rfind("--" + key + "=", 0) == 0) return true;
  }
  return false;
}

// The training types' files (TYPE.yaml) are shared with the classifier examples: eval_strategy: epoch and
// load_best_model_at_end by metric_for_best_model: accuracy. This recipe evaluates --eval_dataset only, and
// its evaluation gives eval_loss: without --eval_dataset the files' evaluation is turned off, and their
// accuracy becomes the loss (HF's default metric), each with a notice. Set on the command line, they stay
// (an evaluation asked for without data is refused, as HF's Trainer refuses it).
std::vector<std::string> recipe_evaluation(accel::TrainingArguments& args, const SftOptions& sft, int argc,
                                           char** argv) {
  std::vector<std::string> notices;
  if (sft.eval_dataset.empty() && args.eval_strategy != "no") {
    if (on_command_line(argc, argv, "eval_strategy"))
      throw accel::UsageError(
          "finetune: --eval_strategy " + args.eval_strategy +
          " evaluates --eval_dataset FILE, and none was given; pass it, or --eval_strategy no");
    notices.push_back("no --eval_dataset: evaluation off (" + args.source +
                      " sets eval_strategy: " + args.eval_strategy +
                      (args.load_best_model_at_end ? ", load_best_model_at_end: true" : "") +
                      "); pass --eval_dataset FILE to evaluate");
    args.eval_strategy = "no";
    args.load_best_model_at_end = false;
  }
  const auto metric = args.metric_for_best_model.value_or("");
  if (!sft.eval_dataset.empty() && args.load_best_model_at_end &&
      (metric == "accuracy" || metric == "eval_accuracy") &&
      !on_command_line(argc, argv, "metric_for_best_model")) {
    notices.push_back(
        "metric_for_best_model: " + metric + " (" + args.source +
        ") is not computed by this recipe's evaluation (eval_loss): the best model is chosen by "
        "loss; set --metric_for_best_model to choose another");
    args.metric_for_best_model = "loss";
    args.greater_is_better = false;
  }
  return notices;
}

// The TrainingArguments file (TYPE.yaml, --training_args) with TRL's SFTConfig keys in it, as `trl sft
// --config` files have them: the data keys this program takes are refused naming the option to use; the
// others as not implemented (TrainingArguments alone would call them unknown).
accel::TrainingArguments training_arguments(int argc, char** argv, std::vector<std::string>& rest) {
  try {
    return accel::TrainingArguments::from_command_line(argc, argv, &rest);
  } catch (const accel::ConfigError& e) {
    static const std::set<std::string> taken = {"max_length",          "packing",
                                                "packing_strategy",    "completion_only_loss",
                                                "assistant_only_loss", "eval_dataset"};
    static const std::set<std::string> sft = {
        "dataset_text_field", "padding_free",    "eos_token",         "pad_token",
        "dataset_num_proc",   "dataset_kwargs",  "model_init_kwargs", "chat_template_path",
        "pad_to_multiple_of", "shuffle_dataset", "dataset_name",      "activation_offloading",
        "loss_type"};
    if (taken.count(e.key()) != 0)
      throw accel::ConfigError(std::string(e.what()) + "; '" + e.key() +
                                   "' is TRL's SFTConfig key, which finetune reads from its command line: "
                                   "remove it from the file and pass --" +
                                   e.key() + " VALUE after the program",
                               e.file(), e.line(), e.key());
    if (sft.count(e.key()) != 0)
      throw accel::ConfigError(std::string(e.what()) + "; '" + e.key() +
                                   "' is TRL's SFTConfig key, which finetune does not implement: remove it",
                               e.file(), e.line(), e.key());
    throw;
  }
}

}  // namespace

int main(int argc, char** argv) try {
  std::vector<std::string> rest;
  auto args = training_arguments(argc, argv, rest);
  const auto model_args = accel::ModelArguments::from_command_line(rest, &rest);
  const auto sft = parse_sft_options(rest);
  const auto evaluation_notices = recipe_evaluation(args, sft, argc, argv);
  if (!model_args.model_name_or_path)
    throw accel::UsageError("finetune: give the model directory with --model_name_or_path DIR");
  const std::string dir = *model_args.model_name_or_path;

  const auto tokenizer = llm::Tokenizer::from_pretrained(dir);
  std::vector<std::string> data_notices;
  auto train = prepare_data(sft.dataset, dir, tokenizer, sft.data, data_notices);
  const std::size_t examples = *train.size();
  torch::manual_seed(static_cast<std::int64_t>(args.seed));
  const bool sharded = sharded_loading(args, model_args);
  const bool tp_slices = tensor_parallel_loading(model_args);
  auto model = load_model(model_args, dir, sharded || tp_slices);
  const auto dtype = model->model->embed_tokens->weight.scalar_type();  // the load's (`auto`: the config's)

  // The loss summed over each batch's label tokens, divided by the Trainer by the label tokens of the whole
  // accumulation window on every rank (Hugging Face's num_items_in_batch): any number of ranks and any
  // accumulation give one process's gradients, and transformers' Trainer's.
  bool split = false;  // sequence / context parallelism (the config's sp_size / cp_size), set below
  accel::Trainer<llm::SftBatches> trainer(args, model, std::move(train), [&](llm::SftTensors& batch) {
    if (split) return llm::sequence_parallel_sft_loss(*model, batch, /*num_items_in_batch=*/1, sft.loss);
    return llm::sft_loss(*model, batch, /*num_items_in_batch=*/1, sft.loss);
  });
  trainer.set_num_items(llm::sft_label_count);
  trainer.set_count_tokens([](const llm::SftTensors& batch) { return batch[llm::kInputIds].numel(); });
  if (!sft.eval_dataset.empty()) {
    std::vector<std::string> eval_notices;  // the same template, the same notices: logged once
    trainer.set_eval(prepare_data(sft.eval_dataset, dir, tokenizer, sft.data, eval_notices));
  }
  auto& acc = trainer.accelerator();
  if (sharded && !accel::loads_weights_sharded(acc.config())) {
    throw accel::UsageError(
        "finetune: the Accelerate config asks for sharded loading (zero3_init_flag / "
        "fsdp_cpu_ram_efficient_loading) but the training arguments' config does not shard parameters; "
        "remove the flag or train with ZeRO stage 3 / FULL_SHARD");
  }
  if (sharded) {
    trainer.add_callback(std::make_shared<LoadShardedWeights>(acc, model, dir));
    acc.print("finetune: ", dir,
              " loads sharded (zero3_init_flag / fsdp_cpu_ram_efficient_loading): each rank reads the "
              "slices it owns");
  } else if (accel::loads_weights_sharded(acc.config())) {
    acc.print("finetune: note: ", dir,
              " is loaded whole on every rank: sharded loading covers full "
              "fine-tuning and LoRA (not 4-bit, tensor-parallel, resumed LoRA runs or LoRA with "
              "modules_to_save)");
  }
  // AutoTP: a tensor-parallel size in the config (parallelism_config_tp_size, or a DeepSpeed JSON's
  // tensor_parallel.autotp_size) splits the blocks' projections over the group, before LoRA adapts them;
  // the JSON's tensor_parallel.vocab_parallel_lm_head splits the head too (tensor_parallel_options), and
  // --vocab_parallel the embedding and the head (both set: refused).
  if (acc.tensor_parallel_group()->world_size() > 1) {
    auto options = llm::tensor_parallel_options(acc.config());
    if (sft.vocab_parallel) options.vocab_parallel(true);
    llm::apply_tensor_parallel(*model, acc.tensor_parallel_group(), options);
  }
  if (tp_slices) load_slices(acc, *model, dir);
  // Long sequences: parallelism_config_sp_size (Ulysses) or cp_size split each batch's positions over the
  // group; the loss is then the whole sequence's on every rank of it.
  if (acc.sequence_parallel_group()->world_size() > 1) {
    split = true;
    const bool context = acc.config().context_parallel_size > 1;
    if (context) {
      llm::enable_context_parallel(*model, acc.sequence_parallel_group(),
                                   acc.config().context_parallel_comm_strategy);
    } else {
      llm::enable_sequence_parallel(*model, acc.sequence_parallel_group());
    }
    acc.print("finetune: ", context ? "context" : "sequence", " parallelism over groups of ",
              acc.sequence_parallel_group()->world_size(), " ranks: each holds that share of every sequence",
              context ? " (cp_comm_strategy " + acc.config().context_parallel_comm_strategy + ")" : "");
  }
  const auto lora = adapt(model, model_args, acc.config());
  if (!sft.adapter_init.empty()) {
    if (!lora)
      throw accel::UsageError("finetune: --adapter_init " + sft.adapter_init +
                              " needs a LoRA run (use_peft: true in the model config, or --use_peft true)");
    lora->load_adapter(sft.adapter_init);  // keys, shapes, r and lora_alpha checked against this config
  }
  if (lora) trainer.set_peft_model(lora);
  for (const auto& notice : model_args.notices)
    acc.print("finetune: ", notice);
  for (const auto& notice : evaluation_notices)
    acc.print("finetune: ", notice);
  for (const auto& notice : data_notices)
    acc.print("finetune: ", notice);
  const auto [trainable, total] = count_parameters(*model);
  acc.print("finetune: ", lora ? (model_args.load_in_4bit ? "qlora" : "lora") : "full", " | ", examples,
            " examples | trainable parameters ", trainable, " of ", total);
  const auto result = trainer.train();
  if (result.interrupted) return 0;
  // With an evaluation strategy the Trainer has just evaluated the final model (at the last step or the
  // epoch's end, as transformers 5): only eval_strategy no leaves it to this line.
  if (!sft.eval_dataset.empty() && args.eval_strategy == "no") trainer.evaluate();
  save_outputs(acc, model, lora.get(), dir, fs::path(args.output_dir), sft.save_merged, dtype);
  acc.print("finetune: train loss ", result.training_loss);
  return 0;
} catch (const std::exception& e) {
  std::cerr << "error: " << e.what() << std::endl;
  return 1;
}
