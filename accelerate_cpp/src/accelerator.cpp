#include <accel/accelerator.hpp>

#include <ATen/autocast_mode.h>
#include <fmt/format.h>
#include <torch/autograd.h>
#include <torch/cuda.h>
#include <torch/utils.h>

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

int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  char* end = nullptr;
  const long x = std::strtol(v, &end, 10);
  if (*end != '\0' || x < 0) {
    throw ConfigError(fmt::format("environment variable {}='{}' is not a non-negative integer", name, v), {},
                      0, name);
  }
  return static_cast<int>(x);
}

std::shared_ptr<const BackendRegistry> builtin_registry() {
  auto registry = std::make_shared<BackendRegistry>();
  register_builtin_backends(*registry);
  return registry;
}

}  // namespace

Accelerator::Accelerator() : Accelerator(AcceleratorOptions{}) {}

Accelerator::Accelerator(AcceleratorOptions options) : config_(resolve_config(options)) {
  // torchrun-style variables; accel-launch sets the same names.
  world_size_ = env_int("WORLD_SIZE", 1);
  rank_ = env_int("RANK", 0);
  local_rank_ = env_int("LOCAL_RANK", 0);
  if (world_size_ < 1 || rank_ >= world_size_) {
    throw ConfigError(fmt::format("RANK={} is not below WORLD_SIZE={}; check the launcher's environment",
                                  rank_, world_size_),
                      {}, 0, "RANK");
  }
  if (!config_.use_cpu && torch::cuda::is_available()) {
    device_ =
        torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(local_rank_ % torch::cuda::device_count()));
  }
  if (config_.seed) set_seed(*config_.seed);
  auto registry = options.registry_ ? options.registry_ : builtin_registry();
  BackendContext context;
  context.config = &config_;
  context.device = device_;
  context.rank = rank_;
  context.world_size = world_size_;
  backend_ = registry->create(config_.backend, context);
  if (config_.mixed_precision == MixedPrecision::Fp16) {
    scaler_ = std::make_unique<GradScaler>(GradScalerOptions(), device_);
  }
}

Accelerator::~Accelerator() {
  if (autocast_on_) {
    at::autocast::set_autocast_enabled(device_.type(), autocast_prev_enabled_);
    if (autocast_prev_dtype_ != c10::ScalarType::Undefined) {
      at::autocast::set_autocast_dtype(device_.type(), autocast_prev_dtype_);
    }
    at::autocast::clear_cache();
  }
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
  backend_->prepare_model(*model);
  models_.push_back(std::move(model));
  enable_autocast();
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
  return loaders_.back();
}

bool Accelerator::end_of_data() const {
  for (const auto& l : loaders_) {
    if (l->in_epoch && l->at_last_batch) return true;
  }
  return false;
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
    const bool found_inf = scaler_->unscale_(params);
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
  if (world_size_ == 1) return t;
  throw UnsupportedOperation("gather across processes needs the distributed runtime (backend: ddp)");
}

torch::Tensor Accelerator::gather_for_metrics(const torch::Tensor& t) {
  return gather(t);
}

void Accelerator::wait_for_everyone() {}

void Accelerator::set_seed(std::uint64_t seed, bool device_specific) {
  const std::uint64_t s = device_specific ? seed + static_cast<std::uint64_t>(rank_) : seed;
  torch::manual_seed(s);  // CPU and every CUDA device
  seed_ = seed;
}

}  // namespace accel
