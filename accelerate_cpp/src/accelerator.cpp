#include <accel/accelerator.hpp>
#include <accel/checkpointing.hpp>

#include <ATen/autocast_mode.h>
#include <fmt/format.h>
#include <torch/autograd.h>
#include <torch/cuda.h>
#include <torch/utils.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>

namespace accel {
namespace {

Config resolve_config(const AcceleratorOptions& o) {
  Config config;
  if (o.config_) {
    config = *o.config_;
  } else if (o.config_file_) {
    config = Config::load_file(*o.config_file_);
  } else if (const char* env = std::getenv("ACCEL_CONFIG_FILE"); env != nullptr && *env != '\0') {
    config = Config::load_file(env);
  }
  if (o.mixed_precision_) config.mixed_precision = *o.mixed_precision_;
  if (o.gradient_accumulation_steps_) config.gradient_accumulation_steps = *o.gradient_accumulation_steps_;
  if (o.cpu_) config.use_cpu = *o.cpu_;
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
  const char* v = std::getenv("ACCEL_COLLECTIVE_TIMEOUT");
  if (v == nullptr || *v == '\0') return config.collective_timeout_seconds;
  char* end = nullptr;
  const double x = std::strtod(v, &end);
  if (*end != '\0' || !(x > 0)) {
    throw ConfigError(
        fmt::format("environment variable ACCEL_COLLECTIVE_TIMEOUT='{}' is not a positive number of seconds",
                    v),
        {}, 0, "ACCEL_COLLECTIVE_TIMEOUT");
  }
  return x;
}

std::shared_ptr<const BackendRegistry> builtin_registry() {
  auto registry = std::make_shared<BackendRegistry>();
  register_builtin_backends(*registry);
  return registry;
}

}  // namespace

Accelerator::Accelerator() : Accelerator(AcceleratorOptions{}) {}

Accelerator::Accelerator(AcceleratorOptions options) : config_(resolve_config(options)) {
  state_ = options.process_state_ ? *options.process_state_ : ProcessState::from_environment();
  world_size_ = state_.world_size;
  rank_ = state_.rank;
  local_rank_ = state_.local_rank;
  if (!config_.use_cpu && torch::cuda::is_available()) {
    device_ =
        torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(local_rank_ % torch::cuda::device_count()));
  }
  CommunicatorOptions comm_options;
  comm_options.timeout =
      std::chrono::milliseconds(static_cast<std::int64_t>(timeout_seconds(config_) * 1000));
  comm_options.debug = config_.debug || env_flag("ACCEL_DEBUG") || env_flag("ACCELERATE_DEBUG_MODE");
  comm_ = Communicator::create(state_, device_, comm_options);
  if (config_.seed) set_seed(*config_.seed);
  // Launched on several ranks with a single-process config (or none): data parallel, as Accelerate infers
  // MULTI_CPU / MULTI_GPU from the launcher's environment.
  if (world_size_ > 1 && config_.backend == BackendKind::Local) config_.backend = BackendKind::Ddp;
  config_.num_processes = world_size_;
  auto registry = options.registry_ ? options.registry_ : builtin_registry();
  BackendContext context;
  context.config = &config_;
  context.device = device_;
  context.rank = rank_;
  context.world_size = world_size_;
  context.comm = comm_.get();
  backend_ = registry->create(config_.backend, context);
  if (config_.mixed_precision == MixedPrecision::Fp16) {
    scaler_ = std::make_unique<GradScaler>(GradScalerOptions(), device_);
  }
  collect_notices();
  if (is_main_process()) {
    for (const auto& n : notices_)
      std::cerr << "accelerate-cpp: note: " << n << std::endl;
  }
}

void Accelerator::collect_notices() {
  const auto& z = config_.zero;
  const auto& f = config_.fsdp;
  const bool zero = config_.backend == BackendKind::Zero, fsdp = config_.backend == BackendKind::Fsdp;
  if (device_.is_cpu()) {
    const char* why = "this run trains on the CPU, where that state lives already";
    if (zero && z.offload_optimizer_device == OffloadDevice::Cpu)
      notices_.push_back(
          fmt::format("deepspeed_config.offload_optimizer_device: cpu has no effect: {}", why));
    if (zero && z.offload_param_device == OffloadDevice::Cpu)
      notices_.push_back(fmt::format("deepspeed_config.offload_param_device: cpu has no effect: {}", why));
    if (fsdp && f.offload_params)
      notices_.push_back(fmt::format("fsdp_config.fsdp_offload_params: true has no effect: {}", why));
  }
  if (zero && z.zero3_init_flag) {
    notices_.push_back(
        "deepspeed_config.zero3_init_flag: true has no effect: LibTorch modules build their parameters whole "
        "before prepare(); stage 3 frees all but this rank's shard during prepare()");
  }
  if (fsdp && f.state_dict_type == StateDictType::ShardedStateDict) {
    notices_.push_back(
        "fsdp_config.fsdp_state_dict_type: SHARDED_STATE_DICT has no effect: save_state always writes the "
        "whole model, each rank's optimizer shard and the per-parameter optimizer state");
  }
  if (fsdp && f.cpu_ram_efficient_loading) {
    notices_.push_back(
        "fsdp_config.fsdp_cpu_ram_efficient_loading: true has no effect: every rank builds the model before "
        "prepare(), which then broadcasts rank 0's weights");
  }
}

Accelerator::~Accelerator() {
  // A loader that outlives its accelerator keeps working, without step-boundary parameter refreshes.
  for (auto& l : loaders_)
    l->on_advance = nullptr;
  if (autocast_on_) {
    at::autocast::set_autocast_enabled(device_.type(), autocast_prev_enabled_);
    if (autocast_prev_dtype_ != c10::ScalarType::Undefined) {
      at::autocast::set_autocast_dtype(device_.type(), autocast_prev_dtype_);
    }
    at::autocast::clear_cache();
  }
}

NamedTensors Accelerator::get_state_dict() {
  if (models_.empty()) throw UsageError("get_state_dict: no model was prepared");
  backend_->sync_parameters();
  return backend_->model_state();
}

std::string Accelerator::backend_name() const {
  return backend_->name();
}

void Accelerator::prepare_model(std::shared_ptr<torch::nn::Module> model) {
  if (!model) throw UsageError("prepare: the model is empty (a null ModuleHolder or shared_ptr)");
  for (const auto& m : models_) {
    if (m == model) throw UsageError("prepare: this model was already prepared; prepare each model once");
  }
  model->to(device_);  // in place: the optimizer's parameter handles stay valid
  if (config_.fsdp.activation_checkpointing || config_.zero.activation_checkpointing) {
    enable_activation_checkpointing(*model);
  }
  backend_->prepare_model(*model);
  models_.push_back(std::move(model));
  enable_autocast();
}

void Accelerator::enable_activation_checkpointing(torch::nn::Module& model) {
  // Without code changes this works where the blocks are Sequentials: the model itself, or its direct
  // children. Parameter names and tensors stay the same (see checkpointing.hpp).
  int wrapped = 0;
  if (auto* seq = dynamic_cast<torch::nn::SequentialImpl*>(&model)) {
    torch::nn::Sequential holder(
        std::static_pointer_cast<torch::nn::SequentialImpl>(seq->shared_from_this()));
    checkpoint_sequential(holder);
    wrapped = 1;
  } else {
    for (const auto& child : model.children()) {
      if (auto seq = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(child)) {
        torch::nn::Sequential holder(seq);
        checkpoint_sequential(holder);
        ++wrapped;
      }
    }
  }
  if (wrapped == 0) {
    throw UsageError(
        "activation_checkpointing is on, but the model is not a torch::nn::Sequential and has no Sequential "
        "children to checkpoint; wrap its blocks explicitly with accel::Checkpointed "
        "(accel/checkpointing.hpp) or "
        "turn the option off");
  }
}

void Accelerator::prepare_optimizer(torch::optim::Optimizer& optimizer) {
  for (auto* o : optimizers_) {
    if (o == &optimizer) throw UsageError("prepare: this optimizer was already prepared; prepare it once");
  }
  for (auto& group : optimizer.param_groups()) {
    for (auto& p : group.params()) {
      if (p.device() != device_) {
        throw UsageError(fmt::format(
            "prepare: an optimizer parameter lives on {} but the accelerator runs on {}; prepare the model "
            "before (or together with) its optimizer: accelerator.prepare(model, optimizer)",
            p.device().str(), device_.str()));
      }
    }
  }
  backend_->prepare_optimizer(optimizer);
  optimizers_.push_back(&optimizer);
}

void Accelerator::prepare_scheduler(torch::optim::LRScheduler& scheduler) {
  schedulers_.push_back(&scheduler);
}

void Accelerator::complete_loader_options(DataLoaderOptions& options) const {
  if (!options.seed_) options.seed_ = seed_.value_or(0);
  if (!options.even_batches_) options.even_batches_ = config_.even_batches;
  if (!options.split_batches_) options.split_batches_ = config_.split_batches;
}

std::shared_ptr<detail::LoaderState> Accelerator::register_loader() {
  loaders_.push_back(std::make_shared<detail::LoaderState>());
  loaders_.back()->clock = loader_clock_;
  loaders_.back()->on_advance = [this] { backend_->sync_parameters(); };
  return loaders_.back();
}

detail::LoaderState* Accelerator::active_loader() const {
  detail::LoaderState* active = nullptr;
  for (const auto& l : loaders_) {
    if (l->last_yield > 0 && (active == nullptr || l->last_yield > active->last_yield)) active = l.get();
  }
  return active;
}

bool Accelerator::end_of_data() const {
  const auto* l = active_loader();
  return l != nullptr && l->in_epoch && l->at_last_batch;
}

void Accelerator::enable_autocast() {
  if (autocast_on_ || config_.mixed_precision == MixedPrecision::No) return;
  // Autocast is thread-local LibTorch state: on for the thread that prepared the model, restored when the
  // accelerator is destroyed. LibTorch's C++ Module::forward cannot be wrapped, so this is what lets a YAML
  // switch alone turn mixed precision on.
  const auto type = device_.type();
  autocast_prev_enabled_ = at::autocast::is_autocast_enabled(type);
  autocast_prev_dtype_ = at::autocast::get_autocast_dtype(type);
  at::autocast::set_autocast_dtype(
      type, config_.mixed_precision == MixedPrecision::Bf16 ? at::kBFloat16 : at::kHalf);
  at::autocast::set_autocast_enabled(type, true);
  autocast_on_ = true;
}

std::vector<torch::Tensor> Accelerator::optimizer_params() const {
  std::vector<torch::Tensor> params;
  for (auto* opt : optimizers_) {
    for (auto& group : opt->param_groups()) {
      for (auto& p : group.params())
        params.push_back(p);
    }
  }
  return params;
}

void Accelerator::stash_gradients() {
  auto params = optimizer_params();
  stashed_grads_.assign(params.size(), torch::Tensor());
  for (std::size_t i = 0; i < params.size(); ++i) {
    stashed_grads_[i] = params[i].grad();
    params[i].mutable_grad() = torch::Tensor();
  }
}

void Accelerator::restore_gradients() {
  if (stashed_grads_.empty()) return;
  auto params = optimizer_params();
  if (params.size() != stashed_grads_.size()) {
    throw UsageError("backward: the optimizers' parameters changed in the middle of an accumulation cycle");
  }
  for (std::size_t i = 0; i < params.size(); ++i) {
    if (!stashed_grads_[i].defined()) continue;
    auto& g = params[i].mutable_grad();
    // The user may have produced gradients outside backward() meanwhile; keep both.
    g = g.defined() ? g + stashed_grads_[i] : stashed_grads_[i];
  }
  stashed_grads_.clear();
}

void Accelerator::backward(const torch::Tensor& loss) {
  if (!loss.defined()) throw UsageError("backward: the loss tensor is undefined");
  if (!loss.requires_grad()) {
    throw UsageError("backward: the loss does not require grad; was it computed under torch::NoGradGuard?");
  }
  const int steps = config_.gradient_accumulation_steps;
  cycle_position_ += 1;
  micro_steps_ += 1;
  sync_gradients_ = cycle_position_ >= steps || end_of_data();
  step_was_skipped_ = false;

  restore_gradients();
  backend_->before_backward(sync_gradients_);
  auto scaled = steps > 1 ? loss / static_cast<double>(steps) : loss;
  if (scaler_) scaled = scaler_->scale(scaled);
  scaled.backward();
  // Cast weights cached by autocast are stale once the optimizer updates them in place.
  if (autocast_on_) at::autocast::clear_cache();
  backend_->after_backward(sync_gradients_);

  if (!sync_gradients_) {
    stash_gradients();
    return;
  }
  cycle_position_ = 0;
  if (scaler_) {
    const auto params = optimizer_params();
    bool found_inf = scaler_->unscale_(params);
    if (world_size_ > 1) {
      // Sharded backends hold different gradient slices per rank: skip (or not) everywhere alike.
      auto flag = torch::tensor({found_inf ? 1.0f : 0.0f});
      comm_->all_reduce(flag, ReduceOp::Max);
      found_inf = flag.item<float>() != 0.0f;
    }
    scaler_->update(found_inf);
    if (found_inf) {
      // Undefined gradients make the user's optimizer.step() skip every parameter.
      for (auto p : params)
        p.mutable_grad() = torch::Tensor();
      step_was_skipped_ = true;
      return;
    }
  }
  completed_steps_ += 1;
}

double Accelerator::clip_grad_norm_(double max_norm, double norm_type) {
  if (!sync_gradients_) return 0.0;
  if (step_was_skipped_) return std::numeric_limits<double>::infinity();
  return backend_->clip_grad_norm(max_norm, norm_type);
}

torch::Tensor Accelerator::gather(const torch::Tensor& t) {
  if (world_size_ == 1) return t.dim() == 0 ? t.reshape({1}) : t;
  auto x = t.dim() == 0 ? t.reshape({1}) : t;
  // Sizes along dim 0 may differ (even_batches off, last batches): gather them first, pad, gather, trim.
  auto size = torch::tensor({x.size(0)}, torch::TensorOptions().dtype(torch::kInt64).device(x.device()));
  const auto sizes = comm_->all_gather(size).cpu();
  const auto* n = sizes.data_ptr<std::int64_t>();
  const auto longest = *std::max_element(n, n + world_size_);
  if (std::all_of(n, n + world_size_, [&](std::int64_t v) { return v == longest; }))
    return comm_->all_gather(x);
  auto gathered = comm_->all_gather(pad_across_processes(x, 0));
  std::vector<torch::Tensor> parts;
  for (int r = 0; r < world_size_; ++r)
    parts.push_back(gathered.narrow(0, r * longest, n[r]));
  return torch::cat(parts);
}

torch::Tensor Accelerator::gather_for_metrics(const torch::Tensor& t) {
  auto all = gather(t);
  // At the end of an epoch, the last round held `remainder` real samples and the rest were wrapped around.
  const auto* l = active_loader();
  if (world_size_ > 1 && l != nullptr && l->in_epoch && l->at_last_batch && l->remainder > 0) {
    return all.narrow(0, 0, std::min<std::int64_t>(all.size(0), static_cast<std::int64_t>(l->remainder)));
  }
  return all;
}

torch::Tensor Accelerator::reduce(const torch::Tensor& t, ReduceOp op) {
  auto out = t.clone();
  comm_->all_reduce(out, op);
  return out;
}

torch::Tensor Accelerator::broadcast(const torch::Tensor& t, int from) {
  if (from < 0 || from >= world_size_) {
    throw UsageError(fmt::format("broadcast: source rank {} is outside 0..{}", from, world_size_ - 1));
  }
  auto out = t.clone();
  comm_->broadcast(out, from);
  return out;
}

torch::Tensor Accelerator::pad_across_processes(const torch::Tensor& t, std::int64_t dim, double pad_index,
                                                bool pad_first) {
  if (world_size_ == 1 || t.dim() == 0) return t;
  if (dim < 0) dim += t.dim();
  if (dim < 0 || dim >= t.dim()) {
    throw UsageError(
        fmt::format("pad_across_processes: dim {} is out of range for a {}-d tensor", dim, t.dim()));
  }
  auto size = torch::tensor({t.size(dim)}, torch::TensorOptions().dtype(torch::kInt64).device(t.device()));
  const auto longest = comm_->all_gather(size).max().item<std::int64_t>();
  if (longest == t.size(dim)) return t;
  auto shape = t.sizes().vec();
  shape[static_cast<std::size_t>(dim)] = longest;
  auto out = torch::full(shape, pad_index, t.options());
  const auto start = pad_first ? longest - t.size(dim) : 0;
  out.narrow(dim, start, t.size(dim)).copy_(t);
  return out;
}

void Accelerator::wait_for_everyone() {
  comm_->barrier();
}

void Accelerator::sync_parameters() {
  backend_->sync_parameters();
}

Accelerator::SplitRange Accelerator::split_range(std::size_t n) const {
  const auto w = static_cast<std::size_t>(world_size_), r = static_cast<std::size_t>(rank_);
  const std::size_t per = n / w, extra = n % w;
  const std::size_t begin = r * per + std::min(r, extra);
  return {begin, begin + per + (r < extra ? 1 : 0), per + (extra > 0 ? 1 : 0)};
}

torch::Tensor Accelerator::split_between_processes(const torch::Tensor& t, bool apply_padding) const {
  const auto [begin, end, longest] = split_range(static_cast<std::size_t>(t.size(0)));
  auto out = t.narrow(0, static_cast<std::int64_t>(begin), static_cast<std::int64_t>(end - begin));
  if (apply_padding && t.size(0) > 0 && end - begin < longest) {
    out = torch::cat({out, t.narrow(0, t.size(0) - 1, 1).expand_as(t.narrow(0, 0, 1))});
  }
  return out;
}

Accelerator::MainProcessFirst::MainProcessFirst(Accelerator* acc, bool main) : acc_(acc), main_(main) {
  if (!main_) acc_->wait_for_everyone();  // wait until the main process finished the block
}

Accelerator::MainProcessFirst::~MainProcessFirst() noexcept(false) {
  if (acc_ != nullptr && main_) acc_->wait_for_everyone();  // release the others
}

Accelerator::MainProcessFirst Accelerator::main_process_first() {
  return MainProcessFirst(this, is_main_process());
}

Accelerator::MainProcessFirst Accelerator::local_main_process_first() {
  return MainProcessFirst(this, is_local_main_process());
}

void Accelerator::set_seed(std::uint64_t seed, bool device_specific) {
  const std::uint64_t s = device_specific ? seed + static_cast<std::uint64_t>(rank_) : seed;
  torch::manual_seed(s);  // CPU and every CUDA device
  seed_ = seed;
}

}  // namespace accel
