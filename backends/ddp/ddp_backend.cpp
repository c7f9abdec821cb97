// DDP: buckets of gradients in reverse parameter order (first bucket small so communication starts early),
// each all-reduced asynchronously as soon as the AccumulateGrad hooks of all its parameters fired, in bucket
// order on every rank (Gloo/NCCL need the same collective order everywhere); one wait at the end of backward.
// With ddp_gradient_as_bucket_view (the default) each .grad is its bucket slice from the moment its hook
// fires (PyTorch's reducer does the same): the bucket is reduced in place and no gradient exists twice.
#include "ddp_backend.hpp"

#include <accel/errors.hpp>

#include <accel/backend/grad_ready_hooks.hpp>
#include "../common/buckets.hpp"
#include "../common/descriptor.hpp"
#include "../common/grad_reduce.hpp"
#include "../common/module_state.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/ops/linalg_qr.h>

#include <algorithm>
#include <unordered_map>

namespace accel::backends {
namespace {

struct Bucket {
  std::vector<std::size_t> params;         // indices into DdpBackend::params_
  torch::Tensor flat;                      // communication buffer
  std::unique_ptr<CollectiveHandle> work;  // pending all-reduce
  bool compressed = false;                 // this step: reduced by PowerSGD after backward, already a mean
  // PowerSGD state (PyTorch's PowerSGDState, per bucket): the local error left by the last approximation
  // (error feedback) and the all-reduced Q factors of the last step (warm start).
  torch::Tensor error, q;
};

// A gradient matrix PowerSGD compresses: rows x cols at `offset` of its bucket, approximated with rank r.
struct LowRank {
  std::int64_t offset, rows, cols, rank;
};

// How PowerSGD treats one bucket: the matrices it compresses and the rest, all-reduced as it is.
struct PowerSgdPlan {
  std::vector<LowRank> matrices;
  std::vector<std::pair<std::int64_t, std::int64_t>> plain;  // (offset, numel) all-reduced as they are
  std::int64_t p_numel = 0, q_numel = 0, plain_numel = 0;    // sizes of the P and Q factors and the rest
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
    as_view_ = ctx_.config->ddp_gradient_as_bucket_view;
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
      if (b.compressed) {
        power_sgd(b);
      } else {
        b.work->wait();
      }
      unflatten(b);
    }
    ++sync_steps_;
    if (ctx_.config->ddp_broadcast_buffers) detail::broadcast_buffers(comm_, *model_);
  }

  GradientTensors gradients() const override { return {params_, false, 1, {}}; }

  NamedTensors model_state() override { return detail::module_state_copy(*model_); }
  void visit_model_state(const std::function<void(NamedTensors)>& sink) override {
    sink(detail::module_state(*model_));  // read at once by the export: no copy
  }

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
    // Micro-steps too: what they accumulate is then added in place, in the bucket (idle until the sync).
    if (as_view_) move_into_bucket(index);
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

  // The slice of its bucket that holds parameter `index`'s gradient.
  torch::Tensor slot(std::size_t index) const {
    return buckets_[bucket_of_[index]].flat.narrow(0, offset_of_[index], params_[index].numel());
  }

  // True when `g` is the bucket slice `dst` itself (a gradient already moved into its bucket).
  static bool is_slot(const torch::Tensor& g, const torch::Tensor& dst) {
    return g.has_storage() && g.storage().is_alias_of(dst.storage()) &&
           g.storage_offset() == dst.storage_offset() && g.is_contiguous();
  }

  // gradient_as_bucket_view: the gradient autograd just wrote is copied into its bucket slice and .grad
  // re-pointed there, so the copy autograd made is freed at once (one parameter's gradient exists twice, for
  // a moment). It aliases the storage rather than being an autograd view: LibTorch's zero_grad() detach_()es
  // gradients, which views refuse.
  void move_into_bucket(std::size_t index) {
    auto& p = params_[index];
    auto& g = p.mutable_grad();
    if (!g.defined() || g.layout() != torch::kStrided) return;  // launch() copies (or refuses) the rest
    const auto dst = slot(index);
    if (is_slot(g, dst)) return;  // accumulated in place
    torch::NoGradGuard no_grad;
    dst.copy_(g.reshape({-1}));
    g = alias(dst, p);
  }

  static torch::Tensor alias(const torch::Tensor& dst, const torch::Tensor& p) {
    auto g = torch::empty({0}, dst.options());
    g.set_(dst.storage(), dst.storage_offset(), p.sizes());
    return g;
  }

  void launch(Bucket& b) {
    torch::NoGradGuard no_grad;
    for (auto i : b.params) {
      auto dst = slot(i);
      const auto& g = params_[i].grad();
      if (!g.defined()) {
        dst.zero_();  // an unused parameter tolerated by ddp_find_unused_parameters
      } else if (!is_slot(g, dst)) {
        dst.copy_(g.reshape({-1}));
      }
    }
    // PowerSGD needs two dependent all-reduces with matrix products between them: run after backward.
    b.compressed = ctx_.config->ddp_comm_hook == CommHook::PowerSgd &&
                   sync_steps_ >= static_cast<std::uint64_t>(ctx_.config->ddp_comm_powersgd_start_iter);
    if (b.compressed) return;
    b.work = detail::all_reduce_grads(comm_, b.flat, detail::wire_dtype(ctx_.config->ddp_comm_hook));
  }

  // PyTorch's powerSGD_hook on one bucket (Vogels et al. 2019): every gradient matrix M (a parameter of two
  // or more dimensions, rows = its first dimension) for which rank r factors are at least 2x smaller is
  // approximated as P Q^T: P = sum_ranks (M Q), orthonormalised; Q = sum_ranks (M^T P) / N; the rest is
  // all-reduced as is. Error feedback adds what the last approximation left out of this rank's gradient;
  // warm start reuses the last Q. Leaves the bucket holding the mean (approximated) gradient.
  void power_sgd(Bucket& b) {
    torch::NoGradGuard no_grad;
    const auto n = comm_.world_size();
    if (!b.error.defined()) b.error = torch::zeros_like(b.flat);
    b.flat.add_(b.error);
    const auto input = b.flat.clone();
    const auto plan = plan_power_sgd(b);
    // The uncompressed part travels while the P factors are computed.
    auto rest = torch::empty({plan.plain_numel}, b.flat.options());
    std::unique_ptr<CollectiveHandle> rest_work;
    if (plan.plain_numel > 0) {
      std::int64_t at = 0;
      for (const auto& [o, len] : plan.plain) {
        rest.narrow(0, at, len).copy_(b.flat.narrow(0, o, len));
        at += len;
      }
      rest_work = comm_.all_reduce_async({rest});
    }
    if (!plan.matrices.empty()) approximate_matrices(b, plan);
    if (rest_work) {
      rest_work->wait();
      rest.div_(n);
      std::int64_t at = 0;
      for (const auto& [o, len] : plan.plain) {
        b.flat.narrow(0, o, len).copy_(rest.narrow(0, at, len));
        at += len;
      }
    }
    at::sub_out(b.error, input, b.flat);  // what this rank's gradient lost: fed back next step
  }

  // Which of the bucket's gradients PowerSGD compresses: matrices for which rank r factors are at least 2x
  // smaller.
  PowerSgdPlan plan_power_sgd(const Bucket& b) const {
    const auto rank = static_cast<std::int64_t>(ctx_.config->ddp_comm_powersgd_rank);
    PowerSgdPlan plan;
    std::int64_t offset = 0;
    for (auto i : b.params) {
      const auto& p = params_[i];
      const auto numel = p.numel();
      if (p.dim() >= 2) {
        const auto rows = p.size(0), cols = numel / p.size(0);
        const auto r = std::min({rank, rows, cols});
        if ((rows + cols) * r * 2 < rows * cols) {  // PyTorch's min_compression_rate 2
          plan.matrices.push_back({offset, rows, cols, r});
          plan.p_numel += rows * r;
          plan.q_numel += cols * r;
          offset += numel;
          continue;
        }
      }
      plan.plain.emplace_back(offset, numel);
      plan.plain_numel += numel;
      offset += numel;
    }
    return plan;
  }

  // A new Q when the bucket has none of the right size (first step, or another layout): the same random Q on
  // every rank (a fixed seed, drawn on the CPU), orthonormalised.
  void init_power_sgd_q(Bucket& b, const PowerSgdPlan& plan) {
    auto gen = at::detail::createCPUGenerator(0x5eed + static_cast<std::uint64_t>(&b - buckets_.data()));
    b.q = at::randn({plan.q_numel}, gen, torch::TensorOptions().dtype(b.flat.dtype())).to(b.flat.device());
    std::int64_t at = 0;
    for (const auto& m : plan.matrices) {
      auto q = b.q.narrow(0, at, m.cols * m.rank).view({m.cols, m.rank});
      q.copy_(std::get<0>(at::linalg_qr(q)));
      at += m.cols * m.rank;
    }
  }

  // The compressed matrices M of the bucket replaced by P Q^T: P = sum_ranks (M Q), orthonormalised;
  // Q = sum_ranks (M^T P) / N (two all-reduces, in this order on every rank).
  void approximate_matrices(Bucket& b, const PowerSgdPlan& plan) {
    const auto n = comm_.world_size();
    const auto& matrices = plan.matrices;
    if (!b.q.defined() || b.q.numel() != plan.q_numel) init_power_sgd_q(b, plan);
    auto ps = torch::empty({plan.p_numel}, b.flat.options());
    auto matrix = [&](const LowRank& m) {
      return b.flat.narrow(0, m.offset, m.rows * m.cols).view({m.rows, m.cols});
    };
    std::int64_t pa = 0, qa = 0;
    for (const auto& m : matrices) {
      auto p = ps.narrow(0, pa, m.rows * m.rank).view({m.rows, m.rank});
      at::mm_out(p, matrix(m), b.q.narrow(0, qa, m.cols * m.rank).view({m.cols, m.rank}));
      pa += m.rows * m.rank;
      qa += m.cols * m.rank;
    }
    comm_.all_reduce_async({ps})->wait();
    pa = qa = 0;
    for (const auto& m : matrices) {
      auto p = ps.narrow(0, pa, m.rows * m.rank).view({m.rows, m.rank});
      p.copy_(std::get<0>(at::linalg_qr(p)));
      auto q = b.q.narrow(0, qa, m.cols * m.rank).view({m.cols, m.rank});
      at::mm_out(q, matrix(m).t(), p);
      pa += m.rows * m.rank;
      qa += m.cols * m.rank;
    }
    comm_.all_reduce_async({b.q})->wait();
    b.q.div_(n);
    pa = qa = 0;
    for (const auto& m : matrices) {
      auto p = ps.narrow(0, pa, m.rows * m.rank).view({m.rows, m.rank});
      auto q = b.q.narrow(0, qa, m.cols * m.rank).view({m.cols, m.rank});
      auto out = matrix(m);
      at::mm_out(out, p, q.t());
      pa += m.rows * m.rank;
      qa += m.cols * m.rank;
    }
  }

  // The reduced bucket becomes the gradients: each .grad is its slice (gradient_as_bucket_view), or, with
  // ddp_gradient_as_bucket_view: false, a copy of it in the gradient's own memory (PyTorch's default).
  void unflatten(Bucket& b) {
    torch::NoGradGuard no_grad;
    if (!b.compressed) b.flat.div_(comm_.world_size());
    for (auto i : b.params) {
      auto& p = params_[i];
      auto& g = p.mutable_grad();
      const auto dst = slot(i);
      if (as_view_) {
        if (!g.defined() || !is_slot(g, dst)) g = alias(dst, p);
      } else if (g.defined() && !is_slot(g, dst) && g.sizes() == p.sizes() && g.layout() == torch::kStrided) {
        g.copy_(dst.view(p.sizes()));
      } else {
        g = dst.clone().view(p.sizes());
      }
    }
  }

  void build_buckets() {
    const auto mib = [](double mb) { return static_cast<std::uint64_t>(mb * 1024 * 1024); };
    std::vector<std::uint64_t> bytes;
    for (const auto& p : params_)
      bytes.push_back(static_cast<std::uint64_t>(p.numel()) * p.element_size());
    bucket_of_.assign(params_.size(), 0);
    offset_of_.assign(params_.size(), 0);
    std::vector<std::size_t> sizes;
    // PyTorch's DDP buckets each dtype and device apart (compute_bucket_assignment_by_size): a planned bucket
    // is cut where its members' dtype or device changes (float32 LoRA adapters beside bf16 modules_to_save).
    auto close = [&](std::vector<std::size_t>& run) {
      if (run.empty()) return;
      sizes.push_back(run.size());
      Bucket b;
      b.params = std::move(run);
      finish_bucket(b);
      run.clear();
    };
    for (auto& members : detail::plan_buckets(bytes, mib(ctx_.config->ddp_first_bucket_cap_mb),
                                              mib(ctx_.config->ddp_bucket_cap_mb))) {
      std::vector<std::size_t> run;
      for (auto i : members) {
        if (!run.empty() && (params_[i].scalar_type() != params_[run.front()].scalar_type() ||
                             params_[i].device() != params_[run.front()].device()))
          close(run);
        run.push_back(i);
      }
      close(run);
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
      offset_of_[i] = numel;
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
  std::vector<std::int64_t> offset_of_;  // each parameter's offset in its bucket
  detail::BucketClock clock_;
  std::vector<bool> seen_;
  bool any_seen_ = false;
  bool syncing_ = false;
  bool as_view_ = true;           // ddp_gradient_as_bucket_view
  std::uint64_t sync_steps_ = 0;  // sync backward passes so far (PowerSGD's iteration count)
  GradReadyHooks hooks_;          // last member: removed first, before what the callbacks use
};

}  // namespace

std::unique_ptr<Backend> make_ddp_backend(const BackendContext& context) {
  if (context.comm == nullptr) throw UsageError("the ddp backend needs a communicator");
  return std::make_unique<DdpBackend>(context);
}

BackendDescriptor ddp_backend_descriptor() {
  return detail::describe("ddp", make_ddp_backend);
}

}  // namespace accel::backends
