// The dataset-independent part of accel::Trainer: merging TrainingArguments into the Accelerate config, the
// optimizer and schedule the arguments name, the optimizer step with its rank-agreed checks, logging,
// evaluation bookkeeping, checkpoints (save, rotate, resume) and preemption. Only the Accelerator's public
// API (and the public safetensors reader, for one counter of a checkpoint's state file before loading it).
#include <accel/accelerator/resolved_config.hpp>
#include <accel/checkpoint/safetensors.hpp>
#include <accel/config/deepspeed_trainer.hpp>
#include <accel/nn/activation_checkpoint.hpp>
#include <accel/optim/adamw_8bit.hpp>
#include <accel/optim/chunked_adamw.hpp>
#include <accel/optim/deepspeed_adam.hpp>
#include <accel/optim/optim.hpp>
#include <accel/optim/schedulers.hpp>
#include <accel/parallel/pipeline.hpp>
#include <accel/trainer/trainer.hpp>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <numeric>
#include <optional>
#include <regex>
#include <set>
#include <type_traits>

namespace accel {
namespace detail {
namespace {

// stateful_callbacks entry of a checkpoint written after an epoch's last step but before that epoch's end.
constexpr const char* kEpochEndKey = "accelerate-cpp:EpochEndPending";
// stateful_callbacks entry of a checkpoint whose accelerator state counts other optimizer steps than its
// global_step: written during a later train() of the same Trainer (a new run's global_step starts at 0, the
// Accelerator's count goes on) or after steps the fp16 loss scaler skipped (global_step counts them, as HF's;
// the Accelerator does not). Absent: 0.
constexpr const char* kStepOffsetKey = "accelerate-cpp:AcceleratorStepOffset";

namespace fs = std::filesystem;

std::atomic<int> g_preempt_signal{0};

extern "C" void on_preempt_signal(int signal_number) {
  g_preempt_signal.store(signal_number);
}

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

[[noreturn]] void conflict(const TrainingArguments& a, const std::string& key, const std::string& ours,
                           const Config& c, const std::string& their_key, const std::string& theirs) {
  throw ConfigError(fmt::format("TrainingArguments {} is {} ({}) but the Accelerate config sets {} to {} "
                                "({}): a setting given in both "
                                "files must agree; remove it from one of them or make them equal",
                                key, ours, a.source.empty() ? "defaults" : a.source, their_key, theirs,
                                c.source.empty() ? "AcceleratorOptions" : c.source),
                    a.source, 0, key);
}

// A value set in only one of the two files wins; set in both, they must agree.
// A DeepSpeed JSON's numbers (fp16/bf16.enabled, gradient_accumulation_steps, gradient_clipping) are not
// merged: HF's Trainer checks them against TrainingArguments at train() (deepspeed_trainer_config lists every
// mismatch), and its "auto" values are filled here and there.
void merge(TrainingArguments& a, Config& c) {
  const MixedPrecision want =
      a.bf16 ? MixedPrecision::Bf16 : (a.fp16 ? MixedPrecision::Fp16 : MixedPrecision::No);
  // Only the wanted format's own key set in the JSON defers to train()'s check: `"fp16": {"enabled": false}`
  // beside `bf16: true` still trains in bf16, as Accelerate's set_mixed_precision adds the bf16 block.
  const bool json_precision =
      want != MixedPrecision::No && deepspeed_trainer_sets(c, a.bf16 ? "bf16.enabled" : "fp16.enabled");
  if (want != MixedPrecision::No && !json_precision) {
    if (c.mixed_precision != MixedPrecision::No && c.mixed_precision != want)
      conflict(a, a.bf16 ? "bf16" : "fp16", "true", c, "mixed_precision", to_string(c.mixed_precision));
    c.mixed_precision = want;
  }
  if (deepspeed_trainer_sets(c, "gradient_accumulation_steps")) {
    // checked at train()
  } else if (a.is_explicit("gradient_accumulation_steps") || a.gradient_accumulation_steps != 1) {
    if (c.gradient_accumulation_steps != 1 && c.gradient_accumulation_steps != a.gradient_accumulation_steps)
      conflict(a, "gradient_accumulation_steps", std::to_string(a.gradient_accumulation_steps), c,
               "gradient_accumulation_steps", std::to_string(c.gradient_accumulation_steps));
    c.gradient_accumulation_steps = a.gradient_accumulation_steps;
  } else {
    a.gradient_accumulation_steps = c.gradient_accumulation_steps;
  }
  // DeepSpeed's gradient_clipping "auto" (in a JSON file, or a YAML deepspeed_config section without it,
  // which Accelerate's DeepSpeedPlugin leaves "auto") is max_grad_norm under HF's Trainer
  // (HfTrainerDeepSpeedConfig fills it before Accelerate's 1.0 could apply).
  if (c.zero.gradient_clipping_auto) {
    c.zero.gradient_clipping = a.max_grad_norm;
    c.zero.gradient_clipping_auto = false;  // filled: the Accelerator clips at this value
    c.origins["gradient_clipping"] += fmt::format(
        " -> under the Trainer, TrainingArguments max_grad_norm {} ({}), as HF's Trainer fills it",
        a.max_grad_norm, a.source.empty() ? "defaults" : a.source);
  }
  if (c.zero.gradient_clipping > 0 && a.max_grad_norm > 0 && c.zero.gradient_clipping != a.max_grad_norm &&
      !deepspeed_trainer_sets(c, "gradient_clipping"))
    conflict(a, "max_grad_norm", fmt::format("{}", a.max_grad_norm), c, "gradient_clipping",
             fmt::format("{}", c.zero.gradient_clipping));
  if (c.seed) {
    if (a.is_explicit("seed") && *c.seed != a.seed)
      conflict(a, "seed", std::to_string(a.seed), c, "seed", std::to_string(*c.seed));
    a.seed = *c.seed;
  }
  std::vector<std::string> trackers;
  for (const auto& t : a.report_to)
    if (t != "none") trackers.push_back(t);
  const std::string wanted = fmt::format("{}", fmt::join(trackers, ","));
  if (!wanted.empty()) {
    if (!c.log_with.empty() && parse_log_with(c.log_with) != parse_log_with(wanted))
      conflict(a, "report_to", wanted, c, "log_with", c.log_with);
    c.log_with = wanted;
  }
}

// HF's get_decay_parameter_names: no weight decay for biases and normalisation weights.
bool decays(const std::string& name, const torch::nn::Module* owner) {
  // A layer wrapped by activation checkpointing (gradient_checkpointing, a config's recomputation) registers
  // the wrapped layer's parameters as its own.
  while (const auto* ck = dynamic_cast<const CheckpointedImpl*>(owner))
    owner = ck->module().get();
  if (owner != nullptr && (dynamic_cast<const torch::nn::LayerNormImpl*>(owner) != nullptr)) return false;
  std::string lower = name;
  for (auto& ch : lower)
    ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  static const std::regex no_decay(R"(bias|layernorm|rmsnorm|(^|\.)norm($|\.)|_norm($|\.))");
  return !std::regex_search(lower, no_decay);
}

// A DeepSpeed optimizer block as HF's Trainer has DeepSpeed build it (transformers' deepspeed_optim_sched
// hands DeepSpeed DummyOptim(params=model_parameters), every trainable parameter in one group: the block's
// weight_decay applies to all of them, biases and norms too, unlike TrainingArguments' groups). DeepSpeed's
// engine (_configure_basic_optimizer) builds FusedAdam / DeepSpeedCPUAdam or torch's Adam / AdamW: "AdamW",
// or "Adam" with adam_w_mode (its default true), decouples the weight decay as torch's AdamW (LibTorch's
// AdamW update here); "Adam" with adam_w_mode false adds it to the gradient (L2) as torch's Adam.
// The parameters of one optimizer group split by dtype and device, in order of first appearance: the
// sharding backends flatten a group into one buffer (ZeRO-1/2's flat, FULL_SHARD's unit flats), which needs
// one dtype, and PEFT leaves a bf16 model's modules_to_save in bf16 beside float32 adapters. The update is
// per parameter, so the split changes no number.
std::vector<std::vector<torch::Tensor>> split_by_dtype(const std::vector<torch::Tensor>& params) {
  std::vector<std::vector<torch::Tensor>> out;
  for (const auto& p : params) {
    auto same = [&](const std::vector<torch::Tensor>& g) {
      return g.front().scalar_type() == p.scalar_type() && g.front().device() == p.device();
    };
    auto it = std::find_if(out.begin(), out.end(), same);
    if (it == out.end())
      out.push_back({p});
    else
      it->push_back(p);
  }
  return out;
}

std::shared_ptr<torch::optim::Optimizer> deepspeed_optimizer(const torch::nn::Module& model,
                                                             const DeepSpeedOptimizer& o) {
  std::vector<torch::Tensor> params;
  std::set<const void*> seen;  // a tied parameter once, as model.parameters()
  for (const auto& p : model.parameters()) {
    if (p.requires_grad() && seen.insert(p.unsafeGetTensorImpl()).second) params.push_back(p);
  }
  if (params.empty())
    throw UsageError("Trainer: the model has no trainable parameters (all have requires_grad false)");
  // DeepSpeedAdamW / DeepSpeedAdam: with bias_correction (the default) bitwise LibTorch's AdamW / Adam update
  // (torch_adam's too); without it, FusedAdam's and CPU Adam's raw moments.
  auto groups = [&](const auto& options) {
    std::vector<torch::optim::OptimizerParamGroup> out;
    for (auto& part : split_by_dtype(params))
      out.emplace_back(part, std::make_unique<std::decay_t<decltype(options)>>(options));
    return out;
  };
  if (o.adamw_mode) {
    torch::optim::AdamWOptions options(o.lr);
    options.betas({o.beta1, o.beta2}).eps(o.eps).weight_decay(o.weight_decay);
    return std::make_shared<optim::DeepSpeedAdamW>(groups(options), options, o.bias_correction);
  }
  torch::optim::AdamOptions options(o.lr);
  options.betas({o.beta1, o.beta2}).eps(o.eps).weight_decay(o.weight_decay);
  return std::make_shared<optim::DeepSpeedAdam>(groups(options), options, o.bias_correction);
}

// DeepSpeed's WarmupLR / WarmupDecayLR / WarmupCosineLR (deepspeed_schedule_lr): stepped after each optimizer
// step that was applied, as DeepSpeed's engine steps it; the rate of the first step is set when constructed.
class DeepSpeedSchedule : public sched::GatedSchedule {
 public:
  DeepSpeedSchedule(torch::optim::Optimizer& optimizer, DeepSpeedScheduler s)
      : GatedSchedule(optimizer), optimizer_(optimizer), s_(std::move(s)) {
    for (auto& group : optimizer_.param_groups())
      base_.push_back(group.options().get_lr());
    for (std::size_t g = 0; g < base_.size(); ++g)
      optimizer_.param_groups()[g].options().set_lr(deepspeed_schedule_lr(s_, base_[g], 0));
  }

 protected:
  std::vector<double> get_lrs() override {  // before LRScheduler::step counts the step
    std::vector<double> out;
    for (double base : base_)
      out.push_back(deepspeed_schedule_lr(s_, base, static_cast<std::int64_t>(step_count_) + 1));
    return out;
  }

 private:
  torch::optim::Optimizer& optimizer_;
  DeepSpeedScheduler s_;
  std::vector<double> base_;
};

// LibTorch keeps an LRScheduler's step count protected; a new run of the same schedule starts it at 0.
struct ScheduleSteps : torch::optim::LRScheduler {
  static unsigned& of(torch::optim::LRScheduler& s) { return s.*(&ScheduleSteps::step_count_); }
};

// A fresh optimizer's state, in place (the tensors the prepared backend shards, offloads or swaps stay the
// same objects): Adam's moments zero at step 0, as a new Adam / AdamW starts; other kinds' state dropped
// (made again at their first step, as in a new optimizer).
void restart_optimizer_state(torch::optim::Optimizer& optimizer) {
  const auto zero = [](auto& s) {
    s.step(0);
    s.exp_avg().zero_();
    s.exp_avg_sq().zero_();
    if (s.max_exp_avg_sq().defined()) s.max_exp_avg_sq().zero_();
  };
  torch::NoGradGuard no_grad;
  std::vector<void*> dropped;
  for (auto& [key, state] : optimizer.state()) {
    if (auto* w = dynamic_cast<torch::optim::AdamWParamState*>(state.get()))
      zero(*w);
    else if (auto* a = dynamic_cast<torch::optim::AdamParamState*>(state.get()))
      zero(*a);
    else
      dropped.push_back(key);
  }
  for (auto* key : dropped)
    optimizer.state().erase(key);
}

// The DeepSpeed JSON's keys as HF's Trainer fills and checks them at train() (trainer_config_process and
// trainer_config_finalize, which raise every mismatch at once): a ConfigError listing them; the optimizer and
// scheduler blocks to build. `user_optimizer`: Trainer::set_optimizer was called (HF refuses optimizers=
// under DeepSpeed; here only when the file has a block it would replace).
DeepSpeedTrainerConfig deepspeed_blocks(const TrainingArguments& a, Accelerator& acc, std::int64_t max_steps,
                                        std::int64_t warmup, bool user_optimizer) {
  DeepSpeedTrainerArgs v;
  v.per_device_train_batch_size = a.per_device_train_batch_size;
  v.gradient_accumulation_steps = a.gradient_accumulation_steps;
  v.world_size = acc.data_parallel_group()->world_size();
  v.max_grad_norm = a.max_grad_norm;
  v.learning_rate = a.learning_rate;
  v.adam_beta1 = a.adam_beta1;
  v.adam_beta2 = a.adam_beta2;
  v.adam_epsilon = a.adam_epsilon;
  v.weight_decay = a.weight_decay;
  v.fp16 = a.fp16;
  v.bf16 = a.bf16;
  v.num_training_steps = max_steps;
  v.warmup_steps = warmup;
  v.source = a.source;
  auto ds = deepspeed_trainer_config(acc.config(), v);
  if (user_optimizer && (ds.optimizer || ds.scheduler)) {
    throw ConfigError(
        fmt::format(
            "Trainer::set_optimizer with the DeepSpeed config {}, whose {} block would be replaced: "
            "Hugging Face's Trainer refuses optimizers= under DeepSpeed; remove the block(s) from the "
            "file, or do not call set_optimizer",
            ds.file, ds.optimizer ? "optimizer" : "scheduler"),
        ds.file, 0, ds.optimizer ? "optimizer" : "scheduler");
  }
  return ds;
}

std::int64_t resolve_steps(double x, std::int64_t max_steps) {
  if (x < 1)
    return std::max<std::int64_t>(1,
                                  static_cast<std::int64_t>(std::ceil(x * static_cast<double>(max_steps))));
  return static_cast<std::int64_t>(x);
}

// "checkpoint-<n>" directories of the Trainer (with trainer_state.json), oldest first.
std::vector<std::pair<std::int64_t, std::string>> trainer_checkpoints(const std::string& output_dir) {
  std::vector<std::pair<std::int64_t, std::string>> out;
  std::error_code ec;
  if (!fs::is_directory(output_dir, ec)) return out;
  static const std::regex name("checkpoint-([0-9]{1,18})");
  for (const auto& entry : fs::directory_iterator(output_dir, ec)) {
    std::smatch m;
    const std::string file = entry.path().filename().string();
    if (!entry.is_directory(ec) || !std::regex_match(file, m, name)) continue;
    if (!fs::exists(entry.path() / "trainer_state.json", ec)) continue;
    out.emplace_back(std::stoll(m[1].str()), entry.path().string());
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::string tracker_name(const std::string& key) {
  if (key.find('/') != std::string::npos) return key;
  if (key.rfind("eval_", 0) == 0) return "eval/" + key.substr(5);
  return "train/" + key;
}

std::string format_logs(const LogEntry& logs) {
  std::vector<std::string> parts;
  for (const auto& [k, v] : logs)
    parts.push_back(fmt::format("'{}': {:.6g}", k, v));
  return fmt::format("{{{}}}", fmt::join(parts, ", "));
}

}  // namespace

// SIGTERM and SIGUSR1 (Slurm's --signal, schedulers' preemption) set a flag while train() runs; the
// previous handlers come back after it.
struct TrainerBase::Signals {
  struct sigaction old_term {
  }, old_usr1{};
  Signals() {
    g_preempt_signal.store(0);
    struct sigaction sa {};
    sa.sa_handler = on_preempt_signal;
    sigemptyset(&sa.sa_mask);
    ::sigaction(SIGTERM, &sa, &old_term);
    ::sigaction(SIGUSR1, &sa, &old_usr1);
  }
  ~Signals() {
    ::sigaction(SIGTERM, &old_term, nullptr);
    ::sigaction(SIGUSR1, &old_usr1, nullptr);
  }
};

TrainerBase::TrainerBase(TrainingArguments args, AcceleratorOptions options) : args_(std::move(args)) {
  args_.validate();
  Config config = resolved_config(options);
  refuse_two_checkpointings(config);
  // AcceleratorOptions().log_with(...) is the Accelerator's tracker setting: it takes part in the merge.
  if (options.log_with()) config.log_with = *options.log_with();
  merge(args_, config);
  options.config(config).mixed_precision(std::nullopt).gradient_accumulation_steps(std::nullopt);
  if (options.log_with()) options.log_with(config.log_with);
  if (options.project_config().project_dir.empty()) options.project_dir(args_.logging_dir);
  accelerator_ = std::make_shared<Accelerator>(std::move(options));
  attach();
}

TrainerBase::TrainerBase(TrainingArguments args, Accelerator& accelerator) : args_(std::move(args)) {
  args_.validate();
  const Config& have = accelerator.config();
  refuse_two_checkpointings(have);
  // The trackers and where they write are the Accelerator's (AcceleratorOptions().log_with may override its
  // config's log_with, which the Trainer cannot see): naming them in the arguments too is refused.
  for (const auto& t : args_.report_to) {
    if (t == "none") continue;
    throw ConfigError(
        fmt::format(
            "TrainingArguments report_to {}: with an Accelerator given to the Trainer, the trackers are "
            "the Accelerator's; choose them there (AcceleratorOptions().log_with(\"{}\") or log_with in "
            "its config) and leave report_to at none",
            t, t),
        args_.source, 0, "report_to");
  }
  if (args_.is_explicit("logging_dir")) {
    throw ConfigError(
        fmt::format(
            "TrainingArguments logging_dir {}: with an Accelerator given to the Trainer, tracker logs go "
            "to its project_dir; set AcceleratorOptions().project_dir(\"{}\") and remove logging_dir",
            args_.logging_dir, args_.logging_dir),
        args_.source, 0, "logging_dir");
  }
  // The Accelerator exists, its config fixed: the arguments may agree with it or leave a setting to it, but
  // not change it (a silently ignored value would train differently from what the arguments say).
  Config merged = have;
  merge(args_, merged);
  const auto fixed = [&](const char* argument, const std::string& value, const char* key,
                         const std::string& current) {
    throw ConfigError(
        fmt::format(
            "TrainingArguments {} {} differs from the Accelerator given to the Trainer ({} {}), whose "
            "config is fixed once it is built: set {} in its config or AcceleratorOptions, or leave "
            "{} out of the arguments",
            argument, value, key, current, key, argument),
        args_.source, 0, argument);
  };
  if (merged.mixed_precision != have.mixed_precision)
    fixed(args_.bf16 ? "bf16" : "fp16", "true", "mixed_precision", to_string(have.mixed_precision));
  if (merged.gradient_accumulation_steps != have.gradient_accumulation_steps)
    fixed("gradient_accumulation_steps", std::to_string(args_.gradient_accumulation_steps),
          "gradient_accumulation_steps", std::to_string(have.gradient_accumulation_steps));
  if (merged.zero.gradient_clipping != have.zero.gradient_clipping)  // an "auto" filled with max_grad_norm
    fixed("max_grad_norm", fmt::format("{}", args_.max_grad_norm), "gradient_clipping",
          fmt::format("{}", have.zero.gradient_clipping));
  accelerator_ = std::shared_ptr<Accelerator>(&accelerator, [](Accelerator*) {});  // borrowed
  borrowed_ = true;
  attach();
}

void TrainerBase::refuse_two_checkpointings(const Config& config) const {
  if (args_.gradient_checkpointing && config.backend == "fsdp" && config.fsdp.activation_checkpointing) {
    throw ConfigError(  // HF's Trainer refuses the pair with this advice
        "TrainingArguments gradient_checkpointing: true and the Accelerate config's "
        "fsdp_activation_checkpointing: true cannot both be set; use FSDP's activation_checkpointing when "
        "using FSDP (set gradient_checkpointing: false)",
        args_.source, 0, "gradient_checkpointing");
  }
}

void TrainerBase::attach() {
  accelerator_->set_seed(args_.seed);
  state_.is_world_process_zero = accelerator_->is_main_process();
  state_.is_local_process_zero = accelerator_->is_local_main_process();
  for (const auto& n : args_.notices)
    accelerator_->print("notice: ", n);
  // trainer_state.json goes into the checkpoint's temporary directory, so it is part of the atomic unit and
  // of its manifest. The hook holds a token, not the Trainer: an Accelerator given to the Trainer outlives
  // it, and its later save_state calls must not reach a destroyed Trainer.
  std::weak_ptr<TrainerBase*> token = alive_;
  accelerator_->register_save_state_pre_hook([token](const std::string& dir) {
    const auto self = token.lock();
    if (!self) return;
    (*self)->write_adapter(dir);  // every rank: it may gather
    if ((*self)->accelerator_->is_main_process()) (*self)->write_state(dir);
  });
}

TrainerBase::~TrainerBase() {
  // A borrowed Accelerator outlives the Trainer, but what it prepared (the optimizer, the schedule, the
  // loaders) dies with it: release them, as free_memory() does, so that the Accelerator keeps no pointer into
  // a destroyed object (its model goes back to plain LibTorch). Collective, as the destruction of an
  // Accelerator the Trainer owns is.
  if (borrowed_ && prepared_) {
    try {
      accelerator_->free_memory();
    } catch (const std::exception& e) {
      std::cerr << "accelerate-cpp: Trainer: releasing what it prepared on the given Accelerator failed: "
                << e.what() << std::endl;
    }
  }
}

void TrainerBase::add_callback(std::shared_ptr<TrainerCallback> callback) {
  if (!callback) throw UsageError("Trainer::add_callback: null callback");
  callbacks_.push_back(std::move(callback));
}

void TrainerBase::set_optimizer(std::shared_ptr<torch::optim::Optimizer> optimizer,
                                std::shared_ptr<torch::optim::LRScheduler> scheduler) {
  if (prepared_) throw UsageError("Trainer::set_optimizer: call it before train()");
  if (pipelined()) {
    throw UsageError(
        "Trainer::set_optimizer with a pipeline is not supported: the optimizer must hold this rank's "
        "stage's "
        "parameters, and the stage is cut from the model inside train(); choose the optimizer through the "
        "TrainingArguments (optim, learning_rate, weight_decay, adam_*, lr_scheduler_type), or write the "
        "loop with Accelerator::prepare_pipeline and pipeline_step");
  }
  if (!optimizer) throw UsageError("Trainer::set_optimizer: null optimizer");
  optimizer_ = std::move(optimizer);
  scheduler_ = std::move(scheduler);
  user_scheduler_ = scheduler_ != nullptr;
  user_optimizer_ = true;
}

void TrainerBase::set_peft_model(std::shared_ptr<peft::LoraModel> lora) {
  if (prepared_) throw UsageError("Trainer::set_peft_model: call it before train()");
  if (!lora) throw UsageError("Trainer::set_peft_model: null LoRA handle");
  lora_ = std::move(lora);
}

void TrainerBase::write_adapter(const std::string& dir) {
  if (!lora_) return;
  auto& acc = *accelerator_;
  // The model's own tensors where they are whole on every rank; gathered where they are not.
  NamedTensors state;
  if (acc.capabilities().shards_parameters || acc.tensor_parallel_group()->world_size() > 1)
    state = acc.get_state_dict(model_, StateDictOn::MainProcess);
  if (acc.is_main_process()) lora_->save_adapter(dir, state);
}

void TrainerBase::zero_grads() {
  // The optimizer's zero_grad reaches what the prepared engine holds for its parameters; the model's reaches
  // trainable parameters outside the optimizer (a user's set_optimizer over part of the model), whose
  // gradients would otherwise add up over the steps into every later clipping norm (HF's Trainer calls
  // model.zero_grad() after each step).
  optimizer_->zero_grad();
  model_->zero_grad();
}

void TrainerBase::set_model(std::shared_ptr<torch::nn::Module> model) {
  if (!model) throw UsageError("Trainer: the model is empty");
  model_ = std::move(model);
}

void TrainerBase::set_pipeline(const torch::nn::Sequential& model, PipelineLoss loss) {
  if (model.is_empty() || model->is_empty())
    throw UsageError("Trainer: the pipeline's Sequential model is empty (no layers to cut into stages)");
  if (!loss) throw UsageError("Trainer: the pipeline's loss function is empty");
  pipeline_model_ = model;
  pipeline_loss_ = std::move(loss);
  model_ = model.ptr();  // the whole model until prepare_stage cuts it
}

void TrainerBase::refuse_under_pipeline(const char* what) const {
  if (!pipelined()) return;
  throw UsageError(fmt::format(
      "Trainer: {} runs the whole model on one rank, which a pipeline cannot (each rank holds one stage); "
      "under a pipeline the Trainer evaluates through the stages, the last stage's outputs being the "
      "predictions and the batch's targets the labels (Hugging Face's default): give set_eval only "
      "compute_metrics",
      what));
}

void TrainerBase::prepare_stage() {
  if (!pipeline_model_) return;  // already cut
  auto& acc = *accelerator_;
  const Config& c = acc.config();
  if (args_.gradient_checkpointing) {
    throw ConfigError(
        "TrainingArguments gradient_checkpointing: true with a pipeline is not supported: the Trainer would "
        "wrap the model's blocks after the stages are cut; wrap them when building the Sequential "
        "(accel::Checkpointed, <accel/nn/activation_checkpoint.hpp>) and set gradient_checkpointing: false",
        args_.source, 0, "gradient_checkpointing");
  }
  if (c.pipeline.micro_batches > 0 && c.gradient_accumulation_steps > 1 &&
      c.pipeline.micro_batches != c.gradient_accumulation_steps) {
    throw ConfigError(
        fmt::format("gradient_accumulation_steps is {} but pipeline_config.micro_batches is {}: under a "
                    "pipeline the accumulation is the micro-batches of each step (as DeepSpeed's "
                    "gradient_accumulation_steps); set one of them, or both to the same value",
                    c.gradient_accumulation_steps, c.pipeline.micro_batches),
        args_.source, 0, "gradient_accumulation_steps");
  }
  auto& stage = acc.prepare_pipeline(*pipeline_model_);
  model_ = stage.module().ptr();
  pipeline_model_.reset();
}

std::size_t TrainerBase::train_batch_rows() const {
  const auto m = pipelined() ? accelerator_->pipeline_micro_batches() : 1;
  return static_cast<std::size_t>(args_.per_device_train_batch_size) * static_cast<std::size_t>(m);
}

std::size_t TrainerBase::eval_batch_rows() const {
  const auto m = pipelined() ? accelerator_->pipeline_micro_batches() : 1;
  return static_cast<std::size_t>(args_.per_device_eval_batch_size) * static_cast<std::size_t>(m);
}

void TrainerBase::pipeline_micro_steps(const torch::Tensor& inputs, const torch::Tensor& targets,
                                       std::int64_t rows, std::int64_t tokens) {
  auto& acc = *accelerator_;
  const auto m = static_cast<std::int64_t>(acc.pipeline_micro_batches());
  if (rows % m != 0) {
    throw UsageError(fmt::format(
        "Trainer: a training batch of {} rows does not split into the pipeline's {} equal micro-batches "
        "(per_device_train_batch_size {} x {} micro-batches per step; the epoch's last batch is short): set "
        "dataloader_drop_last: true, or use a dataset whose size leaves a last batch of a multiple of {} "
        "rows",
        rows, m, args_.per_device_train_batch_size, m, m));
  }
  each_callback([&](TrainerCallback& c) { c.on_step_begin(args_, state_, control_); });
  model_->train();
  const double mean = acc.pipeline_step(inputs, targets, pipeline_loss_);
  // As micro_step keeps it: the sum of the step's micro-batch losses (each a micro-batch mean), m of them.
  window_loss_ = torch::tensor(mean * static_cast<double>(m), torch::kFloat64);
  window_micro_ = m;
  window_rows_ = rows;
  window_tokens_ = tokens;
}

void TrainerBase::check_pipeline_batches(std::size_t samples) const {
  if (!pipelined()) return;
  auto& acc = *accelerator_;
  const auto m = static_cast<std::size_t>(acc.pipeline_micro_batches());
  const int replicas = acc.data_parallel_group()->world_size();
  // The loader's plan for every replica (the batch sizes do not depend on the order): every rank computes
  // the same, so every rank refuses alike, before the first step.
  std::vector<std::size_t> order(samples);
  std::iota(order.begin(), order.end(), std::size_t{0});
  for (int r = 0; r < replicas; ++r) {
    const auto plan = detail::plan_shard(order, train_batch_rows(), r, replicas, args_.dataloader_drop_last,
                                         acc.config().even_batches, acc.config().split_batches);
    for (std::size_t b = 0; b < plan.batches.size(); ++b) {
      if (plan.batches[b].size() % m == 0) continue;
      throw ConfigError(
          fmt::format(
              "Trainer: under the pipeline each step cuts a batch into {} equal micro-batches, but batch "
              "{} of {} of each epoch on data-parallel replica {} has {} rows ({} samples, "
              "per_device_train_batch_size {} x {} micro-batches, {} replica(s)); set "
              "dataloader_drop_last: true, or use a dataset whose last batch splits",
              m, b + 1, plan.batches.size(), r, plan.batches[b].size(), samples,
              args_.per_device_train_batch_size, m, replicas),
          args_.source, 0, "dataloader_drop_last");
    }
  }
}

torch::Tensor TrainerBase::pipeline_predict(const torch::Tensor& inputs) {
  return accelerator_->pipeline_predict(inputs);
}

void TrainerBase::build_optimizer() {
  std::vector<torch::Tensor> decay, no_decay;
  const std::function<void(const torch::nn::Module&, const std::string&)> walk =
      [&](const torch::nn::Module& m, const std::string& prefix) {
        for (const auto& p : m.named_parameters(/*recurse=*/false)) {
          if (!p.value().requires_grad()) continue;
          (decays(prefix + p.key(), &m) ? decay : no_decay).push_back(p.value());
        }
        for (const auto& child : m.named_children())
          walk(*child.value(), prefix + child.key() + ".");
      };
  walk(*model_, "");
  if (decay.empty() && no_decay.empty())
    throw UsageError("Trainer: the model has no trainable parameters (all have requires_grad false)");
  const auto& a = args_;
  std::vector<torch::optim::OptimizerParamGroup> groups;
  auto add = [&](std::vector<torch::Tensor>& params, double wd, auto options) {
    options.weight_decay(wd);
    for (auto& part : split_by_dtype(params))
      groups.emplace_back(part, std::make_unique<decltype(options)>(options));
  };
  if (a.optim == "adamw_torch" || a.optim == "adamw_torch_fused") {
    torch::optim::AdamWOptions o(a.learning_rate);
    o.betas({a.adam_beta1, a.adam_beta2}).eps(a.adam_epsilon);
    add(decay, a.weight_decay, o);
    add(no_decay, 0.0, o);
    if (a.optim == "adamw_torch") {
      // LibTorch's AdamW update, bitwise, in cache-sized slices without parameter-sized temporaries.
      optimizer_ = std::make_shared<optim::ChunkedAdamW>(groups, o);
    } else {
      optimizer_ = std::make_shared<optim::AdamW>(groups, o);
    }
  } else if (a.optim == "sgd") {
    torch::optim::SGDOptions o(a.learning_rate);
    add(decay, a.weight_decay, o);
    add(no_decay, 0.0, o);
    optimizer_ = std::make_shared<torch::optim::SGD>(groups, o);
  } else if (a.optim == "adamw_bnb_8bit" || a.optim == "adamw_8bit" || a.optim == "paged_adamw_8bit" ||
             a.optim == "paged_adamw_32bit") {
    // transformers' _get_bitsandbytes_optimizer: bnb.optim.AdamW with optim_bits 8 when the name says 8bit.
    optim::AdamW8bitOptions o(a.learning_rate);
    o.betas({a.adam_beta1, a.adam_beta2})
        .eps(a.adam_epsilon)
        .optim_bits(a.optim.find("8bit") != std::string::npos ? 8 : 32);
    add(decay, a.weight_decay, o);
    add(no_decay, 0.0, o);
    optimizer_ = std::make_shared<optim::AdamW8bit>(groups, o);
    if (a.optim.rfind("paged_", 0) == 0)
      accelerator_->print(
          "notice: TrainingArguments optim ", a.optim,
          ": bitsandbytes' paging (optimizer state in unified memory that the GPU driver moves to "
          "host memory under pressure) has no meaning on a CPU and is not done on GPUs here; it "
          "trains as ",
          a.optim == "paged_adamw_32bit" ? "adamw bitsandbytes 32-bit" : "adamw_bnb_8bit");
  } else if (a.optim == "lamb") {
    optim::LambOptions o(a.learning_rate);
    o.betas({a.adam_beta1, a.adam_beta2}).eps(a.adam_epsilon);
    add(decay, a.weight_decay, o);
    add(no_decay, 0.0, o);
    optimizer_ = std::make_shared<optim::Lamb>(groups, o);
  } else {
    throw ConfigError(fmt::format("TrainingArguments optim '{}' is not supported; for another optimizer give "
                                  "it to Trainer::set_optimizer",
                                  a.optim),
                      a.source, 0, "optim");
  }
}

void TrainerBase::build_scheduler() {
  const auto total = state_.max_steps;
  const auto& type = args_.lr_scheduler_type;
  // lr_scheduler_kwargs, as transformers' get_scheduler passes them (validate() checked the names).
  const auto& kw = args_.lr_scheduler_kwargs;
  const auto arg = [&kw](const char* name) {
    const auto it = kw.find(name);
    return it == kw.end() ? std::nullopt : std::optional<double>(it->second);
  };
  std::unique_ptr<sched::Schedule> s;
  if (type == "linear") {
    s = sched::linear_with_warmup(*optimizer_, warmup_, total);
  } else if (type == "cosine") {
    s = sched::cosine_with_warmup(*optimizer_, warmup_, total, arg("num_cycles").value_or(0.5));
  } else if (type == "cosine_with_min_lr") {
    s = sched::cosine_with_min_lr(*optimizer_, warmup_, total, arg("min_lr"), arg("min_lr_rate"),
                                  arg("num_cycles").value_or(0.5));
  } else if (type == "constant") {
    s = sched::constant_with_warmup(*optimizer_, 0);
  } else if (type == "constant_with_warmup") {
    s = sched::constant_with_warmup(*optimizer_, warmup_);
  } else if (type == "polynomial") {
    s = sched::polynomial_with_warmup(*optimizer_, warmup_, total, arg("lr_end").value_or(1e-7),
                                      arg("power").value_or(1.0));
  } else {
    throw ConfigError(fmt::format("TrainingArguments lr_scheduler_type '{}' is not supported; for another "
                                  "schedule give it as the second argument of Trainer::set_optimizer",
                                  type),
                      args_.source, 0, "lr_scheduler_type");
  }
  scheduler_ = std::shared_ptr<torch::optim::LRScheduler>(std::move(s));
}

std::string TrainerBase::latest_checkpoint() const {
  const auto all = trainer_checkpoints(args_.output_dir);
  return all.empty() ? std::string() : all.back().second;
}

// A later train() on the same Trainer, as transformers' Trainer runs it (_inner_training_loop): the schedule
// the Trainer built starts again from its first step with the groups' first rates (_prepare_for_training
// resets it; torch's LambdaLR takes each group's initial_lr as its base); without DeepSpeed the optimizer
// keeps its state (create_optimizer builds one only when there is none), under DeepSpeed it starts anew
// (deepspeed_init sets trainer.optimizer = None and DeepSpeed builds it again from the block or
// TrainingArguments). The DeepSpeed JSON is filled and checked again (trainer_config_finalize). A user's
// optimizer (set_optimizer) is kept, and so is a user's schedule. The objects stay the prepared ones.
void TrainerBase::restart_run() {
  auto& acc = *accelerator_;
  step_lr_ = -1;
  const auto ds = deepspeed_blocks(args_, acc, state_.max_steps, warmup_, false);
  if (acc.backend_name() == "zero" && !user_optimizer_) restart_optimizer_state(*optimizer_);
  if (user_scheduler_) return;
  auto& groups = optimizer_->param_groups();
  for (std::size_t g = 0; g < groups.size() && g < initial_lrs_.size(); ++g)
    groups[g].options().set_lr(initial_lrs_[g]);
  ScheduleSteps::of(*scheduler_) = 0;
  // The rates of the first step: what a new schedule of this kind sets when constructed, from those rates
  // (the prepared one's base rates are the same).
  auto prepared = std::move(scheduler_);
  if (dynamic_cast<DeepSpeedSchedule*>(prepared.get()) != nullptr && ds.scheduler)
    scheduler_ = std::make_shared<DeepSpeedSchedule>(*optimizer_, *ds.scheduler);
  else
    build_scheduler();
  scheduler_ = std::move(prepared);
}

bool TrainerBase::held_window() const {
  return window_micro_ > 0 && window_micro_ < accelerator_->gradient_accumulation_steps();
}

UsageError TrainerBase::held_window_error() const {
  // HF's Trainer zeroes the model's gradients at every train(); here the Accelerator holds the gradients of
  // the micro-batches of an unfinished step apart from .grad, and the accumulation clock is inside it.
  return UsageError(fmt::format(
      "Trainer: the last train() stopped inside an optimizer step, after {} of its {} micro-batches (an "
      "exception); their gradients are still held for that step and this train() would add them to its "
      "first. Resume from a checkpoint (train(\"latest\") or train(dir)), or make a new Trainer",
      window_micro_, accelerator_->gradient_accumulation_steps()));
}

void TrainerBase::begin_train(std::size_t batches_per_epoch, const std::string& resume) {
  // Refused before anything of the last run is reset (with "latest" it is refused below when no checkpoint is
  // found).
  if (prepared_ && resume.empty() && held_window()) throw held_window_error();
  epoch_end_pending_ = false;  // a resumed checkpoint may set it again
  auto& acc = *accelerator_;
  if (prepared_) {  // a later train(): HF's _init_training_state makes a new TrainerState
    const bool world_zero = state_.is_world_process_zero, local_zero = state_.is_local_process_zero;
    state_ = TrainerState{};
    state_.is_world_process_zero = world_zero;
    state_.is_local_process_zero = local_zero;
  }
  if (!pipelined() && acc.config().pipeline.stages > 1) {
    throw ConfigError(
        fmt::format("the Accelerate config's pipeline_config.stages is {}, but the Trainer was given a model "
                    "and a compute_loss(batch) that runs it whole; for a pipeline give the Trainer a "
                    "torch::nn::Sequential and a loss(output, target) (docs/trainer.md), or set "
                    "pipeline_config.stages: 1",
                    acc.config().pipeline.stages),
        acc.config().source, 0, "pipeline_config.stages");
  }
  if (args_.eval_strategy != "no" && !has_eval_) {
    throw ConfigError(
        fmt::format("TrainingArguments eval_strategy is {} but the Trainer has no evaluation data; "
                    "call set_eval(dataset, ...) or set eval_strategy: no",
                    args_.eval_strategy),
        args_.source, 0, "eval_strategy");
  }
  if (batches_per_epoch == 0) throw UsageError("Trainer: the training data loader yields no batch");
  // Under a pipeline each batch is one optimizer step (its micro-batches are the accumulation).
  const auto ga =
      pipelined() ? std::int64_t{1} : static_cast<std::int64_t>(acc.gradient_accumulation_steps());
  const auto batches = static_cast<std::int64_t>(batches_per_epoch);
  steps_per_epoch_ = std::max<std::int64_t>(1, (batches + ga - 1) / ga);
  if (args_.max_steps > 0) {
    state_.max_steps = args_.max_steps;
    epochs_ = (args_.max_steps + steps_per_epoch_ - 1) / steps_per_epoch_;
  } else {
    state_.max_steps =
        static_cast<std::int64_t>(std::ceil(args_.num_train_epochs * static_cast<double>(steps_per_epoch_)));
    epochs_ = static_cast<std::int64_t>(std::ceil(args_.num_train_epochs));
  }
  warmup_ =
      args_.warmup_steps > 0
          ? args_.warmup_steps
          : static_cast<std::int64_t>(std::ceil(args_.warmup_ratio * static_cast<double>(state_.max_steps)));
  state_.logging_steps = resolve_steps(args_.logging_steps, state_.max_steps);
  state_.eval_steps = resolve_steps(args_.eval_steps.value_or(args_.logging_steps), state_.max_steps);
  state_.save_steps = resolve_steps(args_.save_steps, state_.max_steps);
  state_.train_batch_size = args_.per_device_train_batch_size;
  state_.num_train_epochs = static_cast<double>(epochs_);
  if (!prepared_) {
    // HF's gradient_checkpointing_enable(): here the model's Sequential blocks are checkpointed (the same
    // rule as fsdp_activation_checkpointing), before the optimizer sees the parameters (names unchanged).
    // gradient_checkpointing_kwargs: use_reentrant true or false computes the same gradients (PyTorch's two
    // variants do too); there is one mechanism here (docs/trainer.md). preserve_rng_state is honoured.
    if (args_.gradient_checkpointing) {
      CheckpointOptions options;
      const auto rng = args_.gradient_checkpointing_kwargs.find("preserve_rng_state");
      if (rng != args_.gradient_checkpointing_kwargs.end()) options.preserve_rng_state(rng->second);
      checkpoint_model_blocks(*model_, "TrainingArguments gradient_checkpointing", options);
    }
    const auto ds = deepspeed_blocks(args_, acc, state_.max_steps, warmup_, optimizer_ != nullptr);
    // HF hands DeepSpeed's engine the schedule (a DummyScheduler) only when the JSON has an optimizer or a
    // scheduler block (deepspeed_optim_sched); otherwise its Trainer steps its own LambdaLR.
    engine_schedule_ = acc.backend_name() == "zero" && (ds.optimizer || ds.scheduler);
    if (!optimizer_ && ds.optimizer) optimizer_ = deepspeed_optimizer(*model_, *ds.optimizer);
    if (!optimizer_) build_optimizer();
    for (const auto& group : optimizer_->param_groups())
      initial_lrs_.push_back(group.options().get_lr());
    if (!scheduler_ && ds.scheduler)
      scheduler_ = std::make_shared<DeepSpeedSchedule>(*optimizer_, *ds.scheduler);
    if (!scheduler_) build_scheduler();
    if (lora_) acc.set_checkpoint_trainable_only(true);  // the frozen base is not rewritten at every save
    // HF's Trainer calls model.zero_grad() before training: gradients the program left on the model (a loop
    // run first) are not added to the first step. Before prepare, on the user's model: every parameter,
    // frozen ones too, and no gradient is left behind on another device when prepare moves the model.
    model_->zero_grad();
    if (pipelined()) {
      acc.prepare(*optimizer_, *scheduler_);  // the stage is a prepared model already
    } else {
      acc.prepare(model_, *optimizer_, *scheduler_);
    }
    prepared_ = true;
  } else {
    restart_run();
    zero_grads();  // what the last one left
  }
  std::string dir = resume;
  if (resume == "latest") {
    std::vector<std::string> chosen{acc.is_main_process() ? latest_checkpoint() : std::string()};
    acc.broadcast_object_list(chosen);
    dir = chosen.front();
    if (dir.empty()) acc.print("Trainer: no checkpoint in ", args_.output_dir, "; training from the start");
  }
  if (!dir.empty()) {
    resume_from(dir);  // load_state also drops what an interrupted step held
  } else if (held_window()) {
    throw held_window_error();
  }
  if (!trackers_open_) {
    acc.init_trackers(args_.run_name.value_or("trainer"),
                      {{"learning_rate", args_.learning_rate},
                       {"per_device_train_batch_size", args_.per_device_train_batch_size},
                       {"gradient_accumulation_steps", args_.gradient_accumulation_steps},
                       {"num_train_epochs", args_.num_train_epochs},
                       {"max_steps", state_.max_steps},
                       {"optim", args_.optim},
                       {"lr_scheduler_type", args_.lr_scheduler_type},
                       {"weight_decay", args_.weight_decay},
                       {"seed", static_cast<std::int64_t>(args_.seed)},
                       {"num_processes", acc.num_processes()},
                       {"backend", acc.backend_name()}});
    trackers_open_ = true;
  }
  control_ = TrainerControl{};
  interrupted_ = false;
  last_logged_step_ = state_.global_step;
  start_step_ = state_.global_step;
  start_samples_ = state_.num_samples_seen;
  start_time_ = now_seconds();
  run_loss_ = interval_loss_ = 0;
  interval_micro_ = run_micro_ = 0;
  window_micro_ = 0;
  if (!args_.disable_tqdm) {
    ProgressOptions o;
    o.description = "train";
    o.unit = "steps";
    o.rank = acc.process_index();
    bar_.emplace(static_cast<std::size_t>(state_.max_steps), o);
    if (state_.global_step > 0) bar_->update(static_cast<std::size_t>(state_.global_step));
  }
  signals_ = std::make_unique<Signals>();
  each_callback([&](TrainerCallback& c) { c.on_train_begin(args_, state_, control_); });
}

bool TrainerBase::finished_epochs(std::uint64_t loader_epoch) const {
  return static_cast<std::int64_t>(loader_epoch) >= epochs_ || state_.global_step >= state_.max_steps ||
         control_.should_training_stop;
}

void TrainerBase::epoch_begin() {
  control_.should_epoch_stop = false;
  each_callback([&](TrainerCallback& c) { c.on_epoch_begin(args_, state_, control_); });
}

void TrainerBase::check_loss_value(const torch::Tensor& loss) const {
  if (!loss.defined() || loss.numel() != 1) {
    throw UsageError(fmt::format("Trainer: compute_loss must return one value (the batch's {} loss), got {}",
                                 count_items_set() ? "summed" : "mean",
                                 loss.defined() ? fmt::format("a tensor of {} elements", loss.numel())
                                                : std::string("an undefined tensor")));
  }
}

void TrainerBase::micro_step(const torch::Tensor& loss, std::int64_t rows, std::int64_t tokens) {
  check_loss_value(loss);
  micro_step_logged(loss, loss.detach(), rows, tokens);
}

void TrainerBase::micro_step_logged(const torch::Tensor& loss, const torch::Tensor& logged, std::int64_t rows,
                                    std::int64_t tokens) {
  if (window_micro_ == 0) {
    each_callback([&](TrainerCallback& c) { c.on_step_begin(args_, state_, control_); });
    window_loss_ = logged.reshape({}).to(torch::kFloat64);
    window_rows_ = window_tokens_ = 0;
  } else {
    window_loss_.add_(logged.reshape({}));
  }
  accelerator_->backward(loss);
  ++window_micro_;
  window_rows_ += rows;
  window_tokens_ += tokens;
}

void TrainerBase::micro_step_items(const torch::Tensor& summed_loss, double window_items,
                                   std::int64_t window_batches, std::int64_t rows, std::int64_t tokens) {
  auto& acc = *accelerator_;
  check_loss_value(summed_loss);
  // backward divides by gradient_accumulation_steps and the backends average over the replicas: multiplied
  // back, the window's gradients are d(sum of its items' losses) / window_items, HF's num_items_in_batch
  // rule. The logged value is scaled to the window's batches instead, so that log_training's mean over every
  // rank's micro-batches is the window's mean loss per item.
  // average_tokens_across_devices false: window_items is this rank's own, and the replicas' gradients are
  // averaged as they come (HF then logs the ranks' mean of their window means: the same scaling).
  const double replicas = args_.average_tokens_across_devices ? acc.data_parallel_group()->world_size() : 1.0;
  const auto per_item = summed_loss / std::max(window_items, 1.0);
  micro_step_logged(per_item * (replicas * acc.gradient_accumulation_steps()),
                    per_item.detach() * (replicas * static_cast<double>(window_batches)), rows, tokens);
}

double TrainerBase::window_items(std::int64_t counts) {
  auto& acc = *accelerator_;
  if (!args_.average_tokens_across_devices) {
    // HF's false: each rank's own items (transformers divides them by tp/cp/sp sizes: not followed here).
    if (acc.num_processes() != acc.data_parallel_group()->world_size())
      throw ConfigError(
          "TrainingArguments average_tokens_across_devices false is implemented for data parallelism only "
          "(every rank its own batch); with tensor, sequence or context parallelism set it to true",
          args_.source, 0, "average_tokens_across_devices");
    return static_cast<double>(counts);
  }
  auto t = torch::tensor({static_cast<double>(counts)}, torch::kFloat64);
  if (acc.num_processes() > 1) t = acc.reduce(t, ReduceOp::Sum).cpu();
  // The ranks of one replica (a tensor-parallel group) read the same rows: each item is counted that often.
  const double copies =
      static_cast<double>(acc.num_processes()) / std::max(acc.data_parallel_group()->world_size(), 1);
  return t.item<double>() / copies;
}

void TrainerBase::window_end() {
  auto& acc = *accelerator_;
  if (!acc.sync_gradients()) {
    each_callback([&](TrainerCallback& c) { c.on_substep_end(args_, state_, control_); });
    return;
  }
  // One all-reduce agrees on everything a rank alone knows: which ranks saw a non-finite loss, whether one
  // was asked to stop (SIGTERM/SIGUSR1), and the samples and tokens of the window.
  // The flags are a CPU tensor (Gloo also where the model trains on a GPU): the window's loss is the one
  // value read from the device, once per optimizer step.
  const double window_loss = window_loss_.item<double>();
  const int world = acc.num_processes();
  auto flags = torch::zeros({world + 3}, torch::kFloat64);
  auto* mine = flags.data_ptr<double>();
  mine[acc.process_index()] = std::isfinite(window_loss) ? 0.0 : 1.0;
  mine[world] = g_preempt_signal.load() != 0 ? 1.0 : 0.0;
  mine[world + 1] = static_cast<double>(window_rows_);
  mine[world + 2] = static_cast<double>(window_tokens_);
  const auto agreed = world > 1 ? acc.reduce(flags, ReduceOp::Sum).cpu() : flags;
  const auto* f = agreed.data_ptr<double>();
  std::vector<int> bad;
  for (int r = 0; r < world; ++r)
    if (f[r] > 0) bad.push_back(r);
  // The ranks of one data-parallel replica (a tensor-parallel group) read the same rows: each sample is
  // counted world / replicas times in the sum.
  const auto copies = static_cast<std::int64_t>(world / std::max(acc.data_parallel_group()->world_size(), 1));
  state_.num_samples_seen += static_cast<std::int64_t>(f[world + 1]) / copies;
  state_.num_input_tokens_seen += static_cast<std::int64_t>(f[world + 2]) / copies;
  if (!bad.empty()) {
    if (args_.nonfinite_loss == "stop") {
      throw Error(
          fmt::format("Trainer: the loss was NaN or Inf at step {} on rank(s) {} (nonfinite_loss: stop); "
                      "check the data and the learning rate, or set nonfinite_loss: skip to drop such steps",
                      state_.global_step + 1, fmt::join(bad, ", ")));
    }
    zero_grads();
    ++state_.skipped_steps;
    acc.print("Trainer: step ", state_.global_step + 1, " skipped: the loss was NaN or Inf on rank(s) ",
              fmt::format("{}", fmt::join(bad, ", ")), " (nonfinite_loss: skip)");
    if (!args_.logging_nan_inf_filter) {
      interval_loss_ += window_loss;
      interval_micro_ += window_micro_;
    }
  } else {
    // Under the backend's own clipping (DeepSpeed's gradient_clipping, equal to max_grad_norm: checked at
    // construction) the sync backward clipped the gradients already: the norm logged is the one it measured
    // before clipping, as HF's Trainer logs model.get_global_grad_norm() under DeepSpeed (the clipped
    // gradients' norm would read max_grad_norm at every clipped step).
    if (args_.max_grad_norm > 0) {
      last_grad_norm_ = automatic_gradient_clipping(acc.config()) > 0 && acc.global_grad_norm() >= 0
                            ? acc.global_grad_norm()
                            : acc.clip_grad_norm_(args_.max_grad_norm);
    }
    each_callback([&](TrainerCallback& c) { c.on_pre_optimizer_step(args_, state_, control_); });
    optimizer_->step();
    each_callback([&](TrainerCallback& c) { c.on_optimizer_step(args_, state_, control_); });
    // The rate logged for this step: transformers 5 reads it after optimizer.step() and before
    // lr_scheduler.step() (the rate the step used); where DeepSpeed's engine owns the schedule (a JSON
    // optimizer or scheduler block) it has stepped it inside the backward already, so HF logs the next step's
    // rate there, as here after the schedule's step.
    step_lr_ = optimizer_->param_groups().front().options().get_lr();
    if (!acc.optimizer_step_was_skipped()) scheduler_->step();
    if (engine_schedule_) step_lr_ = optimizer_->param_groups().front().options().get_lr();
    zero_grads();
    interval_loss_ += window_loss;
    interval_micro_ += window_micro_;
    run_loss_ += window_loss;
    run_micro_ += window_micro_;
  }
  window_micro_ = 0;
  ++state_.global_step;
  epoch_end_pending_ = state_.global_step % steps_per_epoch_ == 0;
  state_.epoch = static_cast<double>(state_.global_step) / static_cast<double>(steps_per_epoch_);
  if (bar_) bar_->update();
  // HF's DefaultFlowCallback.on_step_end.
  const auto step = state_.global_step;
  if (step == 1 && args_.logging_first_step) control_.should_log = true;
  if (args_.logging_strategy == "steps" && step % state_.logging_steps == 0) control_.should_log = true;
  if (args_.eval_strategy == "steps" && step % state_.eval_steps == 0) control_.should_evaluate = true;
  if (args_.save_strategy == "steps" && step % state_.save_steps == 0) control_.should_save = true;
  if (step >= state_.max_steps) {
    control_.should_training_stop = true;
    // transformers 5: eval_strategy steps also evaluates at the last step when it is not a multiple of
    // eval_steps (the final eval_loss was missing).
    if (args_.eval_strategy == "steps" && step % state_.eval_steps != 0) control_.should_evaluate = true;
    // HF: the end saves under every strategy but no and best (best saves at evaluations only).
    if (args_.save_strategy != "no" && args_.save_strategy != "best") control_.should_save = true;
  }
  if (f[world] > 0) {  // preemption: save now and stop, on every rank
    control_.should_save = true;
    control_.should_training_stop = true;
    interrupted_ = true;
  }
  each_callback([&](TrainerCallback& c) { c.on_step_end(args_, state_, control_); });
  step_ended_ = true;
}

void TrainerBase::maybe_log_save_evaluate(const std::function<Metrics()>& evaluate) {
  if (control_.should_log) {
    control_.should_log = false;
    if (state_.global_step > last_logged_step_) log_training();
  }
  if (control_.should_evaluate) {
    control_.should_evaluate = false;
    new_best_ = false;
    evaluate();
    // HF's _maybe_log_save_evaluate: save_strategy best saves exactly when this evaluation set a new best
    // (a preemption's save still happens).
    if (args_.save_strategy == "best" && !interrupted_) control_.should_save = new_best_;
  }
  if (control_.should_save) {
    control_.should_save = false;
    save_checkpoint();
  }
}

bool TrainerBase::after_step(const std::function<Metrics()>& evaluate) {
  if (!step_ended_) return false;
  step_ended_ = false;
  maybe_log_save_evaluate(evaluate);
  return control_.should_training_stop || control_.should_epoch_stop;
}

void TrainerBase::epoch_end(const std::function<Metrics()>& evaluate) {
  epoch_end_pending_ = false;  // a save inside (save_strategy: epoch) records the epoch as ended
  each_callback([&](TrainerCallback& c) { c.on_epoch_end(args_, state_, control_); });
  if (args_.logging_strategy == "epoch") control_.should_log = true;
  if (args_.eval_strategy == "epoch") control_.should_evaluate = true;
  if (args_.save_strategy == "epoch") control_.should_save = true;
  maybe_log_save_evaluate(evaluate);
}

void TrainerBase::log_training() {
  auto& acc = *accelerator_;
  auto both = torch::tensor({interval_loss_, static_cast<double>(interval_micro_)}, torch::kFloat64);
  both = acc.reduce(both, ReduceOp::Sum).cpu();
  const double count = both[1].item<double>();
  LogEntry logs;
  logs["loss"] = count > 0 ? both[0].item<double>() / count : std::nan("");
  if (last_grad_norm_ >= 0) logs["grad_norm"] = last_grad_norm_;
  logs["learning_rate"] = step_lr_ >= 0 ? step_lr_ : optimizer_->param_groups().front().options().get_lr();
  logs["epoch"] = state_.epoch;
  if (state_.num_input_tokens_seen > 0)
    logs["num_input_tokens_seen"] = static_cast<double>(state_.num_input_tokens_seen);
  interval_loss_ = 0;
  interval_micro_ = 0;
  last_logged_step_ = state_.global_step;
  record_log(logs);
  if (bar_) bar_->set_postfix(fmt::format("loss {:.4g}", logs["loss"]));
}

void TrainerBase::record_log(LogEntry logs) {
  each_callback([&](TrainerCallback& c) { c.on_log(args_, state_, control_, logs); });
  TrackerValues values;
  for (const auto& [k, v] : logs)
    values.emplace_back(tracker_name(k), v);
  if (trackers_open_) accelerator_->log(values, state_.global_step);
  logs["step"] = static_cast<double>(state_.global_step);
  if (!bar_ || bar_->mode() == ProgressMode::Off) accelerator_->print(format_logs(logs));
  state_.log_history.push_back(std::move(logs));
}

Metrics TrainerBase::finish_evaluation(Metrics raw) {
  Metrics metrics;
  for (const auto& [k, v] : raw)
    metrics[k.rfind("eval_", 0) == 0 ? k : "eval_" + k] = v;
  LogEntry logs(metrics.begin(), metrics.end());
  logs["epoch"] = state_.epoch;
  record_log(logs);
  each_callback([&](TrainerCallback& c) { c.on_evaluate(args_, state_, control_, metrics); });
  if (args_.metric_for_best_model) {
    std::string key = *args_.metric_for_best_model;
    if (key.rfind("eval_", 0) != 0) key = "eval_" + key;
    const auto it = metrics.find(key);
    if (it == metrics.end()) {
      std::vector<std::string> names;
      for (const auto& m : metrics)
        names.push_back(m.first);
      throw ConfigError(
          fmt::format("TrainingArguments metric_for_best_model '{}': the evaluation gave no '{}' (it "
                      "gave {}); return it from compute_metrics or choose one of those",
                      *args_.metric_for_best_model, key, fmt::join(names, ", ")),
          args_.source, 0, "metric_for_best_model");
    }
    const bool greater = args_.greater_is_better.value_or(true);
    if (!state_.best_metric ||
        (greater ? it->second > *state_.best_metric : it->second < *state_.best_metric)) {
      state_.best_metric = it->second;
      state_.best_global_step = state_.global_step;
      new_best_ = true;
    }
  }
  return metrics;
}

void TrainerBase::write_state(const std::string& dir) {
  state_.stateful_callbacks.clear();
  for (const auto& c : callbacks_) {
    auto a = c->attributes();
    if (!a.empty()) state_.stateful_callbacks[c->name()] = std::move(a);
  }
  // Whether the epoch that this step ended has had its end yet (kept beside the callbacks' state, as HF
  // keeps its TrainerControl there): a resumed run runs it once if not.
  if (epoch_end_pending_) state_.stateful_callbacks[kEpochEndKey] = {{"pending", 1.0}};
  // The accelerator state beside this file counts completed_steps = global_step + offset: recorded, so that a
  // resume can still tell an edited global_step from a later run's checkpoint.
  const auto offset = accelerator_->completed_steps() - state_.global_step;
  if (offset != 0) state_.stateful_callbacks[kStepOffsetKey] = {{"offset", static_cast<double>(offset)}};
  const fs::path path = fs::path(dir) / "trainer_state.json";
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << state_.to_json();
  out.close();
  if (!out) throw CheckpointError(fmt::format("Trainer: could not write '{}'", path.string()));
}

void TrainerBase::save_checkpoint() {
  auto& acc = *accelerator_;
  const std::string dir =
      (fs::path(args_.output_dir) / fmt::format("checkpoint-{}", state_.global_step)).string();
  if (state_.best_global_step && *state_.best_global_step == state_.global_step)
    state_.best_model_checkpoint = dir;
  if (args_.save_only_model && lora_) {
    // HF's Trainer with a PeftModel and save_only_model: the adapter files (and trainer_state.json) only.
    write_adapter(dir);
    if (acc.is_main_process()) write_state(dir);
    acc.wait_for_everyone();
  } else if (args_.save_only_model) {
    acc.save_model(model_, dir);
    // Beside the export, not in an atomic unit: save_only_model checkpoints are exports, not resumable.
    if (acc.is_main_process()) write_state(dir);
    acc.wait_for_everyone();
  } else {
    acc.save_state(dir);
  }
  each_callback([&](TrainerCallback& c) { c.on_save(args_, state_, control_); });
  if (args_.save_total_limit && acc.is_main_process()) rotate_checkpoints();
  acc.wait_for_everyone();
}

void TrainerBase::rotate_checkpoints() {
  std::vector<std::string> sorted;
  for (const auto& [step, path] : trainer_checkpoints(args_.output_dir))
    sorted.push_back(path);
  for (const auto& path :
       checkpoints_to_delete(sorted, *args_.save_total_limit, state_.best_model_checkpoint)) {
    std::error_code ec;
    fs::remove_all(path, ec);
    if (ec) accelerator_->print("Trainer: could not delete old checkpoint ", path, ": ", ec.message());
  }
}

namespace {

// The optimizer steps a checkpoint's accelerator state records (accelerator_state.safetensors, an int64
// "completed_steps"), or nothing when the file cannot be read as such.
std::optional<std::int64_t> saved_completed_steps(const std::string& dir) {
  try {
    const auto file = safetensors::File::open((fs::path(dir) / "accelerator_state.safetensors").string());
    if (!file.contains("completed_steps")) return std::nullopt;
    const auto& info = file.info("completed_steps");
    if (info.dtype != safetensors::DType::I64 || info.nbytes != sizeof(std::int64_t)) return std::nullopt;
    std::int64_t steps = 0;
    std::memcpy(&steps, file.data("completed_steps"), sizeof steps);
    return steps;
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

// The offset write_state recorded (kStepOffsetKey), 0 when none; CheckpointError when it is not an integer
// within the counters' range.
std::int64_t saved_step_offset(const TrainerState& s, const std::string& file) {
  const auto entry = s.stateful_callbacks.find(kStepOffsetKey);
  if (entry == s.stateful_callbacks.end()) return 0;
  const auto it = entry->second.find("offset");
  constexpr double kMax = static_cast<double>(std::int64_t{1} << 48);  // state_io's bound of the counters
  const double v = it == entry->second.end() ? std::nan("") : it->second;
  if (!std::isfinite(v) || v != std::floor(v) || std::abs(v) > kMax) {
    throw CheckpointError(fmt::format(
        "Trainer: cannot resume from '{}': stateful_callbacks[\"{}\"] has no attributes.offset that is an "
        "integer in [-2^48, 2^48]; the file is damaged or edited. Resume from another checkpoint; "
        "nothing was loaded",
        file, kStepOffsetKey));
  }
  return static_cast<std::int64_t>(v);
}

}  // namespace

void TrainerBase::resume_from(const std::string& dir) {
  auto& acc = *accelerator_;
  const fs::path state_file = fs::path(dir) / "trainer_state.json";
  std::error_code ec;
  if (!fs::exists(state_file, ec)) {
    throw CheckpointError(
        fmt::format("Trainer: cannot resume from '{}': it holds no trainer_state.json (not a "
                    "checkpoint the Trainer wrote); pass a checkpoint-<step> directory of "
                    "output_dir, or \"latest\"",
                    dir));
  }
  // Bounded, as every file a user can hand us: a trainer_state.json is kilobytes (its log history grows by a
  // line a logged step); /dev/zero or a pipe in its place is not read.
  const auto size = fs::is_regular_file(state_file, ec) ? fs::file_size(state_file, ec) : std::uintmax_t{0};
  if (ec || !fs::is_regular_file(state_file, ec) || size > (std::uintmax_t{256} << 20)) {
    throw CheckpointError(fmt::format("Trainer: cannot read '{}': {}", state_file.string(),
                                      ec         ? ec.message()
                                      : size > 0 ? "larger than 256 MiB, not a trainer_state.json"
                                                 : "not a regular file"));
  }
  std::ifstream in(state_file, std::ios::binary);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const TrainerState s = TrainerState::from_json(text, state_file.string());
  // Counters out of range are refused before anything loads (a manifest rewritten to agree with an edited
  // file passes the checksums: found by the fault campaign, a resumed run then trained 21, 30 or 0 steps).
  constexpr std::int64_t kMaxStep = std::int64_t{1} << 53;  // exact in trainer_state.json's doubles
  if (s.global_step < 0 || s.global_step > kMaxStep || !std::isfinite(s.epoch) || s.epoch < 0) {
    throw CheckpointError(fmt::format(
        "Trainer: cannot resume from '{}': its trainer_state.json holds global_step {} and epoch {}, outside "
        "[0, 2^53] and [0, inf); the file is damaged or edited. Resume from another checkpoint; nothing was "
        "loaded",
        dir, s.global_step, s.epoch));
  }
  // Both counters of optimizer steps were written by the same save: they agree, else one was edited. Read
  // before load_state changes anything (an unreadable state file is load_state's to name), and checked again
  // after it. They differ by the offset the save recorded (a later train()'s checkpoint: its global_step
  // counts from 0, the Accelerator's steps go on; fp16-skipped steps), 0 when none is recorded.
  const std::int64_t offset = saved_step_offset(s, state_file.string());
  auto disagree = [&](std::int64_t steps, const char* loaded) {
    return CheckpointError(fmt::format(
        "Trainer: cannot resume from '{}': its trainer_state.json says global_step {}{}, but the accelerator "
        "state in the same checkpoint completed {} optimizer steps; the checkpoint is damaged or was edited. "
        "Resume from another checkpoint{}",
        dir, s.global_step,
        offset == 0 ? std::string()
                    : fmt::format(" and {} {} (the accelerator's optimizer steps minus global_step)",
                                  kStepOffsetKey, offset),
        steps, loaded));
  };
  if (const auto saved = saved_completed_steps(dir); saved && *saved != s.global_step + offset)
    throw disagree(*saved, "; nothing was loaded");
  acc.load_state(dir);  // verifies the whole checkpoint, trainer_state.json included, before loading anything
  if (s.global_step + offset != acc.completed_steps()) throw disagree(acc.completed_steps(), "");
  state_.global_step = s.global_step;
  state_.epoch = s.epoch;
  state_.log_history = s.log_history;
  state_.best_metric = s.best_metric;
  state_.best_global_step = s.best_global_step;
  state_.best_model_checkpoint = s.best_model_checkpoint;
  state_.num_samples_seen = s.num_samples_seen;
  state_.num_input_tokens_seen = s.num_input_tokens_seen;
  state_.skipped_steps = s.skipped_steps;
  for (auto& c : callbacks_) {
    const auto it = s.stateful_callbacks.find(c->name());
    if (it != s.stateful_callbacks.end()) c->load_attributes(it->second);
  }
  epoch_end_pending_ = s.stateful_callbacks.count(kEpochEndKey) > 0;
  acc.print("Trainer: resumed from ", dir, " at step ", state_.global_step);
}

TrainOutput TrainerBase::end_train() {
  auto& acc = *accelerator_;
  signals_.reset();
  if (bar_) {
    bar_->close();
    bar_.reset();
  }
  const double runtime = std::max(now_seconds() - start_time_, 1e-9);
  auto both = torch::tensor({run_loss_, static_cast<double>(run_micro_)}, torch::kFloat64);
  both = acc.reduce(both, ReduceOp::Sum).cpu();
  TrainOutput out;
  out.global_step = state_.global_step;
  out.interrupted = interrupted_;
  out.training_loss = both[1].item<double>() > 0 ? both[0].item<double>() / both[1].item<double>() : 0.0;
  out.metrics = {
      {"train_runtime", runtime},
      {"train_samples_per_second", static_cast<double>(state_.num_samples_seen - start_samples_) / runtime},
      {"train_steps_per_second", static_cast<double>(state_.global_step - start_step_) / runtime},
      {"train_loss", out.training_loss}};
  LogEntry summary(out.metrics.begin(), out.metrics.end());
  summary["epoch"] = state_.epoch;
  summary["step"] = static_cast<double>(state_.global_step);
  state_.log_history.push_back(summary);
  if (args_.load_best_model_at_end && state_.best_model_checkpoint && !interrupted_) {
    std::error_code ec;
    if (fs::exists(*state_.best_model_checkpoint, ec)) {
      acc.print("Trainer: loading the best checkpoint ", *state_.best_model_checkpoint, " (",
                *args_.metric_for_best_model, " ", *state_.best_metric, ")");
      acc.load_state(*state_.best_model_checkpoint);
    }
  }
  each_callback([&](TrainerCallback& c) { c.on_train_end(args_, state_, control_); });
  if (trackers_open_) {
    acc.end_training();
    trackers_open_ = false;
  }
  if (interrupted_)
    acc.print("Trainer: stopped by a signal; saved checkpoint-", state_.global_step, " in ", args_.output_dir,
              "; train(\"latest\") continues from it");
  return out;
}

}  // namespace detail
}  // namespace accel
