// DDP: buckets of gradients in reverse parameter order (first bucket small so communication starts early),
// each all-reduced asynchronously as soon as the AccumulateGrad hooks of all its parameters fired, in bucket
// order on every rank (Gloo/NCCL need the same collective order everywhere); one wait at the end of backward.
#include "ddp_backend.hpp"

#include <accel/errors.hpp>

#include "../common/buckets.hpp"
#include "../common/grad_hooks.hpp"
#include "../common/grad_utils.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <unordered_map>

namespace accel::backends {
namespace {

struct Bucket {
  std::vector<std::size_t> params;         // indices into DdpBackend::params_
  torch::Tensor flat;                      // communication buffer
  std::unique_ptr<CollectiveHandle> work;  // pending all-reduce
};

class DdpBackend final : public Backend {
 public:
  explicit DdpBackend(const BackendContext& context) : ctx_(context), comm_(*context.comm) {}

  std::string name() const override { return "ddp"; }
  BackendCapabilities capabilities() const override { return {}; }

  void prepare_model(torch::nn::Module& model) override {
    model_ = &model;
    for (const auto& item : model.named_parameters()) {
      if (item.value().requires_grad()) {
        names_.push_back(item.key());
        params_.push_back(item.value());
      }
    }
    detail::check_same_model_everywhere(comm_, model, "ddp");
    detail::broadcast_module(comm_, model);
    build_buckets();
    for (std::size_t i = 0; i < params_.size(); ++i) {
      hooks_.add(params_[i], i, [this](std::size_t index) { on_grad_ready(index); });
    }
  }

  void prepare_optimizer(torch::optim::Optimizer&) override {}

  void before_backward(bool sync) override {
    syncing_ = sync;
    if (!sync) return;
    for (auto& b : buckets_)
      b.work.reset();
    clock_.reset();
    seen_.assign(params_.size(), false);
    any_seen_ = false;
  }

  void after_backward(bool sync) override {
    if (!sync) return;
    syncing_ = false;
    // A model this backward gave no gradient at all (the generator during the discriminator's backward)
    // takes no part; its gradients, if any, are reduced with its next backward.
    if (!any_seen_) return;
    std::vector<std::string> unused;
    for (std::size_t i = 0; i < params_.size(); ++i) {
      if (!seen_[i]) unused.push_back(names_[i]);
    }
    // Fails before any rank waits on a bucket that will never be complete.
    detail::check_unused("ddp", unused, ctx_.config->ddp_find_unused_parameters);
    for (std::size_t i = 0; i < params_.size(); ++i) {
      if (!seen_[i]) mark_ready(i);
    }
    for (auto& b : buckets_) {
      b.work->wait();
      unflatten(b);
    }
    if (ctx_.config->ddp_broadcast_buffers) detail::broadcast_buffers(comm_, *model_);
  }

  GradientTensors gradients() const override { return {params_, false}; }

  NamedTensors model_state() override { return detail::module_state(*model_); }

  std::vector<torch::Tensor> gradient_buffers() const override {
    std::vector<torch::Tensor> out;
    for (const auto& b : buckets_)
      out.push_back(b.flat);
    return out;
  }

  void load_model_state(const std::map<std::string, torch::Tensor>& state) override {
    detail::load_module_state(*model_, state);
  }

  // Called from the gradient hooks during backward.
  void on_grad_ready(std::size_t index) {
    if (!syncing_ || seen_[index]) return;  // micro-steps communicate nothing
    any_seen_ = true;
    mark_ready(index);
  }

 private:
  void mark_ready(std::size_t index) {
    seen_[index] = true;
    // Launch complete buckets strictly in bucket order, so every rank issues the same sequence.
    for (auto b : clock_.mark(bucket_of_[index]))
      launch(buckets_[b]);
  }

  void launch(Bucket& b) {
    std::size_t offset = 0;
    torch::NoGradGuard no_grad;
    for (auto i : b.params) {
      const auto& p = params_[i];
      const auto n = p.numel();
      auto dst = b.flat.narrow(0, static_cast<std::int64_t>(offset), n);
      const auto& g = p.grad();
      if (g.defined()) {
        dst.copy_(g.reshape({-1}));
      } else {
        dst.zero_();  // an unused parameter tolerated by ddp_find_unused_parameters
      }
      offset += static_cast<std::size_t>(n);
    }
    b.work = detail::all_reduce_grads(comm_, b.flat, detail::wire_dtype(ctx_.config->ddp_comm_hook));
  }

  void unflatten(Bucket& b) {
    torch::NoGradGuard no_grad;
    b.flat.div_(comm_.world_size());
    std::size_t offset = 0;
    for (auto i : b.params) {
      auto& p = params_[i];
      const auto n = p.numel();
      // The gradient shares its bucket's memory (PyTorch's gradient_as_bucket_view), so gradients are not
      // held twice. It aliases the storage rather than being an autograd view: LibTorch's zero_grad()
      // detach_()es gradients, which views refuse.
      auto g = torch::empty({0}, b.flat.options());
      g.set_(b.flat.storage(), b.flat.storage_offset() + static_cast<std::int64_t>(offset), p.sizes());
      p.mutable_grad() = g;
      offset += static_cast<std::size_t>(n);
    }
  }

  void build_buckets() {
    const auto mib = [](double mb) { return static_cast<std::uint64_t>(mb * 1024 * 1024); };
    std::vector<std::uint64_t> bytes;
    for (const auto& p : params_)
      bytes.push_back(static_cast<std::uint64_t>(p.numel()) * p.element_size());
    bucket_of_.assign(params_.size(), 0);
    std::vector<std::size_t> sizes;
    for (auto& members : detail::plan_buckets(bytes, mib(ctx_.config->ddp_first_bucket_cap_mb),
                                              mib(ctx_.config->ddp_bucket_cap_mb))) {
      sizes.push_back(members.size());
      Bucket b;
      b.params = std::move(members);
      finish_bucket(b);
    }
    clock_ = detail::BucketClock(sizes);
  }

  void finish_bucket(Bucket& b) {
    std::int64_t numel = 0;
    const auto options = params_[b.params.front()].options();
    for (auto i : b.params) {
      if (params_[i].options().dtype() != options.dtype() || params_[i].device() != options.device()) {
        throw UnsupportedOperation(
            fmt::format("ddp: parameters of one model must share dtype and device; '{}' differs", names_[i]));
      }
      bucket_of_[i] = buckets_.size();
      numel += params_[i].numel();
    }
    b.flat = torch::zeros({numel}, options.requires_grad(false));
    buckets_.push_back(std::move(b));
  }

  BackendContext ctx_;
  Communicator& comm_;
  torch::nn::Module* model_ = nullptr;
  std::vector<std::string> names_;
  std::vector<torch::Tensor> params_;
  std::vector<Bucket> buckets_;
  std::vector<std::size_t> bucket_of_;
  detail::BucketClock clock_;
  std::vector<bool> seen_;
  bool any_seen_ = false;
  bool syncing_ = false;
  detail::GradReadyHooks hooks_;  // last member: removed first, before what the callbacks use
};

}  // namespace

std::unique_ptr<Backend> make_ddp_backend(const BackendContext& context) {
  if (context.comm == nullptr) throw UsageError("the ddp backend needs a communicator");
  return std::make_unique<DdpBackend>(context);
}

BackendDescriptor ddp_backend_descriptor() {
  BackendDescriptor d;
  d.name = "ddp";
  d.capabilities = [](const Config&) { return BackendCapabilities{}; };
  d.factory = make_ddp_backend;
  return d;
}

}  // namespace accel::backends
