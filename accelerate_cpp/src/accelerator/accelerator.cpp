#include <accel/accelerator/accelerator.hpp>
#include <accel/accelerator/resolved_config.hpp>
#include <accel/backend/grad_ready_hooks.hpp>
#include <accel/distributed/cuda_device.hpp>
#include <accel/distributed/env_contract.hpp>
#include <accel/nn/activation_checkpoint.hpp>
#include <accel/nn/sync_batchnorm.hpp>
#include <accel/optim/optim.hpp>
#include <accel/optim/schedulers.hpp>
#include <accel/parallel/pipeline.hpp>
#include <accel/parallel/tensor_parallel.hpp>

#include <ATen/autocast_mode.h>
#include <fmt/format.h>
#include <torch/autograd.h>
#include <torch/cuda.h>
#include <torch/utils.h>

#include "accelerator/move_module.hpp"
#include "checkpoint/model_export.hpp"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <optional>

namespace accel {
namespace {

// With a pipeline cut from a whole Sequential: the layers other stages trained, given their current values
// on this rank (`whole_model` is the whole model's state; collective over the stages), so that torch::save
// of the Sequential writes the trained model and reading it no longer throws.
void restore_whole_model(detail::PipelineRunner& pipeline, const std::function<NamedTensors()>& whole_model) {
  if (!pipeline.stage || !pipeline.engine || !pipeline.stage->cut_from_model()) return;
  const auto whole = whole_model();
  pipeline.stage->restore_foreign(std::map<std::string, torch::Tensor>(whole.begin(), whole.end()));
}

Config resolve_config(const AcceleratorOptions& o) {
  Config config;
  if (o.config()) {
    config = *o.config();
  } else if (o.config_file()) {
    config = Config::load_file(*o.config_file());
  } else if (const char* path = std::getenv(env::kConfigFile); path != nullptr && *path != '\0') {
    // Under accel-launch the file is the launcher's resolved copy; messages name the user's file too.
    const char* source = std::getenv(env::kConfigSource);
    try {
      config = Config::load_file(path);
    } catch (const ConfigError& e) {
      if (source == nullptr || *source == '\0') throw;
      // The user's file first: "<copy>:<line>: <body>" becomes "<source>: <body> (at <copy>:<line>, ...)".
      std::string body = e.what(), at = path;
      const std::string copy = std::string(path) + ":";
      if (body.rfind(copy, 0) == 0) {
        const auto end = body.find(": ", copy.size() - 1);
        if (end != std::string::npos) {
          at = body.substr(0, end);
          body = body.substr(end + 2);
        }
      }
      throw ConfigError(fmt::format("{}: {} (at {}, accel-launch's resolved copy of {} with its command-line "
                                    "options applied: fix {} or the options)",
                                    source, body, at, source, source),
                        source, 0, e.key());
    }
    if (source != nullptr && *source != '\0') config.source = source;
  }
  if (o.mixed_precision()) config.mixed_precision = *o.mixed_precision();
  if (o.gradient_accumulation_steps()) config.gradient_accumulation_steps = *o.gradient_accumulation_steps();
  if (o.cpu()) config.use_cpu = *o.cpu();
  config.validate();
  return config;
}

bool env_flag(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr) return false;
  const std::string s(v);
  return s == "1" || s == "true" || s == "TRUE" || s == "yes";
}

// Collective timeout: ACCEL_COLLECTIVE_TIMEOUT (seconds) overrides the config's collective_timeout_seconds.
double timeout_seconds(const Config& config) {
  const char* v = std::getenv(env::kCollectiveTimeout);
  if (v == nullptr || *v == '\0') return config.collective_timeout_seconds;
  char* end = nullptr;
  const double x = std::strtod(v, &end);
  if (*end != '\0' || !(x > 0)) {
    throw ConfigError(
        fmt::format("environment variable ACCEL_COLLECTIVE_TIMEOUT='{}' is not a positive number of seconds",
                    v),
        {}, 0, "ACCEL_COLLECTIVE_TIMEOUT");
  }
  // The config key's bounds, checked where they are written once (Config::validate).
  Config probe = config;
  probe.collective_timeout_seconds = x;
  try {
    probe.validate();
  } catch (const ConfigError& e) {
    throw ConfigError(fmt::format("environment variable ACCEL_COLLECTIVE_TIMEOUT='{}': {}", v, e.what()), {},
                      0, "ACCEL_COLLECTIVE_TIMEOUT");
  }
  return x;
}

std::shared_ptr<const BackendRegistry> builtin_registry() {
  auto registry = std::make_shared<BackendRegistry>();
  register_builtin_backends(*registry);
  return registry;
}

// The program's AcceleratorOptions().tensor_parallel_size or the config's parallelism_config_tp_size; both
// set (not 1) must agree.
int chosen_tensor_parallel_size(int from_program, const Config& config) {
  if (from_program == 1 || config.tensor_parallel_size == 1 || from_program == config.tensor_parallel_size)
    return from_program != 1 ? from_program : config.tensor_parallel_size;
  throw UsageError(fmt::format(
      "AcceleratorOptions().tensor_parallel_size({}) and the config's "
      "parallelism_config.parallelism_config_tp_size {}{} disagree: the program's layers are split for one "
      "of "
      "them; make them equal, or remove one (the program's is enough)",
      from_program, config.tensor_parallel_size, config.source.empty() ? "" : " (" + config.source + ")"));
}

}  // namespace

Config resolved_config(const AcceleratorOptions& options) {
  return resolve_config(options);
}

void Accelerator::setup_tensor_parallel(int size) {
  if (size < 1 || state_.world_size % size != 0) {
    throw UsageError(fmt::format(
        "tensor_parallel_size {} does not divide the {} process(es): each tensor-parallel group holds "
        "tensor_parallel_size ranks; run a multiple of {} processes or choose a divisor of {}",
        size, state_.world_size, size, state_.world_size));
  }
  const int stages = std::max(1, config_.pipeline.stages);
  if (state_.world_size % (size * stages) != 0) {
    throw UsageError(fmt::format(
        "tensor_parallel_size {} with pipeline_config.stages {} needs a multiple of {} processes (every "
        "stage of every data-parallel replica is a tensor-parallel group), but {} run; run {} x k processes",
        size, stages, size * stages, state_.world_size, size * stages));
  }
  // Rank = (stage x replicas + replica) x size + tp rank: a group's ranks are neighbours (one machine: the
  // layers' all-reduces run every forward and backward); the ranks holding the same slices form the
  // data-parallel groups (prepare_pipeline narrows them to the ranks of one stage).
  const int groups = state_.world_size / size;
  std::vector<std::vector<int>> tp(static_cast<std::size_t>(groups)), data(static_cast<std::size_t>(size));
  for (int r = 0; r < state_.world_size; ++r) {
    tp[static_cast<std::size_t>(r / size)].push_back(r);
    data[static_cast<std::size_t>(r % size)].push_back(r);
  }
  groups_.tensor = groups_.job->split(tp);
  groups_.data = groups_.job->split(data);
}

void Accelerator::setup_sequence_parallel(int size) {
  const char* key =
      config_.sequence_parallel_size > 1 ? "parallelism_config_sp_size" : "parallelism_config_cp_size";
  const std::string source = config_.source.empty() ? "" : " (" + config_.source + ")";
  if (config_.sequence_parallel_size > 1 && config_.context_parallel_size > 1) {
    throw UsageError(
        fmt::format("parallelism_config_sp_size {} and parallelism_config_cp_size {}{}: sequence and "
                    "context parallelism are mutually exclusive (as in Accelerate); set one to 1",
                    config_.sequence_parallel_size, config_.context_parallel_size, source));
  }
  if (size < 1 || state_.world_size % size != 0) {
    throw UsageError(
        fmt::format("{} {}{} does not divide the {} process(es): each group holds {} consecutive "
                    "ranks; run a multiple of {} processes",
                    key, size, source, state_.world_size, size, size));
  }
  if (groups_.tensor->world_size() > 1 || config_.pipeline.stages > 1) {
    throw UsageError(
        fmt::format("{} {}{}: sequence or context parallelism with tensor parallelism or a pipeline "
                    "is not supported by accelerate-cpp; set {}: 1, or tp_size 1 and no "
                    "pipeline_config",
                    key, size, source, key));
  }
  // Rank = replica x size + sequence rank: a group's ranks are neighbours (their all-to-alls run in every
  // attention); the ranks of the same sequence rank read different batches (the loaders' groups).
  const int groups = state_.world_size / size;
  std::vector<std::vector<int>> seq(static_cast<std::size_t>(groups)), data(static_cast<std::size_t>(size));
  for (int r = 0; r < state_.world_size; ++r) {
    seq[static_cast<std::size_t>(r / size)].push_back(r);
    data[static_cast<std::size_t>(r % size)].push_back(r);
  }
  groups_.sequence = groups_.job->split(seq);
  groups_.data = groups_.job->split(data);
}

void Accelerator::connect_sync_batchnorm(torch::nn::Module& model, Communicator* comm) {
  for (const auto& m : model.modules()) {
    torch::nn::Module* layer = m.get();
    // A layer wrapped by activation checkpointing (accel::Checkpointed) is not a registered child.
    while (auto* ck = dynamic_cast<CheckpointedImpl*>(layer))
      layer = ck->module().get();
    if (auto* bn = dynamic_cast<nn::SyncBatchNormImpl*>(layer)) bn->set_communicator(comm);
  }
}

Accelerator::Accelerator() : Accelerator(AcceleratorOptions{}) {}

Accelerator::Accelerator(AcceleratorOptions options)
    : config_(resolve_config(options)), clock_(config_.gradient_accumulation_steps) {
  state_ = options.process_state() ? *options.process_state() : ProcessState::from_environment();
  checkpointing_.project = options.project_config();
  trackers_.names = parse_log_with(options.log_with() ? *options.log_with() : config_.log_with);
  trackers_.custom = options.trackers();
  if (checkpointing_.project.total_limit < 0 || checkpointing_.project.iteration < 0) {
    throw UsageError(
        fmt::format("ProjectConfiguration: total_limit ({}) and iteration ({}) must not be negative "
                    "(total_limit 0 keeps every checkpoint)",
                    checkpointing_.project.total_limit, checkpointing_.project.iteration));
  }
  CommunicatorOptions comm_options;
  if (const char* group = std::getenv(env::kCudaCollectives); group != nullptr && *group != '\0')
    comm_options.cuda_collectives = parse_cuda_collectives(group, env::kCudaCollectives);
  if (!config_.use_cpu && torch::cuda::is_available()) {
    device_ = torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(cuda_device_for(
                                              state_, static_cast<int>(torch::cuda::device_count()),
                                              comm_options.cuda_collectives == CudaCollectives::Gloo)));
  }
  // Kineto (accelerator.profile) looks for GPUs even for a CPU-only trace and logs "gpuGetDeviceCount failed"
  // as an ERROR on machines without one: on CPU its logging is off unless the user set KINETO_LOG_LEVEL. Set
  // here, before the process group starts threads that could read the environment meanwhile.
  if (device_.is_cpu()) ::setenv("KINETO_LOG_LEVEL", "5", /*overwrite=*/0);
  comm_options.timeout =
      std::chrono::milliseconds(static_cast<std::int64_t>(timeout_seconds(config_) * 1000));
  comm_options.debug = config_.debug || env_flag(env::kDebug) || env_flag("ACCELERATE_DEBUG_MODE");
  if (const char* algorithm = std::getenv(env::kCpuCollectives); algorithm != nullptr && *algorithm != '\0')
    comm_options.cpu_collectives = parse_cpu_collectives(algorithm, env::kCpuCollectives);
  groups_.job = Communicator::create(state_, device_, comm_options);
  if (config_.seed) set_seed(*config_.seed);
  config_.num_processes = state_.world_size;
  backend_.registry = options.registry() ? options.registry() : builtin_registry();
  // A single-process backend launched on several ranks resolves to its multi-process replacement.
  backend_.descriptor = &backend_.registry->resolve(config_.backend, state_.world_size);
  config_.backend = backend_.descriptor->name;
  groups_.data = groups_.job;
  groups_.tensor = Communicator::create(ProcessState{}, device_, comm_options);  // a group of one
  if (const int size = chosen_tensor_parallel_size(options.tensor_parallel_size(), config_); size != 1)
    setup_tensor_parallel(size);
  groups_.sequence = Communicator::create(ProcessState{}, device_, comm_options);  // a group of one
  if (const int size = std::max(config_.sequence_parallel_size, config_.context_parallel_size); size != 1)
    setup_sequence_parallel(size);
  backend_.context.config = &config_;
  backend_.context.device = device_;
  // The engines of prepare(model) reduce over these replicas for the Accelerator's life (prepare_pipeline
  // narrows groups_.data to the stage's replicas; engines made before keep theirs alive here).
  // Under sequence parallelism the ranks of a group hold the same parameters with gradients of different
  // positions: the engines reduce over every rank (as DeepSpeed's ZeRO over its sequence-data-parallel
  // group), while the loaders shard over groups_.data (one rank per sequence-parallel group).
  groups_.replicas = groups_.sequence->world_size() > 1 ? groups_.job : groups_.data;
  backend_.context.rank = groups_.replicas->rank();
  backend_.context.world_size = groups_.replicas->world_size();
  backend_.context.comm = groups_.replicas.get();
  if (config_.mixed_precision == MixedPrecision::Fp16) {
    // The backend's peer decides the policy: PyTorch's GradScaler, or DeepSpeed's loss scaler under zero.
    const LossScaling policy = loss_scaling_of(config_);
    scaler_ = std::make_unique<GradScaler>(GradScalerOptions()
                                               .dynamic(policy.dynamic)
                                               .init_scale(policy.init_scale)
                                               .growth_factor(policy.growth_factor)
                                               .backoff_factor(policy.backoff_factor)
                                               .growth_interval(policy.growth_interval)
                                               .deepspeed_schedule(policy.deepspeed_schedule)
                                               .hysteresis(policy.hysteresis)
                                               .consecutive_hysteresis(policy.consecutive_hysteresis)
                                               .min_scale(policy.min_scale),
                                           device_);
  }
  if (config_.pipeline.stages > 1) refuse_sharding_with_pipeline();
  notices_ = config_.notices;  // settings read without effect (a DeepSpeed JSON's optimizer block, ...)
  if (config_.mixed_precision == MixedPrecision::Fp16 && device_.is_cpu()) {
    notices_.push_back(
        "mixed_precision: fp16 on the CPU. Accelerate refuses this (\"fp16 mixed precision requires a "
        "GPU\"); "
        "accelerate-cpp runs it as on a GPU (fp16 autocast with loss scaling), but the CPU computes fp16 "
        "slowly and its results stray further from fp32 than bf16's: on the CPU use mixed_precision: bf16 or "
        "no");
  }
  if (backend_.descriptor->notices) {
    for (auto& n : backend_.descriptor->notices(backend_.context))
      notices_.push_back(std::move(n));
  }
  if (is_main_process()) {
    for (const auto& n : notices_)
      std::cerr << "accelerate-cpp: note: " << n << std::endl;
  }
}

Accelerator::~Accelerator() {
  for (auto& t : trackers_.started) {
    try {
      t->finish();
    } catch (...) {  // a destructor reports nothing; end_training() reports write errors
    }
  }
  // A loader that outlives its accelerator keeps working, without step-boundary parameter refreshes.
  for (auto& l : prepared_.loaders)
    l->on_advance = nullptr;
  // SyncBatchNorm layers outlive the communicator: back to this process's statistics.
  for (auto& m : prepared_.models)
    connect_sync_batchnorm(*m.module, nullptr);
  // The whole pipeline model current on every rank, for torch::save at the end of main (collective, as the
  // sharded engines' gathers on the way out). Not during unwinding, where another rank may never arrive.
  if (std::uncaught_exceptions() == 0) {
    try {
      restore_whole_model(pipeline_, [this] { return model_state(pipeline_.model); });
    } catch (...) {  // the other layers then stay poisoned: reading them says why
    }
  }
  if (autocast_.on) {
    at::autocast::set_autocast_enabled(device_.type(), autocast_.prev_enabled);
    if (autocast_.prev_dtype != c10::ScalarType::Undefined) {
      at::autocast::set_autocast_dtype(device_.type(), autocast_.prev_dtype);
    }
    at::autocast::clear_cache();
  }
}

void Accelerator::free_memory() {
  for (auto& m : prepared_.models)
    m.engine->sync_parameters();  // collective: every rank releases at the same point
  for (auto& l : prepared_.loaders)
    l->on_advance = nullptr;
  for (auto& m : prepared_.models)
    connect_sync_batchnorm(*m.module, nullptr);
  restore_whole_model(pipeline_, [this] { return model_state(pipeline_.model); });
  pipeline_ = detail::PipelineRunner{};
  // The engines go in prepare order; sharded ones gather their model whole on the way out (collective).
  while (!prepared_.models.empty())
    prepared_.models.erase(prepared_.models.begin());
  prepared_ = detail::PreparedObjects{};
  clock_ = GradientState(config_.gradient_accumulation_steps);
  if (groups_.job->world_size() > 1) groups_.job->barrier();
}

NamedTensors Accelerator::get_state_dict() {
  if (prepared_.models.size() != 1) {
    throw UsageError(
        fmt::format("get_state_dict: {} models are prepared; name the one you want: "
                    "accelerator.get_state_dict(model)",
                    prepared_.models.size()));
  }
  return model_state(0);
}

NamedTensors Accelerator::model_state(std::size_t index) {
  auto& engine = *prepared_.models.at(index).engine;
  engine.sync_parameters();
  // The whole model on every rank: tensor-parallel slices gathered, with a pipeline every stage's layers;
  // copies, as the engines hand over their own tensors.
  Communicator* pipe = pipeline_.engine && index == pipeline_.model ? groups_.pipeline.get() : nullptr;
  NamedTensors state;
  detail::visit_whole_model(engine, tp::split_parameters(*prepared_.models.at(index).module), pipe,
                            /*share_stages=*/true, device_, [&](NamedTensors piece) {
                              for (auto& [name, t] : piece)
                                state.emplace_back(name, t.detach().clone());
                            });
  detail::in_model_order(state, *prepared_.models.at(index).module);
  return state;
}

std::size_t Accelerator::model_index(const std::shared_ptr<torch::nn::Module>& model) const {
  for (std::size_t i = 0; i < prepared_.models.size(); ++i) {
    if (prepared_.models[i].module == model) return i;
  }
  throw UsageError(
      "this model was not prepared by this accelerator; call accelerator.prepare(model, ...) first");
}

std::string Accelerator::backend_name() const {
  return backend_.descriptor->name;
}

BackendCapabilities Accelerator::capabilities() const {
  return backend_.descriptor->capabilities(config_);
}

void Accelerator::prepare_model(std::shared_ptr<torch::nn::Module> model) {
  if (!model) throw UsageError("prepare: the model is empty (a null ModuleHolder or shared_ptr)");
  for (const auto& m : prepared_.models) {
    if (m.module == model)
      throw UsageError("prepare: this model was already prepared; prepare each model once");
  }
  // tp_size from a config file, a trainable model without accel::tp layers: every rank of a tensor-parallel
  // group would train a whole copy while gradients are averaged over the data-parallel replicas only, so a
  // program that shards its data by process_index() would let the copies drift apart, silently (Accelerate
  // refuses a model without a tp_plan too).
  if (config_.tensor_parallel_size > 1 && tp::split_parameters(*model).empty()) {
    const auto params = model->parameters();
    if (std::any_of(params.begin(), params.end(), [](const torch::Tensor& p) { return p.requires_grad(); })) {
      throw UsageError(fmt::format(
          "prepare: the config's parallelism_config.parallelism_config_tp_size {}{} asks for tensor "
          "parallelism, but this model has no accel::tp layer (ColumnParallelLinear, RowParallelLinear, "
          "VocabParallelEmbedding, ParallelMultiheadAttention): each rank of a tensor-parallel group would "
          "train a "
          "whole copy. Build its layers on accelerator.tensor_parallel_group(), or set tp_size: 1",
          config_.tensor_parallel_size, config_.source.empty() ? "" : " (" + config_.source + ")"));
    }
  }
  detail::move_module(*model, device_);  // in place, gradients included
  if (backend_.descriptor->activation_checkpointing &&
      backend_.descriptor->activation_checkpointing(config_)) {
    enable_activation_checkpointing(*model);
  }
  detail::PreparedModel prepared{model, backend_.descriptor->factory(backend_.context), 0, nullptr};
  // Before the engine's own hooks, so that a plain backward stops before the engine has seen a gradient.
  prepared.backward_watch = watch_backward(*model);
  prepared.engine->prepare_model(*model);
  if (groups_.replicas->world_size() > 1) connect_sync_batchnorm(*model, groups_.replicas.get());
  prepared_.models.push_back(std::move(prepared));
  enable_autocast();
}

std::shared_ptr<void> Accelerator::watch_backward(const torch::nn::Module& model) const {
  // PyTorch's DistributedDataParallel synchronises on a plain loss.backward() (its reducer hooks the
  // parameters); here the synchronisation, accumulation and loss scaling run in Accelerator::backward. A
  // plain backward on several ranks would leave every replica with its own gradients, silently: stop it at
  // the first gradient instead.
  if (groups_.job->world_size() <= 1) return nullptr;
  auto hooks = std::make_shared<GradReadyHooks>();
  const auto inside = prepared_.in_backward;
  const auto backend = backend_name();
  const int ranks = groups_.job->world_size();
  std::size_t index = 0;
  for (const auto& p : model.parameters()) {
    if (!p.requires_grad()) continue;
    hooks->add(p, index++, [inside, backend, ranks](std::size_t) {
      if (inside->load() > 0) return;
      throw UsageError(fmt::format(
          "backward: a prepared model received gradients from a backward that accelerator.backward() did not "
          "run (a plain loss.backward() kept from a PyTorch DistributedDataParallel loop?); on {} ranks with "
          "the '{}' backend its gradients would not be synchronised and the replicas would drift apart. "
          "Call accelerator.backward(loss) instead: it synchronises, and scales the loss for gradient "
          "accumulation and fp16",
          ranks, backend));
    });
  }
  return hooks;
}

void Accelerator::enable_activation_checkpointing(torch::nn::Module& model) {
  // Without code changes this works where the blocks are Sequentials: the model itself, or its direct
  // children. Parameter names and tensors stay the same (see activation_checkpoint.hpp).
  checkpoint_model_blocks(model, "activation_checkpointing");
}

void Accelerator::prepare_optimizer(torch::optim::Optimizer& optimizer) {
  for (auto* o : prepared_.optimizers) {
    if (o == &optimizer) throw UsageError("prepare: this optimizer was already prepared; prepare it once");
  }
  if (const auto* whole = dynamic_cast<const optim::WholeParameterOptimizer*>(&optimizer);
      whole != nullptr && capabilities().shards_optimizer_state) {
    throw UsageError(fmt::format(
        "prepare: {} updates each parameter from norms over the whole parameter, but the '{}' backend gives "
        "optimizers slices of flattened parameters (optimizer state sharded), which would change the result; "
        "use {} for this optimizer",
        whole->optimizer_name(), backend_name(),
        layouts_where([](const BackendCapabilities& c) { return !c.shards_optimizer_state; })));
  }
  // The optimizer belongs to the model that owns its parameters.
  std::vector<std::size_t> owners;
  for (auto& group : optimizer.param_groups()) {
    for (auto& p : group.params()) {
      std::optional<std::size_t> owner;
      for (std::size_t i = 0; i < prepared_.models.size() && !owner; ++i) {
        for (const auto& q : prepared_.models[i].module->parameters()) {
          if (q.unsafeGetTensorImpl() == p.unsafeGetTensorImpl()) owner = i;
        }
      }
      if (!owner) {
        throw UsageError(
            "prepare: an optimizer holds a tensor that is no parameter of a prepared model; prepare the "
            "model before or together with its optimizer: accelerator.prepare(model, optimizer)");
      }
      if (p.device() != device_) {
        throw UsageError(fmt::format(
            "prepare: an optimizer parameter lives on {} but the accelerator runs on {}; prepare the model "
            "before (or together with) its optimizer: accelerator.prepare(model, optimizer)",
            p.device().str(), device_.str()));
      }
      if (std::find(owners.begin(), owners.end(), *owner) == owners.end()) owners.push_back(*owner);
    }
  }
  if (owners.empty()) throw UsageError("prepare: the optimizer has no parameters");
  if (owners.size() > 1 && capabilities().shards_optimizer_state) {
    throw UsageError(fmt::format(
        "prepare: one optimizer holds parameters of {} prepared models (models {} and {} in prepare order); "
        "the {} backend shards each model's optimizer state separately: make one optimizer per model",
        owners.size(), owners[0], owners[1], backend_name()));
  }
  prepared_.models[owners.front()].engine->prepare_optimizer(optimizer);
  if (backend_.descriptor->optimizer_notices) {
    for (auto& n : backend_.descriptor->optimizer_notices(backend_.context, optimizer))
      add_notice(std::move(n));  // once: a second Adam says nothing new
  }
  prepared_.optimizers.push_back(&optimizer);
  prepared_.optimizer_model.push_back(owners.front());
  prepared_.skipped.push_back(false);
}

void Accelerator::add_notice(std::string notice) {
  if (std::find(notices_.begin(), notices_.end(), notice) != notices_.end()) return;
  if (is_main_process()) std::cerr << "accelerate-cpp: note: " << notice << std::endl;
  notices_.push_back(std::move(notice));
}

void Accelerator::prepare_scheduler(torch::optim::LRScheduler& scheduler) {
  prepared_.schedulers.push_back(&scheduler);
  // accel::sched schedules step once per real optimizer step (as Accelerate's AcceleratedScheduler): not on
  // accumulation micro-steps, not after an fp16-skipped step.
  if (auto* schedule = dynamic_cast<sched::Preparable*>(&scheduler)) {
    schedule->set_step_gate([this] {
      return sync_gradients() &&
             std::none_of(prepared_.skipped.begin(), prepared_.skipped.end(), [](bool s) { return s; });
    });
  }
}

void Accelerator::complete_loader_options(DataLoaderOptions& options) const {
  if (!options.seed()) options.seed(seed_.value_or(0));
  if (!options.even_batches()) options.even_batches(config_.even_batches);
  if (!options.split_batches()) options.split_batches(config_.split_batches);
}

std::shared_ptr<detail::LoaderState> Accelerator::register_loader() {
  prepared_.loaders.push_back(std::make_shared<detail::LoaderState>());
  prepared_.loaders.back()->clock = clock_.batch_clock();
  prepared_.loaders.back()->on_advance = [this] { sync_parameters(); };
  return prepared_.loaders.back();
}

detail::LoaderState* Accelerator::active_loader() const {
  detail::LoaderState* active = nullptr;
  for (const auto& l : prepared_.loaders) {
    if (l->last_yield > 0 && (active == nullptr || l->last_yield > active->last_yield)) active = l.get();
  }
  return active;
}

bool Accelerator::end_of_data() const {
  const auto* l = active_loader();
  return l != nullptr && l->in_epoch && l->at_last_batch;
}

void Accelerator::enable_autocast() {
  if (autocast_.on || config_.mixed_precision == MixedPrecision::No) return;
  // Autocast is thread-local LibTorch state: on for the thread that prepared the model, restored when the
  // accelerator is destroyed. LibTorch's C++ Module::forward cannot be wrapped, so this is what lets a YAML
  // switch alone turn mixed precision on.
  const auto type = device_.type();
  autocast_.prev_enabled = at::autocast::is_autocast_enabled(type);
  autocast_.prev_dtype = at::autocast::get_autocast_dtype(type);
  at::autocast::set_autocast_dtype(
      type, config_.mixed_precision == MixedPrecision::Bf16 ? at::kBFloat16 : at::kHalf);
  at::autocast::set_autocast_enabled(type, true);
  autocast_.on = true;
}

void Accelerator::set_seed(std::uint64_t seed, bool device_specific) {
  const std::uint64_t s = device_specific ? seed + static_cast<std::uint64_t>(state_.rank) : seed;
  torch::manual_seed(s);  // CPU and every CUDA device
  seed_ = seed;
}

}  // namespace accel
