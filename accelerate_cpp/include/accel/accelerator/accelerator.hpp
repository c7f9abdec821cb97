#pragma once
/// \file accelerator.hpp
/// `accel::Accelerator`: the one object a training loop talks to. It reads the YAML config (the file named by
/// `ACCEL_CONFIG_FILE`, which accel-launch sets, or the one given in the options), picks the device and the
/// backend, and provides Hugging Face Accelerate's API: prepare, backward, gather, accumulation, mixed
/// precision, clipping, checkpoints. The facade holds no backend-specific code: it delegates to the
/// collaborators of accelerator_parts.hpp, the accumulation clock (gradient_state.hpp) and one backend engine
/// per prepared model.
///
/// The smallest diff to a plain LibTorch loop:
/// \code
///   #include <accel/accelerator/accelerator.hpp>                       // +
///   accel::Accelerator accelerator;                                    // +
///   accelerator.prepare(model, optimizer);                             // +
///   auto loader = accelerator.prepare_data_loader(std::move(ds), 64);  // was torch::data::make_data_loader
///   ...
///   accelerator.backward(loss);                                        // was loss.backward()
/// \endcode
///
/// Several models are normal (GAN, frozen teacher, EMA copy): `accelerator.prepare(G, D, opt_g, opt_d)` in
/// any order; each optimizer is matched to the model that owns its parameters, and every backend serves
/// every model.

#include <accel/accelerator/accelerator_parts.hpp>
#include <accel/accelerator/gradient_state.hpp>
#include <accel/backend/backend.hpp>
#include <accel/checkpoint/model_export.hpp>
#include <accel/checkpoint/objects.hpp>
#include <accel/checkpoint/project_configuration.hpp>
#include <accel/config/config.hpp>
#include <accel/data/data_loader.hpp>
#include <accel/distributed/communicator.hpp>
#include <accel/errors.hpp>
#include <accel/monitor/memory.hpp>
#include <accel/monitor/progress.hpp>
#include <accel/monitor/tracking.hpp>
#include <accel/optim/grad_scaler.hpp>

#include <torch/arg.h>
#include <torch/data/dataloader_options.h>
#include <torch/data/samplers/random.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/schedulers/lr_scheduler.h>

#include <cstdint>
#include <filesystem>
#include <functional>
#include <iostream>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

namespace torch::serialize {
class OutputArchive;
class InputArchive;
}  // namespace torch::serialize

namespace torch::nn {
class SequentialImpl;
class Sequential;
class AnyModule;
}  // namespace torch::nn

namespace accel {
namespace pipeline {
class PipelineStage;
class PipelineEngine;
using LossFunction = std::function<torch::Tensor(const torch::Tensor& output, const torch::Tensor& target)>;
}  // namespace pipeline
namespace detail {
struct StateParts;
}  // namespace detail

/// Overrides applied on top of the config file. Example:
/// \code
///   auto options = AcceleratorOptions().mixed_precision(MixedPrecision::Bf16);
///   Accelerator acc(options.gradient_accumulation_steps(4));
/// \endcode
struct AcceleratorOptions {
  /// Config file to read (default: `$ACCEL_CONFIG_FILE` when set, else built-in defaults).
  TORCH_ARG(std::optional<std::string>, config_file);
  /// A complete config to use instead of any file.
  TORCH_ARG(std::optional<Config>, config);
  TORCH_ARG(std::optional<MixedPrecision>, mixed_precision);
  TORCH_ARG(std::optional<int>, gradient_accumulation_steps);
  /// Force the CPU even when a GPU is present.
  TORCH_ARG(std::optional<bool>, cpu);
  /// Process layout to use instead of reading the environment (tests, custom launchers).
  TORCH_ARG(std::optional<ProcessState>, process_state);
  /// Checkpoint directory, automatic naming and rotation (see ProjectConfiguration).
  TORCH_ARG(ProjectConfiguration, project_config);
  /// Experiment trackers (tracking.hpp): "tensorboard", "csv", "jsonl", "all" or a comma-separated list;
  /// overrides the config's `log_with`.
  TORCH_ARG(std::optional<std::string>, log_with);
  /// The program's own trackers, written to besides the named ones (on the main process).
  TORCH_ARG(std::vector<std::shared_ptr<Tracker>>, trackers);
  /// Tensor parallelism (accel/parallel/tensor_parallel.hpp): the ranks form groups of `v` consecutive ranks
  /// (rank = replica x v + tp rank) whose layers hold slices of one model; `tensor_parallel_group()` is this
  /// rank's group for the parallel layers, and the backends, prepared loaders and gradient reduction work
  /// over the data-parallel replicas (`data_parallel_group()`). num_processes must be a multiple of `v`.
  /// clip_grad_norm_ counts each element of the model once (a split parameter's slices on their ranks, a
  /// replicated one once per group); get_state_dict, save_model and save_state write the unsplit model (the
  /// layers gathered over each group), which load_model and load_state cut back into this run's slices, with
  /// any tensor_parallel_size or none. A config's `parallelism_config_tp_size` sets the same (1 here leaves
  /// it to the config; both set must agree).
  TORCH_ARG(int, tensor_parallel_size) = 1;
  /// Backend registry to pick from (default: the built-in backends).
  TORCH_ARG(std::shared_ptr<const BackendRegistry>, registry);

 public:
  /// Base directory of tracker logs (`<project_dir>/<project_name>`) and of automatic checkpoints: the
  /// ProjectConfiguration's project_dir.
  AcceleratorOptions& project_dir(std::string v) { return project_config_.project_dir = std::move(v), *this; }
  /// Adds a tracker of the program's own (see `trackers`).
  AcceleratorOptions& log_with(std::shared_ptr<Tracker> v) {
    return trackers_.push_back(std::move(v)), *this;
  }
  /// `log_with("tensorboard")`: a string literal picks the named trackers, not a tracker object.
  AcceleratorOptions& log_with(const char* v) { return log_with_ = std::string(v), *this; }
};

/// What `Accelerator::profile` records (Accelerate's ProfileKwargs).
struct ProfileOptions {
  /// Each rank writes `<output_trace_dir>/trace_rank_<rank>.json` (Chrome trace format: chrome://tracing,
  /// Perfetto, TensorBoard's profiler plugin).
  std::string output_trace_dir = "profile";
  /// Input shapes of every operator.
  bool record_shapes = false;
  /// Tensor memory allocated and freed by each operator.
  bool profile_memory = false;
  /// The C++ call stack of each operator.
  bool with_stack = false;
  /// Estimated FLOPs of matrix multiplications and convolutions.
  bool with_flops = false;
};

/// The training-loop facade. One per process; not thread-safe. Methods marked "collective" must be called
/// on every rank in the same order.
class Accelerator {
 public:
  /// Reads `$ACCEL_CONFIG_FILE` when set, else uses defaults. Throws ConfigError on a bad config.
  Accelerator();
  explicit Accelerator(AcceleratorOptions options);
  ~Accelerator();
  Accelerator(const Accelerator&) = delete;
  Accelerator& operator=(const Accelerator&) = delete;

  // ---- process and device ------------------------------------------------------------------------------
  /// Device of this rank: `cuda:<local rank>` when LibTorch has CUDA and a GPU is present, else CPU.
  torch::Device device() const noexcept { return device_; }
  int process_index() const noexcept { return state_.rank; }
  int local_process_index() const noexcept { return state_.local_rank; }
  int num_processes() const noexcept { return state_.world_size; }
  bool is_main_process() const noexcept { return state_.rank == 0; }
  bool is_local_main_process() const noexcept { return state_.local_rank == 0; }
  const Config& config() const noexcept { return config_; }
  /// Name of the active backend ("local", "ddp", ...).
  std::string backend_name() const;
  /// What the active backend shards (optimizer state, gradients, parameters).
  BackendCapabilities capabilities() const;
  /// Settings of the config that have no effect in this run, each with the reason (for example CPU offload on
  /// a CPU run), then the backend's advice on prepared optimizers (CPU offload stepping LibTorch's unfused
  /// Adam). The main process also prints each once to stderr: the first at construction, the advice at
  /// `prepare`.
  const std::vector<std::string>& notices() const noexcept { return notices_; }
  MixedPrecision mixed_precision() const noexcept { return config_.mixed_precision; }
  int gradient_accumulation_steps() const noexcept { return config_.gradient_accumulation_steps; }

  // ---- prepare -----------------------------------------------------------------------------------------
  /// Prepares, in place, any mix of models (`ModuleHolder` such as `Net`, or `std::shared_ptr<Module>`),
  /// optimizers and LR schedulers, in any order: models move to the device and each gets its own backend
  /// engine; each optimizer is matched to the model that owns its parameters and keeps working through the
  /// user's own `step()` and `zero_grad()`; a model without optimizer (frozen teacher, EMA copy) is fine;
  /// mixed-precision autocast is switched on for the calling thread. Collective.
  template <class... Ts>
  void prepare(Ts&... objects) {
    (prepare_model_pass(objects), ...);
    (prepare_optimizer_pass(objects), ...);
    (prepare_scheduler_pass(objects), ...);
  }

  /// Replaces `torch::data::make_data_loader<Sampler>(dataset, options)`: a loader that shards the data over
  /// the ranks, reshuffles per epoch (RandomSampler, the default as in LibTorch) or keeps the order
  /// (SequentialSampler), moves batches to `device()` and is saved and restored by save_state/load_state.
  template <class Sampler = torch::data::samplers::RandomSampler, class Dataset>
  std::unique_ptr<DataLoader<Dataset>> prepare_data_loader(Dataset dataset,
                                                           const torch::data::DataLoaderOptions& options) {
    DataLoaderOptions o(options.batch_size());
    o.drop_last(options.drop_last())
        .shuffle(std::is_same_v<Sampler, torch::data::samplers::RandomSampler>)
        .workers(options.workers());
    return prepare_data_loader(std::move(dataset), o);
  }
  template <class Dataset>
  std::unique_ptr<DataLoader<Dataset>> prepare_data_loader(Dataset dataset, DataLoaderOptions options) {
    complete_loader_options(options);
    auto state = register_loader();
    return std::make_unique<DataLoader<Dataset>>(std::move(dataset), std::move(options), groups_.data->rank(),
                                                 groups_.data->world_size(), device_, std::move(state));
  }
  template <class Dataset>
  std::unique_ptr<DataLoader<Dataset>> prepare_data_loader(Dataset dataset, std::size_t batch_size) {
    return prepare_data_loader<torch::data::samplers::RandomSampler>(
        std::move(dataset), torch::data::DataLoaderOptions(batch_size));
  }

  /// The model itself: `prepare` works in place, so there is no wrapper to remove.
  template <class M>
  M& unwrap_model(M& model) const noexcept {
    return model;
  }
  /// A prepared model's whole, current parameters and buffers by name (copies), as Accelerate's
  /// `get_state_dict(model)`. Collective: with sharded backends every rank must call it.
  template <class M>
  NamedTensors get_state_dict(M& model) {
    return model_state(model_index(as_module(model)));
  }
  /// The same, gathered to the main process only: other ranks get an empty list and never hold the whole
  /// model (a sharded model is gathered one unit at a time). Tensors are on the CPU. Collective.
  template <class M>
  NamedTensors get_state_dict(M& model, StateDictOn where) {
    return where == StateDictOn::MainProcess ? main_process_state(model_index(as_module(model)))
                                             : model_state(model_index(as_module(model)));
  }
  /// The same for the only prepared model; UsageError when several are prepared. Collective.
  NamedTensors get_state_dict();

  /// Exports a prepared model's full weights as Hugging Face does (`save_pretrained` / Accelerate's
  /// `save_model`): `dir/model.safetensors`, or, when they exceed `max_shard_size` ("10GB", "500MB", "2GiB"
  /// or bytes), `model-0000k-of-0000n.safetensors` shards plus `model.safetensors.index.json`, readable by
  /// Python's safetensors and transformers' sharded loading. Only the main process writes; a sharded model is
  /// gathered one unit at a time, so the main process holds at most one shard plus one unit and the other
  /// ranks one unit. Weights of an earlier export in `dir` are replaced only once the new files are complete.
  /// Collective.
  template <class M>
  ModelExport save_model(M& model, const std::string& dir, const std::string& max_shard_size = "10GB") {
    return save_model_at(model_index(as_module(model)), dir, max_shard_size);
  }
  /// Loads an export written by `save_model` (one file or shards with their index; by any backend and number
  /// of processes) into a prepared model. Throws CheckpointError naming the missing file or tensor.
  /// Collective. Contract (as Accelerate's `load_state`): there is no closing barrier. Each rank maps the
  /// files and copies what it keeps (its slices under ZeRO-3, FULL_SHARD or tensor parallelism) at its own
  /// pace, so a rank may return while others still read `dir`. Before any rank rewrites or deletes those
  /// files (a later `save_model` into `dir`, a test replacing model.safetensors), call
  /// `wait_for_everyone()`.
  template <class M>
  void load_model(M& model, const std::string& dir) {
    load_model_at(model_index(as_module(model)), dir);
  }

  // ---- the step ------------------------------------------------------------------------------------------
  /// Replaces `loss.backward()`. Divides the loss by `gradient_accumulation_steps`, scales it for fp16, runs
  /// backward, and on the last micro-step of an accumulation cycle (or the last batch of the data)
  /// synchronises gradients through the backends and unscales them. On the other micro-steps the gradients
  /// are set aside, so the user's `optimizer.step()` and `zero_grad()` do nothing until the cycle completes.
  /// A micro-step is a batch, not a backward call: every backward of one batch (GAN: the discriminator's and
  /// the generator's) belongs to the same micro-step. A batch is an `accumulate()` scope, else what a
  /// prepared data loader yields, else (no loader) one backward call. Gradients add up across backward calls
  /// until `optimizer.step()` / `zero_grad()`. Collective on sync steps.
  void backward(const torch::Tensor& loss);
  // ---- pipeline parallelism (`pipeline_config:`; include <accel/parallel/pipeline.hpp>) -------------------
  /// This process's stage of `model`: pipeline_config.stages stages, each run by num_processes / stages
  /// data-parallel replicas (rank = stage x replicas + replica; 1 stage, one process: the whole model),
  /// partitioned by pipeline_config.partition. Every rank builds the same model (same seed); the stage keeps
  /// its own layers, which share their parameters with `model`. The stage is a prepared model of the
  /// configured backend over its replicas: build the optimizer over `stage.parameters()` and pass it to
  /// `prepare` (needed for zero stage 1, which shards its state). Backends that shard gradients or parameters
  /// (zero 2-3, FSDP's sharded strategies) are refused, as in DeepSpeed. mixed_precision works (fp16: a loss
  /// scale shared by all stages, an overflow on any stage skips the step on all); clip_grad_norm_ clips the
  /// whole model's norm (every stage's part); save_state writes one file per global layer, which load_state
  /// reads with any number of stages and replicas. Data loaders prepared after this shard the data over the
  /// replicas (every stage of a replica reads the same batches); ones prepared before are refused. One
  /// pipeline per Accelerator. Not yet with a pipeline (refused with an error, never silently): stages over
  /// NCCL; on CUDA devices the stages run with ACCEL_CUDA_COLLECTIVES=gloo (transfers on host copies).
  pipeline::PipelineStage& prepare_pipeline(const torch::nn::Sequential& model);
  /// The escape hatch for a model that is not a Sequential: `build_stage(s)` returns stage s's module (any
  /// module with `forward(Tensor) -> Tensor`), called for this rank's stage only; parameters are named
  /// "<stage>.<name>". Everything else as above (checkpoints then resume with the same number of stages).
  pipeline::PipelineStage& prepare_pipeline(
      const std::function<torch::nn::AnyModule(int stage)>& build_stage);
  /// One training step of the pipeline: `inputs` (read on the first stage) and `targets` (read on the last)
  /// are this replica's batch from a prepared data loader, or else the global batch, the same on every
  /// rank, of which each replica takes its 1/replicas of the rows; cut into
  /// pipeline_config.micro_batches micro-batches (0: gradient_accumulation_steps) that run through
  /// pipeline_config.schedule (1f1b or gpipe). The gradients of the whole batch's mean loss end in the
  /// stage's parameters (reduced across the replicas during the stage's last backward). Returns that mean
  /// loss on every rank. Zero the gradients before and step the optimizer after, as in a plain loop.
  /// Collective. `backward()` is not used with a pipeline.
  double pipeline_step(const torch::Tensor& inputs, const torch::Tensor& targets,
                       const pipeline::LossFunction& loss);
  /// The mean loss over the whole batch, forward only (no gradients). Collective.
  double pipeline_evaluate(const torch::Tensor& inputs, const torch::Tensor& targets,
                           const pipeline::LossFunction& loss);
  /// The last stage's outputs for `inputs` (forward only, no gradients), on every stage of this replica, for
  /// predictions and metrics. `inputs` as in pipeline_step, but given on every stage (the same batch, as a
  /// prepared data loader gives each stage of a replica). A batch whose rows do not split into the
  /// micro-batches runs padded with copies of its last row, whose outputs are dropped. Collective over the
  /// replica's stages.
  torch::Tensor pipeline_predict(const torch::Tensor& inputs);
  /// The micro-batches of each pipeline step: pipeline_config.micro_batches, or gradient_accumulation_steps
  /// where that is 0.
  int pipeline_micro_batches() const noexcept;

  /// True when the current micro-step ends an accumulation cycle: the optimizer steps that follow are real.
  bool sync_gradients() const noexcept { return clock_.sync_gradients(); }
  /// True when the last sync backward found inf/NaN gradients (fp16) for some optimizer, whose step is then
  /// skipped.
  bool optimizer_step_was_skipped() const noexcept;
  /// True when `optimizer`'s step after the last sync backward is skipped (fp16 overflow in its gradients).
  bool optimizer_step_was_skipped(const torch::optim::Optimizer& optimizer) const;
  /// Clips the global gradient norm of every prepared model to `max_norm`; returns the norm before clipping
  /// (as in PyTorch). On micro-steps that do not sync it does nothing and returns 0; after an fp16 overflow
  /// it returns infinity. Collective on sync steps.
  double clip_grad_norm_(double max_norm, double norm_type = 2.0);
  /// Accelerate's `clip_grad_norm_(parameters, max_norm)`: the same over the given parameters, typically one
  /// model's (`model->parameters()`). Parameters of a model with sharded gradients must be all of that
  /// model's. Collective on sync steps.
  double clip_grad_norm_(const std::vector<torch::Tensor>& parameters, double max_norm,
                         double norm_type = 2.0);
  /// The gradient norm before clipping that the backend's own clipping (deepspeed_config's
  /// gradient_clipping) measured at the last synchronising backward, over the models it clipped (the square
  /// root of the sum of their squared norms): DeepSpeed's `engine.get_global_grad_norm()`, which Hugging
  /// Face's Trainer logs as grad_norm under DeepSpeed. -1 while the backend has clipped nothing (no
  /// configured clipping: clip_grad_norm_ returns the norm instead).
  double global_grad_norm() const noexcept { return configured_grad_norm_; }

  /// RAII scope of one batch, as Accelerate's `with accelerator.accumulate(model):` — every `backward` in it
  /// belongs to one micro-step. Needed only when the loop feeds batches without a prepared data loader and
  /// calls `backward` more than once per batch with gradient accumulation.
  class Accumulate {
   public:
    Accumulate(Accumulate&& o) noexcept : acc_(o.acc_) { o.acc_ = nullptr; }
    ~Accumulate();
    Accumulate(const Accumulate&) = delete;
    Accumulate& operator=(const Accumulate&) = delete;
    Accumulate& operator=(Accumulate&&) = delete;

   private:
    friend class Accelerator;
    explicit Accumulate(Accelerator* acc);
    Accelerator* acc_;
  };
  /// `auto batch = accelerator.accumulate(model);` at the top of the loop body. The models are accepted for
  /// Accelerate's spelling; the micro-step is the same for all of them.
  template <class... Ms>
  [[nodiscard]] Accumulate accumulate(Ms&... models) {
    (model_index(as_module(models)), ...);  // each must be prepared
    return Accumulate(this);
  }

  /// RAII scope of LibTorch's profiler (Kineto) on this rank, as Accelerate's `with accelerator.profile():`.
  /// Operators, autograd and the regions you mark with ATen's `RECORD_FUNCTION("name", {})` are recorded;
  /// the trace is written when the scope ends (or at `stop()`). One profiler per process at a time.
  class Profile {
   public:
    Profile(Profile&& o) noexcept : path_(std::move(o.path_)), active_(o.active_) { o.active_ = false; }
    ~Profile();
    Profile(const Profile&) = delete;
    Profile& operator=(const Profile&) = delete;
    Profile& operator=(Profile&&) = delete;
    /// Stops recording and writes the trace; returns its path. Later calls return the path again.
    std::string stop();
    /// The file the trace goes to.
    const std::string& path() const noexcept { return path_; }

   private:
    friend class Accelerator;
    Profile(const ProfileOptions& options, int rank, bool cuda);
    std::string path_;
    bool active_ = false;
  };
  /// `{ auto prof = accelerator.profile(ProfileOptions{"traces"}); train_steps(); }` writes
  /// `traces/trace_rank_<rank>.json` on every rank. Not collective.
  [[nodiscard]] Profile profile(const ProfileOptions& options = {});

  /// RAII scope in which `backward` does not synchronise `model`'s gradients (they accumulate locally), as
  /// Accelerate's / PyTorch DDP's `no_sync`. Other models synchronise as usual.
  class NoSync {
   public:
    NoSync(NoSync&& o) noexcept : acc_(o.acc_), index_(o.index_) { o.acc_ = nullptr; }
    ~NoSync();
    NoSync(const NoSync&) = delete;
    NoSync& operator=(const NoSync&) = delete;
    NoSync& operator=(NoSync&&) = delete;

   private:
    friend class Accelerator;
    NoSync(Accelerator* acc, std::size_t index);
    Accelerator* acc_;
    std::size_t index_;
  };
  template <class M>
  [[nodiscard]] NoSync no_sync(M& model) {
    return NoSync(this, model_index(as_module(model)));
  }
  /// Refreshes the models' parameters from the sharded copies the optimizers updated (ZeRO / FSDP backends;
  /// a no-op otherwise). Never required: the backends refresh before the next operator reads a parameter, and
  /// prepared loaders, `wait_for_everyone`, `get_state_dict` and `save_state` refresh too. Collective.
  void sync_parameters();
  /// Bytes of parameters, gradients and optimizer state this rank holds now, measured by walking the tensors
  /// of the prepared models and optimizers (shared storages counted once). Not collective.
  MemoryReport memory_report() const;
  /// Optimizer steps taken so far: sync micro-steps (batches) in which at least one optimizer's step was not
  /// skipped, counted once per batch however many `backward` calls it makes (a GAN's two count one).
  std::int64_t completed_steps() const noexcept { return clock_.completed_steps(); }
  /// Micro-steps (batches that ran a backward) so far.
  std::int64_t micro_steps() const noexcept { return clock_.micro_steps(); }
  /// The fp16 loss scaler (nullptr unless mixed_precision is fp16).
  GradScaler* scaler() noexcept { return scaler_.get(); }

  // ---- collectives ---------------------------------------------------------------------------------------
  /// Concatenates `t` from every rank along dim 0, in rank order (identity on one process). Ranks may hold
  /// different sizes along dim 0 (the rest of the shape must agree). A 0-d tensor counts as one row.
  /// Collective.
  torch::Tensor gather(const torch::Tensor& t);
  /// As gather, but at the end of an evaluation loop drops the samples that `even_batches` duplicated to
  /// complete the last round, so a dataset of 22 samples yields exactly 22 rows. Collective.
  torch::Tensor gather_for_metrics(const torch::Tensor& t);
  /// Element-wise reduction over ranks of a copy of `t`: sum, mean or max (identity on one process).
  /// Collective.
  torch::Tensor reduce(const torch::Tensor& t, ReduceOp op = ReduceOp::Sum);
  /// Rank `from`'s `t`, on every rank (shapes must agree). Collective.
  torch::Tensor broadcast(const torch::Tensor& t, int from = 0);
  /// Pads `t` along `dim` with `pad_index` to the largest size over ranks (at the end, or the start with
  /// `pad_first`), so that it can be gathered. Collective.
  torch::Tensor pad_across_processes(const torch::Tensor& t, std::int64_t dim = 0, double pad_index = 0,
                                     bool pad_first = false);
  /// Blocks until every rank reaches this point, after bringing every model's parameters up to date (so the
  /// main process may then `torch::save` a ZeRO stage 1-2 model on its own). Collective.
  void wait_for_everyone();

  // ---- objects and control ----------------------------------------------------------------------------
  /// Every rank's `object`, in rank order. Objects are encoded by `ObjectCodec<T>` (strings, numbers,
  /// vectors, pairs, maps; archive-serialisable types with `<accel/checkpoint/objects_archive.hpp>`; your own
  /// by specialising it) and go through the rendezvous store, so they suit small objects (metrics, file
  /// names, predictions as text); tensors belong in `gather`. Collective.
  template <class T>
  std::vector<T> gather_object(const T& object) {
    std::string bytes;
    encode_object(bytes, object);
    std::vector<T> out;
    for (const std::string& theirs : exchange_bytes(bytes)) {
      std::string_view in(theirs);
      out.push_back(decode_object<T>(in));
    }
    return out;
  }
  /// Every rank's list concatenated in rank order, as Accelerate's `gather_object` of a list. Collective.
  template <class T>
  std::vector<T> gather_object(const std::vector<T>& objects) {
    std::vector<T> out;
    for (auto& part : gather_object<std::vector<T>>(objects)) {
      for (auto& item : part)
        out.push_back(std::move(item));
    }
    return out;
  }
  /// Replaces `objects` on every rank with rank `from`'s, as Accelerate's `broadcast_object_list`.
  /// Collective.
  template <class T>
  void broadcast_object_list(std::vector<T>& objects, int from = 0) {
    check_rank(from, "broadcast_object_list");
    std::string bytes;
    if (state_.rank == from) encode_object(bytes, objects);
    const std::string theirs =
        exchange_bytes(state_.rank == from ? bytes : std::string()).at(static_cast<std::size_t>(from));
    std::string_view in(theirs);
    objects = decode_object<std::vector<T>>(in);
  }
  /// Asks every rank to stop (early stopping decided on one rank): the next `check_trigger()` returns true
  /// on every rank. Not collective.
  void set_trigger() noexcept { trigger_ = true; }
  /// Whether any rank called `set_trigger()` since the last check (which this one resets). Collective: one
  /// all-reduce of one number.
  bool check_trigger();
  /// Runs `f` on the main process only. Not collective.
  template <class F>
  void on_main_process(F&& f) {
    if (is_main_process()) std::forward<F>(f)();
  }
  /// Runs `f` on the first process of each machine only. Not collective.
  template <class F>
  void on_local_main_process(F&& f) {
    if (is_local_main_process()) std::forward<F>(f)();
  }
  /// Runs `f` on process `index` only. Not collective.
  template <class F>
  void on_process(int index, F&& f) {
    check_rank(index, "on_process");
    if (state_.rank == index) std::forward<F>(f)();
  }

  /// This rank's contiguous share of `items` (the first `size % N` ranks get one more); with `apply_padding`
  /// every share is as long as the longest, padded with the last item. Not collective.
  template <class T>
  std::vector<T> split_between_processes(const std::vector<T>& items, bool apply_padding = false) const {
    const auto [begin, end, longest] = split_range(items.size());
    std::vector<T> out(items.begin() + static_cast<std::ptrdiff_t>(begin),
                       items.begin() + static_cast<std::ptrdiff_t>(end));
    while (apply_padding && !items.empty() && out.size() < longest)
      out.push_back(items.back());
    return out;
  }
  /// This rank's share of `t` along dim 0, as split_between_processes on a vector.
  torch::Tensor split_between_processes(const torch::Tensor& t, bool apply_padding = false) const;

  /// RAII guard: the main process runs the guarded block first, the others after it left (e.g. to download or
  /// preprocess once). Collective: every rank must create and destroy one. `local` uses the local main
  /// process.
  class MainProcessFirst {
   public:
    MainProcessFirst(MainProcessFirst&& o) noexcept : acc_(o.acc_), main_(o.main_) { o.acc_ = nullptr; }
    ~MainProcessFirst() noexcept(false);
    MainProcessFirst(const MainProcessFirst&) = delete;
    MainProcessFirst& operator=(const MainProcessFirst&) = delete;
    MainProcessFirst& operator=(MainProcessFirst&&) = delete;

   private:
    friend class Accelerator;
    MainProcessFirst(Accelerator* acc, bool main);
    Accelerator* acc_;
    bool main_;
  };
  [[nodiscard]] MainProcessFirst main_process_first();
  [[nodiscard]] MainProcessFirst local_main_process_first();
  /// The process-group wrapper (byte counters, raw collectives).
  Communicator& communicator() noexcept { return *groups_.job; }
  /// This rank's tensor-parallel group (AcceleratorOptions::tensor_parallel_size; a group of one without).
  std::shared_ptr<Communicator> tensor_parallel_group() const { return groups_.tensor; }
  /// This rank's sequence-parallel group: the `parallelism_config_sp_size` (DeepSpeed Ulysses) or
  /// `parallelism_config_cp_size` (context parallelism) consecutive ranks that read the same batch, each
  /// keeping its part of the positions (accel::llm::enable_sequence_parallel and shard_sequence); a group
  /// of one without. Its ranks replicate the model: the engines reduce gradients over every rank, while
  /// prepared loaders shard the data over data_parallel_group() (one rank of each group).
  std::shared_ptr<Communicator> sequence_parallel_group() const { return groups_.sequence; }
  /// The ranks that hold the same part of the model as this one (every rank without tensor or pipeline
  /// parallelism): the backends reduce gradients over it and prepared loaders shard the data over it.
  std::shared_ptr<Communicator> data_parallel_group() const { return groups_.data; }

  // ---- utilities ------------------------------------------------------------------------------------------
  /// Streams the arguments followed by a newline to stdout, on the main process only.
  template <class... Args>
  void print(const Args&... args) const {
    if (!is_main_process()) return;
    std::ostringstream os;
    (os << ... << args);
    os << '\n';
    std::cout << os.str() << std::flush;
  }
  /// Seeds LibTorch's CPU and CUDA generators (with `seed + rank` when `device_specific`) and becomes the
  /// default shuffling seed of loaders prepared afterwards.
  void set_seed(std::uint64_t seed, bool device_specific = false);

  // ---- checkpoints ----------------------------------------------------------------------------------------
  /// Saves model (safetensors), optimizers, schedulers, scaler, RNG states, step counters and data-loader
  /// positions into `dir`, atomically: a crash while saving leaves the previous checkpoint at `dir` intact.
  /// `dir` must be new, empty or an earlier checkpoint: a file, or a directory holding other files (logs, an
  /// export), is refused with CheckpointError and left as it was. Collective.
  void save_state(const std::string& dir);
  /// Restores everything save_state wrote; training then continues exactly as if never stopped. Objects must
  /// have been prepared in the same order as when saving. A checkpoint saved by another number of processes
  /// or another backend is converted (the whole model is in model.safetensors, the optimizer state per
  /// parameter in optimizer_full.safetensors for LibTorch's Adam, AdamW, SGD, RMSprop and Adagrad; loader
  /// positions continue after the same number of samples); otherwise it is refused with a message saying
  /// why. Collective.
  void load_state(const std::string& dir);
  /// With `ProjectConfiguration::automatic_checkpoint_naming`: saves into
  /// `<project_dir>/checkpoints/checkpoint_<iteration>` (which must not exist), advances the iteration, then
  /// deletes the oldest automatic checkpoints beyond `total_limit`. Returns the directory written. UsageError
  /// without automatic naming. Collective.
  std::string save_state();
  /// With automatic naming: loads the newest complete checkpoint of `<project_dir>/checkpoints` (one whose
  /// save was interrupted, by a crash or a killed rank, is never picked) and continues the numbering after
  /// it. Returns its directory. CheckpointError when there is none. Collective.
  std::string load_state();
  /// The project configuration (its `iteration` advances with each automatic save).
  const ProjectConfiguration& project_configuration() const noexcept { return checkpointing_.project; }

  /// Saves and restores `object` with every checkpoint, as Accelerate's `register_for_checkpointing`: a
  /// module that is not prepared (an EMA copy), or anything with `save(torch::serialize::OutputArchive&)`
  /// and `load(torch::serialize::InputArchive&)` members. The main process writes
  /// `custom_checkpoint_<i>.pt`; every process loads it. Register the same objects in the same order before
  /// loading. The object must outlive the accelerator.
  template <class T>
  void register_for_checkpointing(T& object) {
    if constexpr (is_module_pointer<T>::value) {
      register_for_checkpointing([&object](torch::serialize::OutputArchive& a) { object->save(a); },
                                 [&object](torch::serialize::InputArchive& a) { object->load(a); });
    } else {
      register_for_checkpointing([&object](torch::serialize::OutputArchive& a) { object.save(a); },
                                 [&object](torch::serialize::InputArchive& a) { object.load(a); });
    }
  }
  /// The same with a pair of functions (a best metric, a step counter, ...):
  /// \code
  ///   acc.register_for_checkpointing(
  ///       [&](auto& a) { a.write("best", torch::tensor(best)); },
  ///       [&](auto& a) { torch::Tensor t; a.read("best", t); best = t.item<double>(); });
  /// \endcode
  void register_for_checkpointing(std::function<void(torch::serialize::OutputArchive&)> save,
                                  std::function<void(torch::serialize::InputArchive&)> load);
  /// Called on every process with the (temporary) checkpoint directory before save_state writes into it;
  /// files the hook writes there (on the main process, say) are committed with the checkpoint.
  void register_save_state_pre_hook(std::function<void(const std::string& dir)> hook);
  /// Called on every process with the checkpoint directory before load_state reads it.
  void register_load_state_pre_hook(std::function<void(const std::string& dir)> hook);
  /// For a run that trains part of a model (LoRA adapters on a frozen base): save_state then writes, of each
  /// prepared model, only the parameters that require grad (the model files say so in their metadata), so a
  /// 7B base is not rewritten at every save; load_state of such a checkpoint restores those and keeps the
  /// rest of each model as the program built it (the same base must be loaded before resuming). Optimizer,
  /// scheduler, RNG and loader state are saved as always. Not with a pipeline (refused by save_state). Set it
  /// alike on every rank.
  void set_checkpoint_trainable_only(bool on = true) noexcept { checkpointing_.trainable_only = on; }
  bool checkpoint_trainable_only() const noexcept { return checkpointing_.trainable_only; }

  /// A progress bar drawn by the main process only (progress.hpp): on a terminal, or as a line every few
  /// seconds under accel-launch on a terminal; silent when output goes to a file or pipe.
  /// `auto bar = accelerator.progress_bar(loader->size(), "epoch 1", "batches"); ... bar.update();`
  ProgressBar progress_bar(std::size_t total, std::string description = "", std::string unit = "it") const {
    ProgressOptions o;
    o.description = std::move(description);
    o.unit = std::move(unit);
    o.rank = state_.rank;
    return ProgressBar(total, std::move(o));
  }

  // --- Experiment tracking (tracking.hpp), as Accelerate's ---------------------------------------------
  /// Starts the trackers of `log_with` (and the program's own) on the main process, writing into
  /// `<project_dir>/<project_name>` (project_dir "" is the working directory), and gives each the run
  /// configuration: `acc.init_trackers("mnist", {{"lr", 1e-3}, {"epochs", 3}, {"model", "mlp"}});`.
  void init_trackers(const std::string& project_name, const TrackerConfig& config = {});
  /// Logs named scalars at `step` (default: completed_steps(), the optimizer steps so far) on the main
  /// process: `acc.log({{"loss", loss}, {"lr", lr}});`. Does nothing when no tracker is configured; throws
  /// UsageError when trackers are configured but init_trackers was not called. Call it on every rank.
  void log(const TrackerValues& values, std::optional<std::int64_t> step = std::nullopt);
  /// The started tracker of that name on the main process; nullptr on the other ranks or if none.
  Tracker* get_tracker(const std::string& name) const;
  /// Flushes and closes the trackers, then waits for every rank (Accelerate's end_training). Collective.
  void end_training();
  /// Releases everything `prepare` took over, as Accelerate's `free_memory()`: each model is handed back as a
  /// plain, whole, current LibTorch module (sharded backends gather it; its optimizer no longer steps it),
  /// loaders stop refreshing parameters, the step counters start again. The backend-agnostic end of a
  /// training program: `accelerator.free_memory(); if (accelerator.is_main_process()) torch::save(model,
  /// "model.pt");` works on every backend.
  /// Objects can be prepared again afterwards. Collective.
  void free_memory();

 private:
  static const char* const kPipelineLoaderMessage;
  pipeline::PipelineEngine& pipeline_engine(const char* what);
  // The mean of `value` over the data-parallel replicas (collective over them).
  double replica_mean(double value);
  pipeline::PipelineStage& prepare_pipeline_stage(
      const std::function<std::unique_ptr<pipeline::PipelineStage>(int stage, int stages)>& make_stage);
  // Statistics of every SyncBatchNorm in `model` over the ranks of `comm` (nullptr: this process only).
  static void connect_sync_batchnorm(torch::nn::Module& model, Communicator* comm);
  // UnsupportedOperation when the backend shards gradients or parameters (pipeline_config.stages > 1).
  void refuse_sharding_with_pipeline() const;
  std::vector<std::string> exchange_bytes(const std::string& mine);
  torch::Tensor gather_over(Communicator& comm, const torch::Tensor& t);
  void check_rank(int index, const char* what) const;

  // A module holder (Mlp, torch::nn::Linear) or a std::shared_ptr to a module.
  template <class T, class = void>
  struct is_module_pointer : std::false_type {};
  template <class T>
  struct is_module_pointer<T, std::void_t<decltype(std::declval<T&>().operator->())>>
      : std::is_base_of<torch::nn::Module, std::remove_pointer_t<decltype(std::declval<T&>().operator->())>> {
  };

  template <class T>
  static std::shared_ptr<torch::nn::Module> as_module(torch::nn::ModuleHolder<T>& model) {
    return model.ptr();
  }
  template <class T, class = std::enable_if_t<std::is_base_of_v<torch::nn::Module, T>>>
  static std::shared_ptr<torch::nn::Module> as_module(std::shared_ptr<T>& model) {
    return model;
  }
  template <class T>
  void prepare_model_pass(torch::nn::ModuleHolder<T>& model) {
    prepare_model(model.ptr());
  }
  template <class T, class = std::enable_if_t<std::is_base_of_v<torch::nn::Module, T>>>
  void prepare_model_pass(std::shared_ptr<T>& model) {
    prepare_model(model);
  }
  void prepare_model_pass(torch::optim::Optimizer&) {}
  void prepare_model_pass(torch::optim::LRScheduler&) {}
  template <class T>
  void prepare_optimizer_pass(T& object) {
    if constexpr (std::is_base_of_v<torch::optim::Optimizer, T>) prepare_optimizer(object);
  }
  template <class T>
  void prepare_scheduler_pass(T& object) {
    if constexpr (std::is_base_of_v<torch::optim::LRScheduler, T>) prepare_scheduler(object);
  }

  std::size_t model_index(const std::shared_ptr<torch::nn::Module>& model) const;
  NamedTensors model_state(std::size_t index);
  NamedTensors main_process_state(std::size_t index);
  ModelExport save_model_at(std::size_t index, const std::string& dir, const std::string& max_shard_size);
  void load_model_at(std::size_t index, const std::string& dir);
  void begin_backward();
  void unscale_and_check();
  // Clips to the backend's configured norm (automatic_gradient_clipping) after a sync backward, keeping the
  // norm before clipping in configured_grad_norm_.
  void clip_configured_gradients();
  void rescale_gradients();
  std::vector<std::size_t> engines_for(const std::vector<torch::Tensor>& parameters,
                                       std::vector<torch::Tensor>& loose) const;
  void prepare_model(std::shared_ptr<torch::nn::Module> model);
  void enable_activation_checkpointing(torch::nn::Module& model);
  std::shared_ptr<void> watch_backward(const torch::nn::Module& model) const;
  /// Prints `notice` on the main process and keeps it in notices(), once.
  void add_notice(std::string notice);
  void prepare_optimizer(torch::optim::Optimizer& optimizer);
  void prepare_scheduler(torch::optim::LRScheduler& scheduler);
  void complete_loader_options(DataLoaderOptions& options) const;
  std::shared_ptr<detail::LoaderState> register_loader();
  bool end_of_data() const;
  std::vector<torch::Tensor> optimizer_params() const;
  void stash_gradients();
  void restore_gradients();
  void enable_autocast();
  /// The prepared objects lent to the state I/O part (state_io.hpp) for one save_state or load_state.
  detail::StateParts state_parts();
  struct SplitRange {
    std::size_t begin, end, longest;
  };
  SplitRange split_range(std::size_t n) const;
  detail::LoaderState* active_loader() const;
  void setup_tensor_parallel(int size);
  void setup_sequence_parallel(int size);

  // What the facade delegates to, one member per concern. Order matters for destruction: the process groups
  // outlive the engines, which communicate while destroyed.
  Config config_;
  ProcessState state_;
  torch::Device device_ = torch::kCPU;
  detail::ProcessGroups groups_;
  detail::BackendChoice backend_;
  std::unique_ptr<GradScaler> scaler_;  // fp16 only
  detail::PipelineRunner pipeline_;
  detail::PreparedObjects prepared_;
  GradientState clock_;
  detail::CheckpointRegistry checkpointing_;
  detail::TrackerSet trackers_;
  detail::AutocastState autocast_;
  std::vector<std::string> notices_;
  std::optional<std::uint64_t> seed_;  // the default shuffling seed of loaders prepared later
  bool trigger_ = false;               // set_trigger() since the last check_trigger()
  double configured_grad_norm_ = -1;   // global_grad_norm()
};

}  // namespace accel
