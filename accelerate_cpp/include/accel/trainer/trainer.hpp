#pragma once
/// \file trainer.hpp
/// `accel::Trainer`: the training loop every user otherwise writes by hand (epochs, accumulation, clipping,
/// evaluation, logging, checkpoint rotation, early stopping, resume, preemption), configured by
/// `accel::TrainingArguments` with Hugging Face's names, on any backend the Accelerate config chooses. It
/// uses only the Accelerator's public API, so a Trainer run is the hand-written accelerated loop of the same
/// program, step for step (tests/trainer/trainer_scenarios.cpp checks it bit for bit on every backend row).
///
/// \code
///   auto args = accel::TrainingArguments::from_command_line(argc, argv);
///   Net model;
///   accel::Trainer trainer(args, model, train_set, [&](torch::data::Example<>& batch) {
///     return torch::cross_entropy_loss(model(batch.data), batch.target);
///   });
///   trainer.set_eval(test_set, eval_step, compute_metrics);  // optional
///   trainer.train();                                          // or train("latest") to resume
/// \endcode
///
/// The Accelerate config (ACCEL_CONFIG_FILE from accel-launch, or AcceleratorOptions) picks the backend;
/// where both files set precision, gradient accumulation, clipping, the seed or the trackers, a value set in
/// only one of them wins and two different values are a ConfigError naming both (docs/trainer.md).
///
/// Pipeline parallelism (the config's pipeline_config): give the Trainer a torch::nn::Sequential and the loss
/// of a micro-batch from the last stage's output and the batch's targets; it cuts the model into stages
/// (Accelerator::prepare_pipeline) and runs each optimizer step as one pipeline step:
///
/// \code
///   torch::nn::Sequential model(...);
///   accel::Trainer trainer(args, model, train_set, [](const torch::Tensor& out, const torch::Tensor& y) {
///     return torch::cross_entropy_loss(out, y);
///   });
/// \endcode

#include <accel/accelerator/accelerator.hpp>
#include <accel/nn/lora.hpp>
#include <accel/trainer/callbacks.hpp>
#include <accel/trainer/training_arguments.hpp>

#include <torch/torch.h>

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

namespace accel {

using Metrics = std::map<std::string, double>;

/// What an evaluation step returns for one batch; each part is optional. `loss`: the batch's mean loss
/// (scalar); `predictions` and `labels`: one row per sample, gathered over ranks with gather_for_metrics.
struct EvalOutput {
  torch::Tensor loss;
  torch::Tensor predictions;
  torch::Tensor labels;
};

/// All ranks' predictions and labels of one evaluation, every sample once (HF's EvalPrediction).
struct EvalPrediction {
  torch::Tensor predictions;
  torch::Tensor label_ids;
};

/// What train() returns.
struct TrainOutput {
  std::int64_t global_step = 0;
  double training_loss = 0;  ///< mean loss over the run's steps (this run's, after a resume)
  bool interrupted = false;  ///< SIGTERM/SIGUSR1 saved a checkpoint and stopped training
  Metrics metrics;           ///< train_runtime, train_samples_per_second, train_steps_per_second, train_loss
};

/// The loss of one pipeline micro-batch (pipeline::LossFunction of <accel/parallel/pipeline.hpp>).
using PipelineLoss = std::function<torch::Tensor(const torch::Tensor& output, const torch::Tensor& target)>;

namespace detail {

template <class B>
inline constexpr bool is_tensor_example =
    std::is_same_v<B, torch::data::Example<torch::Tensor, torch::Tensor>>;

/// Rows of a batch (its samples): the first dimension of its tensor, its data, or its first element.
inline std::int64_t batch_rows(const torch::Tensor& t) {
  return t.dim() > 0 ? t.size(0) : 1;
}
template <class D, class T>
std::int64_t batch_rows(const torch::data::Example<D, T>& e) {
  return batch_rows(e.data);
}
template <class T>
std::int64_t batch_rows(const std::vector<T>& v) {
  return v.empty() ? 0 : batch_rows(v.front());
}

/// The parts of the Trainer that do not depend on the dataset types (trainer.cpp).
class TrainerBase {
 public:
  TrainerBase(TrainingArguments args, AcceleratorOptions options);
  /// Trains through `accelerator`, which the caller owns and keeps alive while the Trainer lives.
  TrainerBase(TrainingArguments args, Accelerator& accelerator);
  virtual ~TrainerBase();
  TrainerBase(const TrainerBase&) = delete;
  TrainerBase& operator=(const TrainerBase&) = delete;

  Accelerator& accelerator() noexcept { return *accelerator_; }
  const TrainingArguments& args() const noexcept { return args_; }
  const TrainerState& state() const noexcept { return state_; }
  TrainerControl& control() noexcept { return control_; }
  void add_callback(std::shared_ptr<TrainerCallback> callback);
  /// Use these instead of the optimizer and schedule the arguments describe (HF's `optimizers=`). The
  /// optimizer must hold the model's parameters; the schedule steps once per optimizer step.
  void set_optimizer(std::shared_ptr<torch::optim::Optimizer> optimizer,
                     std::shared_ptr<torch::optim::LRScheduler> scheduler = nullptr);
  torch::optim::Optimizer* optimizer() noexcept { return optimizer_.get(); }
  /// A LoRA run (the model adapted by peft::get_peft_model, `lora` its handle), as Hugging Face's Trainer
  /// treats a PeftModel: each checkpoint-N holds the adapter in PEFT's files (adapter_model.safetensors,
  /// adapter_config.json) and the trainable state (adapters, modules to save, their optimizer state, the
  /// schedule, RNG and data position), not the frozen base (Accelerator::set_checkpoint_trainable_only);
  /// train("latest") resumes from it onto the same base, which the program loads as before. With
  /// save_only_model a checkpoint is the adapter files alone. Under sharded parameters (ZeRO-3, FULL_SHARD)
  /// the adapter files are cut from the model gathered on the main process once per save. Call before
  /// train().
  void set_peft_model(std::shared_ptr<peft::LoraModel> lora);
  /// The checkpoint directory train("latest") would resume from; "" when output_dir holds none.
  std::string latest_checkpoint() const;

 protected:
  void set_model(std::shared_ptr<torch::nn::Module> model);
  /// A pipeline: `model` is cut into this rank's stage by prepare_stage(), `loss` runs on the last stage.
  void set_pipeline(const torch::nn::Sequential& model, PipelineLoss loss);
  bool pipelined() const noexcept { return static_cast<bool>(pipeline_loss_); }
  const PipelineLoss& pipeline_loss() const noexcept { return pipeline_loss_; }
  /// Under a pipeline: cuts the model into this rank's stage (once), before the data loaders are prepared.
  void prepare_stage();
  /// Rows of one training / evaluation loader batch: the per-device batch size, times the micro-batches of a
  /// pipeline step under a pipeline (one loader batch is one optimizer step, as DeepSpeed's train_batch).
  std::size_t train_batch_rows() const;
  std::size_t eval_batch_rows() const;
  /// Under a pipeline: a ConfigError before training when a batch of the epoch (of any replica) will not
  /// split into the step's equal micro-batches (`samples` in the training data).
  void check_pipeline_batches(std::size_t samples) const;
  /// Under a pipeline: one optimizer step's forward and backward over a batch (instead of micro_step).
  void pipeline_micro_steps(const torch::Tensor& inputs, const torch::Tensor& targets, std::int64_t rows,
                            std::int64_t tokens);
  /// Under a pipeline: the last stage's outputs, on every stage of this replica.
  torch::Tensor pipeline_predict(const torch::Tensor& inputs);
  /// UsageError under a pipeline for what runs the whole model on one rank (`what`).
  void refuse_under_pipeline(const char* what) const;
  /// Plans the run from the batches per epoch, builds the optimizer and schedule, prepares them with the
  /// model (once), and resumes from `resume` ("" none, "latest", or a directory).
  void begin_train(std::size_t batches_per_epoch, const std::string& resume);
  bool finished_epochs(std::uint64_t loader_epoch) const;
  void epoch_begin();
  /// One micro-batch: callbacks, backward, counters. Call inside accelerator().accumulate(model).
  void micro_step(const torch::Tensor& loss, std::int64_t rows, std::int64_t tokens);
  /// The same for a loss summed over the batch's items (set_num_items): divided by `window_items`, the items
  /// of the whole accumulation window on every data-parallel replica, and scaled so that the backend's
  /// averages (over replicas, over gradient_accumulation_steps) give that window's mean, as Hugging Face's
  /// Trainer does with num_items_in_batch. `window_batches`: the window's micro-batches on this rank.
  void micro_step_items(const torch::Tensor& summed_loss, double window_items, std::int64_t window_batches,
                        std::int64_t rows, std::int64_t tokens);
  /// The items of this rank's `counts` summed over the data-parallel replicas (collective).
  double window_items(std::int64_t counts);
  /// Whether the dataset-typed part counts items (set_num_items).
  virtual bool count_items_set() const { return false; }
  void check_loss_value(const torch::Tensor& loss) const;
  void micro_step_logged(const torch::Tensor& loss, const torch::Tensor& logged, std::int64_t rows,
                         std::int64_t tokens);
  /// After micro_step, still inside the accumulate scope: the optimizer step when the window ends.
  void window_end();
  /// Logs, evaluates and saves as the control says; true when training must stop.
  bool after_step(const std::function<Metrics()>& evaluate);
  void epoch_end(const std::function<Metrics()>& evaluate);
  TrainOutput end_train();
  /// Logs the metrics of an evaluation (prefixed eval_), runs on_evaluate, tracks the best metric.
  Metrics finish_evaluation(Metrics metrics);
  std::shared_ptr<torch::nn::Module>& model() noexcept { return model_; }
  bool interrupted() const noexcept { return interrupted_; }
  /// The last step ended an epoch whose end (epoch_end) has not run yet; saved in checkpoints.
  bool epoch_end_pending() const noexcept { return epoch_end_pending_; }
  bool has_eval_ = false;

 private:
  struct Signals;
  void refuse_two_checkpointings(const Config& config) const;
  void attach();
  void build_optimizer();
  /// After an optimizer step (or a skipped one): HF's model.zero_grad(), the optimizer's way and the model's.
  void zero_grads();
  void build_scheduler();
  /// A later train(): a new TrainerState, schedule (and under DeepSpeed optimizer state), as HF's Trainer.
  void restart_run();
  /// The last train() stopped inside an optimizer step (its micro-batches' gradients still held), and the
  /// UsageError a train() that does not resume gives then.
  bool held_window() const;
  UsageError held_window_error() const;
  void resume_from(const std::string& dir);
  void log_training();
  void record_log(LogEntry logs);
  void maybe_log_save_evaluate(const std::function<Metrics()>& evaluate);
  void save_checkpoint();
  void rotate_checkpoints();
  void write_state(const std::string& dir);
  /// A LoRA run: PEFT's adapter files into `dir`. Collective under sharded parameters.
  void write_adapter(const std::string& dir);
  template <class F>
  void each_callback(F&& f) {
    for (auto& c : callbacks_)
      f(*c);
  }

  TrainingArguments args_;
  std::shared_ptr<Accelerator> accelerator_;  // owned, or borrowed (a no-op deleter)
  bool borrowed_ = false;
  std::shared_ptr<TrainerBase*> alive_ = std::make_shared<TrainerBase*>(this);  // for the save hook
  std::shared_ptr<torch::nn::Module> model_;             // the stage's module under a pipeline
  std::optional<torch::nn::Sequential> pipeline_model_;  // the whole model, until prepare_stage
  PipelineLoss pipeline_loss_;
  std::shared_ptr<torch::optim::Optimizer> optimizer_;
  std::shared_ptr<torch::optim::LRScheduler> scheduler_;
  std::shared_ptr<peft::LoraModel> lora_;  // set_peft_model
  std::vector<std::shared_ptr<TrainerCallback>> callbacks_;
  TrainerState state_;
  TrainerControl control_;
  bool prepared_ = false;
  bool user_scheduler_ = false;
  bool user_optimizer_ = false;
  std::vector<double> initial_lrs_;  // the groups' rates before the Trainer's schedule first changed them
  std::int64_t epochs_ = 0;
  std::int64_t warmup_ = 0;
  std::unique_ptr<Signals> signals_;
  // The current accumulation window and logging interval (this rank).
  // The window's loss sum stays on the device until the window ends (one kernel per micro-batch, one copy
  // to the host per optimizer step); a NaN/Inf micro-batch loss makes the sum NaN/Inf.
  torch::Tensor window_loss_;  // sum of the window's micro-batch losses (float64, on the device)
  std::int64_t window_micro_ = 0;
  std::int64_t window_rows_ = 0, window_tokens_ = 0;
  double interval_loss_ = 0;  // sum of the interval's losses (finite windows)
  std::int64_t interval_micro_ = 0;
  double run_loss_ = 0;  // sum of the run's losses (finite windows), for TrainOutput
  std::int64_t run_micro_ = 0;
  std::int64_t steps_per_epoch_ = 1;
  bool step_ended_ = false;
  bool trackers_open_ = false;
  std::int64_t last_logged_step_ = 0;
  double last_grad_norm_ = -1;
  bool engine_schedule_ = false;  // DeepSpeed's engine steps the schedule (a JSON optimizer/scheduler block)
  double step_lr_ = -1;           // the learning rate logged for the last optimizer step (HF's)
  double start_time_ = 0;
  std::int64_t start_step_ = 0, start_samples_ = 0;
  bool interrupted_ = false;
  bool epoch_end_pending_ = false;
  bool new_best_ = false;
  std::optional<ProgressBar> bar_;
};

}  // namespace detail

/// The Trainer over a torch::data batch dataset (anything prepare_data_loader takes) for training, and
/// optionally another for evaluation.
template <class TrainDataset, class EvalDataset = TrainDataset>
class Trainer : public detail::TrainerBase {
 public:
  using Batch = typename DataLoader<TrainDataset>::Batch;
  using EvalBatch = typename DataLoader<EvalDataset>::Batch;
  using LossFunction = std::function<torch::Tensor(Batch&)>;
  using EvalStep = std::function<EvalOutput(EvalBatch&)>;
  using ComputeMetrics = std::function<Metrics(const EvalPrediction&)>;

  /// `compute_loss(batch)` runs the model on a batch and returns the (mean) loss to minimise. The model is
  /// prepared by the Trainer; build it (same seed on every rank) before. `options` are the Accelerator's.
  template <class Model>
  Trainer(TrainingArguments args, Model& model, TrainDataset train, LossFunction compute_loss,
          AcceleratorOptions options = {})
      : TrainerBase(std::move(args), std::move(options)),
        train_(std::move(train)),
        compute_loss_(std::move(compute_loss)) {
    if (!compute_loss_) throw UsageError("Trainer: compute_loss is empty");
    set_model(as_module(model));
  }

  /// The same, through an Accelerator the program built first (and keeps alive while the Trainer lives): for
  /// a model that needs it before the Trainer exists, such as tensor-parallel layers built on
  /// `accelerator.tensor_parallel_group()`. Its config is fixed: arguments that would change its precision or
  /// gradient accumulation are a ConfigError naming both values; its trackers and their directory are its own
  /// (report_to and logging_dir in the arguments are refused). When the Trainer is destroyed it releases
  /// what it prepared on the Accelerator (free_memory(): collective), whose model is then plain LibTorch
  /// again.
  template <class Model>
  Trainer(TrainingArguments args, Accelerator& accelerator, Model& model, TrainDataset train,
          LossFunction compute_loss)
      : TrainerBase(std::move(args), accelerator),
        train_(std::move(train)),
        compute_loss_(std::move(compute_loss)) {
    if (!compute_loss_) throw UsageError("Trainer: compute_loss is empty");
    set_model(as_module(model));
  }

  /// A pipeline (the Accelerate config's pipeline_config; with stages 1, data parallel over every rank):
  /// `model` is cut into stages, each batch is an Example whose data enters the first stage and whose target
  /// reaches `loss(output, target)` on the last; per_device_train_batch_size is the micro-batch, a training
  /// batch holds the step's micro-batches (pipeline_config.micro_batches, or gradient_accumulation_steps).
  /// Evaluation runs through the stages too, in batches of per_device_eval_batch_size x micro-batches rows:
  /// predictions are the last stage's outputs and labels the targets, as Hugging Face's default; eval_step
  /// and set_optimizer are refused (the optimizer comes from the arguments). Not with gradient_checkpointing
  /// (wrap the blocks in accel::Checkpointed when building the Sequential).
  Trainer(TrainingArguments args, torch::nn::Sequential& model, TrainDataset train, PipelineLoss loss,
          AcceleratorOptions options = {})
      : TrainerBase(std::move(args), std::move(options)), train_(std::move(train)) {
    static_assert_pipeline_batches();
    set_pipeline(model, std::move(loss));
  }
  /// The same, through an Accelerator the program built first (tensor parallelism inside the stages).
  Trainer(TrainingArguments args, Accelerator& accelerator, torch::nn::Sequential& model, TrainDataset train,
          PipelineLoss loss)
      : TrainerBase(std::move(args), accelerator), train_(std::move(train)) {
    static_assert_pipeline_batches();
    set_pipeline(model, std::move(loss));
  }

  /// Evaluation data and how to evaluate: `eval_step(batch)` returns the batch's loss and/or predictions
  /// and labels (default: compute_loss's value); `compute_metrics` turns all ranks' predictions and labels
  /// into named metrics (reported as eval_<name>).
  void set_eval(EvalDataset eval, EvalStep eval_step = {}, ComputeMetrics compute_metrics = {}) {
    if (eval_step) refuse_under_pipeline("set_eval's eval_step");
    eval_.emplace(std::move(eval));
    eval_step_ = std::move(eval_step);
    compute_metrics_ = std::move(compute_metrics);
    has_eval_ = true;
  }
  /// Tokens in a batch (for num_input_tokens_seen and tokens/s).
  void set_count_tokens(std::function<std::int64_t(const Batch&)> count) { count_tokens_ = std::move(count); }
  /// Token-level loss normalisation, as Hugging Face's Trainer does for causal LMs (num_items_in_batch with
  /// average_tokens_across_devices): `count(batch)` is the number of items (label tokens) the batch's loss
  /// is taken over, and compute_loss must then return the SUM of the batch's per-item losses. Before each
  /// accumulation window the Trainer reads the window's batches ahead, counts their items on every rank, and
  /// divides each micro-batch's sum by the total, so the gradients are those of the mean over every label
  /// token of the window: N ranks equal one process whatever their rows' lengths, and accumulation equals
  /// the large batch. Evaluation divides each batch's sum by its own count (HF's mean eval loss per batch).
  /// Example (accel::llm): `trainer.set_num_items(accel::llm::sft_label_count);` with a loss of
  /// `accel::llm::sft_loss(*model, batch, 1)`.
  void set_num_items(std::function<std::int64_t(const Batch&)> count) { count_items_ = std::move(count); }

 protected:
  bool count_items_set() const override { return static_cast<bool>(count_items_); }

 public:
  /// Trains per the arguments. `resume`: "" (args.resume_from_checkpoint, else none), "latest" (the newest
  /// checkpoint in output_dir; none there starts from scratch) or a checkpoint directory.
  TrainOutput train(const std::string& resume = "") {
    auto& acc = accelerator();
    if (pipelined()) prepare_stage();  // before the loaders: they then shard over the pipeline's replicas
    if (!train_loader_) {
      train_loader_ = acc.prepare_data_loader(
          train_, DataLoaderOptions(train_batch_rows())
                      .shuffle(true)
                      .seed(args().data_seed.value_or(args().seed))
                      .drop_last(args().dataloader_drop_last)
                      .pin_memory(args().dataloader_pin_memory)
                      .workers(static_cast<std::size_t>(args().dataloader_num_workers)));
    } else {
      train_loader_->set_epoch(0);  // a later train(): a new run from the first epoch, as HF's new loader
    }
    if (eval_ && !eval_loader_) {
      eval_loader_ = acc.prepare_data_loader(
          *eval_, DataLoaderOptions(eval_batch_rows())
                      .drop_last(args().dataloader_drop_last)  // HF's _get_dataloader: eval too
                      .pin_memory(args().dataloader_pin_memory));
    }
    check_pipeline_batches(train_loader_->dataset_size());
    begin_train(train_loader_->size(), resume.empty() ? args().resume_from_checkpoint.value_or("") : resume);
    auto evaluate_fn = [this] { return evaluate(); };
    while (!finished_epochs(train_loader_->epoch())) {
      bool stop = false;
      std::size_t batches = 0;
      for (auto& batch : *train_loader_) {
        // The epoch begins at its first batch: a run resumed after an epoch's last batch does not begin that
        // epoch again (HF resumes at the next epoch).
        if (batches++ == 0) epoch_begin();
        if (pipelined()) {
          if constexpr (detail::is_tensor_example<Batch>) {
            pipeline_micro_steps(batch.data, batch.target, detail::batch_rows(batch),
                                 count_tokens_ ? count_tokens_(batch) : 0);
            window_end();
          }
        } else {
          auto window = acc.accumulate(model());
          model()->train();
          const torch::Tensor loss = compute_loss_(batch);
          const std::int64_t rows = detail::batch_rows(batch),
                             tokens = count_tokens_ ? count_tokens_(batch) : 0;
          if (count_items_) {
            if (window_left_ == 0) open_items_window(batch);
            micro_step_items(loss, window_total_, window_batches_, rows, tokens);
            --window_left_;
          } else {
            micro_step(loss, rows, tokens);
          }
          window_end();
        }
        if (after_step(evaluate_fn)) {
          stop = true;
          break;
        }
      }
      if (batches == 0 && !stop) {
        // Resumed after an epoch's last batch. Its end (evaluation, epoch save, on_epoch_end) ran before the
        // checkpoint was written, or is still due: a checkpoint from that last step's save or a preemption.
        if (epoch_end_pending()) epoch_end(evaluate_fn);
        if (control().should_training_stop) break;
        continue;
      }
      // As HF: the epoch ends (its evaluation and save) also when max_steps or a callback stopped training
      // inside it; not after a preemption signal, whose checkpoint is already written.
      if (!interrupted()) epoch_end(evaluate_fn);
      if (stop || control().should_training_stop) break;
    }
    return end_train();
  }

  /// Evaluates on the evaluation data: eval_loss (mean over samples) and compute_metrics' values, the same
  /// on every rank. Collective.
  Metrics evaluate() {
    if (!eval_loader_) throw UsageError("Trainer::evaluate: no evaluation data (call set_eval first)");
    auto& acc = accelerator();
    const bool was_training = model()->is_training();
    model()->eval();
    Metrics metrics;
    {
      torch::NoGradGuard no_grad;
      double loss_sum = 0;
      std::int64_t loss_rows = 0;
      std::vector<torch::Tensor> predictions, labels;
      std::size_t index = 0;  // of this rank's evaluation batches
      for (auto& batch : *eval_loader_) {
        EvalOutput out;
        if (pipelined()) {
          if constexpr (detail::is_tensor_example<EvalBatch>) {
            // Hugging Face's default: the model's outputs are the predictions, the batch's targets the
            // labels.
            out.predictions = pipeline_predict(batch.data);
            out.labels = batch.target;
            out.loss = pipeline_loss()(out.predictions, batch.target.to(out.predictions.device()));
          }
        } else {
          out = eval_step_ ? eval_step_(batch) : EvalOutput{compute_loss_for_eval(batch), {}, {}};
        }
        if (out.loss.defined()) {
          const auto rows = eval_rows(detail::batch_rows(batch), index);
          auto losses = acc.gather_for_metrics(
              out.loss.detach().to(torch::kFloat64).reshape({1}).expand({rows}).contiguous());
          loss_sum += losses.sum().template item<double>();
          loss_rows += losses.size(0);
        }
        ++index;
        if (out.predictions.defined()) predictions.push_back(acc.gather_for_metrics(out.predictions).cpu());
        if (out.labels.defined()) labels.push_back(acc.gather_for_metrics(out.labels).cpu());
      }
      if (loss_rows > 0) metrics["loss"] = loss_sum / static_cast<double>(loss_rows);
      if (compute_metrics_) {
        EvalPrediction p;
        if (!predictions.empty()) p.predictions = torch::cat(predictions);
        if (!labels.empty()) p.label_ids = torch::cat(labels);
        for (const auto& [k, v] : compute_metrics_(p))
          metrics[k] = v;
      }
    }
    if (was_training) model()->train();
    return finish_evaluation(std::move(metrics));
  }

 private:
  template <class M>
  static std::shared_ptr<torch::nn::Module> as_module(torch::nn::ModuleHolder<M>& m) {
    return m.ptr();
  }
  template <class M>
  static std::shared_ptr<torch::nn::Module> as_module(std::shared_ptr<M>& m) {
    return m;
  }
  static constexpr void static_assert_pipeline_batches() {
    static_assert(
        detail::is_tensor_example<Batch> && detail::is_tensor_example<EvalBatch>,
        "accel::Trainer with a pipeline: the batches must be torch::data::Example<> (data into the first "
        "stage, target to the loss on the last), e.g. a dataset mapped with "
        "torch::data::transforms::Stack<>()");
  }
  // The window that starts with `first` (already yielded): it and the loader's next batches up to
  // gradient_accumulation_steps (fewer at the epoch's end, where the window closes too), their items counted
  // here on every rank (each read-ahead batch built once more from the dataset, as HF's get_batch_samples
  // holds them) and summed over the replicas.
  void open_items_window(const Batch& first) {
    const auto gas = static_cast<std::size_t>(accelerator().gradient_accumulation_steps());
    const auto ahead = train_loader_->upcoming(gas > 0 ? gas - 1 : 0);
    std::int64_t items = count_items_(first);
    for (const auto& indices : ahead)
      items += count_items_(train_.get_batch(indices));
    window_batches_ = window_left_ = static_cast<std::int64_t>(ahead.size()) + 1;
    window_total_ = window_items(items);
  }
  // The samples an evaluation batch's loss stands for, as HF weighs it (the evaluation batch size; the last
  // batch of a one-process epoch, what is left of the dataset; gather_for_metrics drops the last round's
  // wrap-around): a padding-free batch (TRL's packing, every row joined into one) has tensors of one row but
  // holds the batch's samples, which HF counts (its eval_loss over packed data was weighted 1 per batch
  // here). Under even_batches false on several ranks, a padding-free last batch counts as one sample.
  std::int64_t eval_rows(std::int64_t tensor_rows, std::size_t index) {
    if (tensor_rows != 1) return tensor_rows;
    auto& acc = accelerator();
    const auto world = static_cast<std::size_t>(std::max(acc.data_parallel_group()->world_size(), 1));
    const auto full = std::max<std::size_t>(eval_batch_rows() / (acc.config().split_batches ? world : 1), 1);
    const auto batches = eval_loader_->size();
    if (index + 1 < batches || args().dataloader_drop_last || (world > 1 && acc.config().even_batches))
      return static_cast<std::int64_t>(full);
    if (world > 1) return tensor_rows;  // even_batches false: a rank's last batch may be short
    return static_cast<std::int64_t>(eval_loader_->dataset_size() - (batches - 1) * full);
  }
  torch::Tensor compute_loss_for_eval(EvalBatch& batch) {
    if constexpr (std::is_same_v<EvalBatch, Batch>) {
      if (count_items_)
        return compute_loss_(batch) / static_cast<double>(std::max<std::int64_t>(count_items_(batch), 1));
      return compute_loss_(batch);
    } else {
      throw UsageError(
          "Trainer::evaluate: the evaluation batches differ from the training batches; give "
          "set_eval an eval_step");
    }
  }

  TrainDataset train_;
  std::optional<EvalDataset> eval_;
  LossFunction compute_loss_;
  EvalStep eval_step_;
  ComputeMetrics compute_metrics_;
  std::function<std::int64_t(const Batch&)> count_tokens_;
  std::function<std::int64_t(const Batch&)> count_items_;  // set_num_items
  std::int64_t window_batches_ = 0, window_left_ = 0;      // the open items window's batches, those left
  double window_total_ = 0;                                // its items over every replica
  std::unique_ptr<DataLoader<TrainDataset>> train_loader_;
  std::unique_ptr<DataLoader<EvalDataset>> eval_loader_;
};

}  // namespace accel
