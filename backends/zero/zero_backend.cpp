#include "zero_backend.hpp"

#include <accel/errors.hpp>

#include <accel/backend/grad_ready_hooks.hpp>
#include "../common/buckets.hpp"
#include "../common/chunk_pipeline.hpp"
#include "../common/descriptor.hpp"
#include "../common/flat_shards.hpp"
#include "../common/grad_reduce.hpp"
#include "../common/grad_sentinel.hpp"
#include "../common/module_state.hpp"
#include "../common/param_trigger.hpp"
#include "../common/sharded_engine.hpp"
#include "../common/storage_guard.hpp"
#include "../ddp/ddp_backend.hpp"
#include "full_shard_backend.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cstdlib>
#include <exception>
#include <functional>
#include <iostream>
#include <limits>
#include <set>

namespace accel::backends {
namespace {

/// One sub-group of an optimizer parameter group (whole parameters, at most `sub_group_numel` elements
/// unless one parameter alone is larger), laid out flat and sharded.
struct Group {
  std::vector<std::size_t> params;   // indices into ZeroBackend::params_
  std::vector<std::int64_t> offset;  // flat offset of each of `params`
  std::int64_t numel = 0;            // P of this sub-group
  std::int64_t shard = 0;            // S = ceil(P / N)
  // [N * S] on the parameters' device: the whole parameters. Each parameter's storage points into it
  // (aliased), so the all-gather after the step writes the parameters themselves: no receive buffer, no copy.
  torch::Tensor flat;
  std::vector<bool> aliased;  // per member: its storage points into `flat` (else copied after a gather)
  torch::Tensor master;       // [S]: this rank's slice, the tensor the optimizer updates
  torch::Tensor grad_buf;     // [S]: memory of the master's gradient, reused while nothing else holds it
  // [S] offload from a GPU: page-locked host memory the reduced gradient slices are copied into before they
  // are added to the master's gradient (a copy from pinned memory runs at the bus's speed, several times a
  // pageable one).
  torch::Tensor staging;
};

// True when nothing but `t` itself holds its memory (no other tensor object, no view).
bool sole_owner(const torch::Tensor& t) {
  return t.defined() && t.use_count() == 1 && t.storage().use_count() == 1;
}

/// Stage-2 bucket: a contiguous flat range [begin, end) of one group.
struct StageBucket {
  std::size_t group = 0;
  std::vector<std::size_t> members;  // indices into Group::params
  std::int64_t begin = 0, end = 0;
  torch::Tensor filling;  // [end - begin]: gradients copied in as they arrive (each freed at once)
};

struct ParamRef {
  std::size_t group = 0, member = 0, bucket = 0;
};

// Tags of the parameter trigger: operators on a master (the optimizer stepping it) and on a model parameter.
constexpr std::size_t kZeroMasterTag = 0;
constexpr std::size_t kZeroParamTag = 1;
// With NVMe offload each sub-group's master (and its optimizer state) has its own tag, from this one up.
constexpr std::size_t kZeroGroupTagBase = 2;

class ZeroBackend final : public detail::ShardedEngine<ZeroOptions> {
 public:
  using ShardedEngine::ShardedEngine;

  ~ZeroBackend() override {
    trigger_.stop();
    // The optimizer may be destroyed already (declared after the accelerator): the NVMe tier must not ask it
    // for its state from here on; an optimizer that is still alive gets its state back in memory.
    restore_offloaded_state();
    sentinels_.clear(params_);  // the model goes back to plain LibTorch
    // Leave a whole, current model behind for code after the accelerator (torch::save at the end of main):
    // every rank destroys its accelerator at the same point of the program, so the refresh is collective as
    // usual. Not during unwinding, where another rank may never arrive; the parameters then stay poisoned.
    if (dirty_ && std::uncaught_exceptions() == 0) {
      try {
        sync_parameters();
      } catch (const std::exception&) {
      }
    }
  }

  void prepare_model(torch::nn::Module& model) override {
    model_ = &model;
    const auto params = model.parameters();
    const std::uint64_t element_size = params.empty() ? 4 : params.front().element_size();
    if (options_.bucket_from_model) {
      options_.bucket_bytes = auto_bucket_bytes(model, 1.0, element_size);
    } else if (options_.bucket_elements) {
      // DeepSpeed counts reduce_bucket_size in elements (stage_1_and_2.py: a bucket is full when
      // elements_in_ipg_bucket + numel > reduce_bucket_size); saturating at the largest size.
      const auto max = std::numeric_limits<std::uint64_t>::max();
      const auto n = *options_.bucket_elements;
      options_.bucket_bytes = n > max / element_size ? max : n * element_size;
    }
    for (auto& [name, p] : detail::take_over_model(world_, model, options_.name)) {
      names_.push_back(name);
      params_.push_back(p);
      trigger_.watch(p, kZeroParamTag);
    }
  }

  void prepare_optimizer(torch::optim::Optimizer& optimizer) override {
    adopt_optimizer(optimizer, kZeroGroupTagBase);
    const std::size_t first_group = groups_.size();
    detail::Quiet quiet;
    trigger_.stop();
    for (auto& pg : optimizer.param_groups()) {
      std::vector<torch::Tensor> masters;
      Group g;
      torch::Tensor first;
      for (const auto& p : pg.params()) {
        const auto index = index_of(p);
        if (ref_.count(index) != 0) {
          throw UsageError(
              fmt::format("{}: parameter '{}' is in two optimizer groups", options_.name, names_[index]));
        }
        if (!first.defined()) first = params_[index];
        if (p.scalar_type() != first.scalar_type() || p.device() != first.device()) {
          throw UnsupportedOperation(
              fmt::format("{}: parameters of one optimizer group must share dtype and device; '{}' differs",
                          options_.name, names_[index]));
        }
        // DeepSpeed's sub_group_size: the optimizer steps sub-groups of whole parameters, each its own flat
        // master slice, which bounds the temporaries an optimizer allocates per tensor.
        if (!g.params.empty() && g.numel + p.numel() > options_.sub_group_numel) {
          masters.push_back(close_group(std::move(g)));
          g = Group();
        }
        ref_[index] = ParamRef{groups_.size(), g.params.size(), 0};
        g.params.push_back(index);
        g.offset.push_back(g.numel);
        g.numel += p.numel();
      }
      if (!g.params.empty()) masters.push_back(close_group(std::move(g)));
      if (!masters.empty()) pg.params() = masters;
    }
    if (nvme_) {
      for (std::size_t gi = first_group; gi < groups_.size(); ++gi)
        nvme_->add_group(gi, groups_[gi].master, &optimizer);
    }
    planned_by_arrival_ = false;  // planned again after the next synchronising backward
    arrival_.clear();
    build_buckets();
    install_hooks();
    trigger_.start();
  }

  void hold_optimizer_state(bool hold) override {
    if (nvme_) nvme_->hold(hold);
  }

  void before_backward(bool sync) override {
    sentinels_.clear(params_);  // autograd would add this backward's gradients into them
    sync_parameters();          // a backward whose forward read no parameter (nothing else refreshed them)
    syncing_ = sync;
    if (!sync) return;
    seen_.assign(params_.size(), false);
    any_seen_ = false;
    for (auto& b : buckets_)
      b.filling = torch::Tensor();
    clock_.reset();
    pending_.clear();
  }

  void after_backward(bool sync) override {
    if (!sync) return;
    syncing_ = false;
    detail::Quiet quiet;
    const auto loose = detail::loose_parameters(params_, [&](std::size_t i) { return ref_.count(i) != 0; });
    bool took_part = detail::any_grad(loose);
    if (options_.stage == 1) {
      took_part = reduce_scatter_all() || took_part;
    } else if (any_seen_ || holds_gradients()) {
      // Also a model this backward gave nothing but that holds gradients of earlier micro-steps (the
      // generator's, restored by the accelerator, during the discriminator's synchronising backward): they
      // are reduced now, into the optimizer's slices, where the user's zero_grad() reaches them as it
      // reaches a DDP model's .grad (issue 29: kept in .grad they leaked into the next step).
      took_part = true;
      std::vector<std::string> unused;
      for (const auto& [index, r] : ref_) {
        if (any_seen_ && !seen_[index] && params_[index].requires_grad()) unused.push_back(names_[index]);
      }
      detail::check_unused(options_.name, unused, ctx_.config->ddp_find_unused_parameters);
      for (const auto& [index, r] : ref_) {
        if (!seen_[index]) mark_ready(index);
      }
      finish_pending();
      // Not with ddp_find_unused_parameters (a data-dependent graph), as PyTorch's DDP does not rebuild its
      // buckets then: a rank's arrival order would not be every step's.
      if (options_.stage == 2 && any_seen_ && !planned_by_arrival_ &&
          !ctx_.config->ddp_find_unused_parameters)
        plan_by_arrival();
    }
    // A model this backward gave no gradient (the generator during the discriminator's backward) takes no
    // part: nothing to reduce, and its buffers did not change.
    if (!took_part) return;
    // A rank whose slice is only padding received nothing: give it zeros, so that every rank's optimizer
    // steps (and holds state for) the same tensors.
    for (auto& g : groups_)
      master_grad(g);
    detail::end_sync_step(world_, *model_, *ctx_.config, loose);
    // LibTorch's clip_grad_norm_ on the model's parameters must not find "no gradient" and do nothing.
    sentinels_.plant(params_, names_, options_.name, [&](std::size_t i) { return ref_.count(i) != 0; });
  }

  GradientTensors gradients() const override {
    return gradients_of(groups_, [&](std::size_t i) { return ref_.count(i) != 0; });
  }

  std::vector<OptimizerTensorLayout> optimizer_layout(
      const torch::optim::Optimizer& optimizer) const override {
    return layouts_of(groups_, optimizer);
  }

  void sync_parameters() override {
    if (!dirty_) return;
    detail::Quiet quiet;
    if (nvme_) nvme_->end_step();  // the step is over: its last sub-group's state goes out
    torch::NoGradGuard no_grad;
    for (auto index : owned_)
      detail::unpoison_storage(params_[index]);
    // Every sub-group is gathered straight into its flat buffer, which the parameters' storages point into;
    // all are in flight at once and waited for in order.
    std::vector<std::unique_ptr<CollectiveHandle>> works;
    std::vector<torch::Tensor> slices;  // alive until every gather is done (offload: copies on the device)
    for (auto& g : groups_) {
      slices.push_back(g.master.device() == g.flat.device() ? g.master : g.master.to(g.flat.device()));
      works.push_back(comm_.all_gather_async(g.flat, slices.back()));
    }
    for (std::size_t gi = 0; gi < groups_.size(); ++gi) {
      works[gi]->wait();
      auto& g = groups_[gi];
      for (std::size_t m = 0; m < g.params.size(); ++m) {
        if (g.aliased[m]) continue;
        auto& p = params_[g.params[m]];
        p.copy_(g.flat.narrow(0, g.offset[m], p.numel()).view(p.sizes()));
      }
    }
    dirty_ = false;
  }

  std::vector<torch::Tensor> gradient_buffers() const override {
    std::vector<torch::Tensor> out;
    for (const auto& pending : pending_)
      out.push_back(pending.buffer);  // a bucket of gradients being reduced
    for (const auto& g : groups_) {
      if (g.grad_buf.defined()) out.push_back(g.grad_buf);  // the masters' gradient memory, kept for reuse
    }
    return out;
  }

  NamedTensors model_state() override {
    sync_parameters();
    detail::Quiet quiet;
    auto state = detail::module_state(*model_);
    for (auto& [name, t] : state)
      t = t.clone();
    return state;
  }

  void visit_model_state(const std::function<void(NamedTensors)>& sink) override {
    sync_parameters();
    detail::Quiet quiet;
    sink(detail::module_state(*model_));  // the parameters are whole on every rank: no copy
  }

  void load_model_state(const std::map<std::string, torch::Tensor>& state) override {
    sync_parameters();
    detail::Quiet quiet;
    detail::load_module_state(*model_, state);
    // The masters are the optimizer's copy of the weights: reload this rank's slices from the model.
    torch::NoGradGuard no_grad;
    for (auto& g : groups_) {
      for (std::size_t m = 0; m < g.params.size(); ++m) {
        if (!g.aliased[m]) {
          const auto& p = params_[g.params[m]];
          g.flat.narrow(0, g.offset[m], p.numel()).copy_(p.detach().reshape({-1}));
        }
      }
      g.master.copy_(g.flat.narrow(0, comm_.rank() * g.shard, g.shard));
    }
  }

  void on_grad_ready(std::size_t index) {
    if (!syncing_ || options_.stage != 2 || ref_.count(index) == 0 || seen_[index]) return;
    detail::Quiet quiet;  // our own operators (on the masters too) are no optimizer step
    any_seen_ = true;
    if (!planned_by_arrival_) arrival_.push_back(index);
    mark_ready(index);
  }

 private:
  // --- the trigger: the optimizer stepped a master, or an operator is about to read a stale parameter ---

  void on_operator_start(const std::vector<std::size_t>& tags) noexcept override {
    try {
      const bool param = std::find(tags.begin(), tags.end(), kZeroParamTag) != tags.end();
      // With NVMe offload the sub-group the optimizer is about to step comes in (and the one before goes
      // out).
      const bool master = std::find(tags.begin(), tags.end(), kZeroMasterTag) != tags.end() ||
                          (nvme_ && nvme_->on_operator(tags));
      if (master && !dirty_) {
        // The user's optimizer.step() (LibTorch's SGD writes through .data(), which version counters do not
        // see; the storage is the same): the model is stale until refreshed. Reading it without an operator
        // (torch::save) now throws, naming the call that refreshes it.
        dirty_ = true;
        for (auto index : owned_)
          detail::poison_storage(params_[index], stale_message(index));
      } else if (param && dirty_) {
        sync_parameters();  // every rank runs the same forward: collective, as the step boundary is
      }
    } catch (const std::exception& e) {
      abort_in_callback(
          "refreshing the model's parameters from the optimizer's shards before an operator read them", e);
    }
  }

  void on_operator_end(const std::vector<std::size_t>& /*tags*/) noexcept override {}

  std::string stale_message(std::size_t index) const {
    return fmt::format(
        "accelerate-cpp: parameter '{}' is stale: optimizer.step() updated the {} backend's shards and every "
        "rank refreshes the model at its next forward; to read or save the weights now, first call "
        "accelerator.wait_for_everyone() on every rank (or use accelerator.get_state_dict(model) / "
        "save_state)",
        names_[index], options_.name);
  }

  // Lays a sub-group out flat: one buffer holding its whole parameters (their storages pointing into it) and
  // this rank's master slice, which the optimizer steps; returns the master.
  torch::Tensor close_group(Group g) {
    torch::NoGradGuard no_grad;
    g.shard = detail::shard_size(g.numel, comm_.world_size());
    const auto& first = params_[g.params.front()];
    g.flat = torch::zeros({g.shard * comm_.world_size()}, first.options().requires_grad(false));
    for (std::size_t m = 0; m < g.params.size(); ++m) {
      const auto& p = params_[g.params[m]];
      g.flat.narrow(0, g.offset[m], p.numel()).copy_(p.detach().reshape({-1}));
      // A plain contiguous parameter that owns its storage moves into the buffer; anything else (a view of
      // a larger tensor) stays where it is and is copied to after each gather.
      const bool movable = p.layout() == torch::kStrided && p.is_contiguous() && p.storage_offset() == 0 &&
                           p.storage().nbytes() == p.nbytes();
      if (movable) detail::point_storage_into(p, g.flat, g.offset[m]);
      g.aliased.push_back(movable);
    }
    // Offload: the master slice (and so the optimizer state, created like it) lives in CPU memory,
    // page-locked when the model is on a GPU, so that the copy to the device after each step runs at the
    // bus's speed.
    g.master = g.flat.narrow(0, comm_.rank() * g.shard, g.shard).clone();
    const bool offload = options_.offload_optimizer || options_.nvme;  // NVMe: the masters stay in CPU memory
    if (offload && !g.master.is_cpu()) {
      auto host = torch::empty({g.shard}, g.master.options().device(torch::kCPU).pinned_memory(true));
      g.master = host.copy_(g.master);
    } else if (offload) {
      g.master = g.master.to(torch::kCPU);
    }
    // The optimizer stepping a master is what makes the model stale: watch it.
    trigger_.watch(g.master, nvme_ ? nvme_->tag(groups_.size()) : kZeroMasterTag);
    groups_.push_back(std::move(g));
    return groups_.back().master;
  }

  // The master's gradient, zero when it had none: reuses the group's buffer when nothing else holds it (the
  // optimizer's zero_grad() dropped it), so a step allocates no fresh slice.
  torch::Tensor& master_grad(Group& g) {
    auto& grad = g.master.mutable_grad();
    if (grad.defined()) return grad;
    if (!sole_owner(g.grad_buf)) g.grad_buf = torch::empty_like(g.master);
    g.grad_buf.zero_();
    grad = g.grad_buf;
    return grad;
  }

  std::size_t index_of(const torch::Tensor& p) const {
    return detail::parameter_index(params_, p, options_.name);
  }

  // Calls f(flat tensor of parameter m, offset in it, offset in the range, length) for every parameter piece
  // covering flat positions [begin, end) of `g` (positions past the last parameter are padding).
  template <class F>
  void for_flat_range(const Group& g, std::int64_t begin, std::int64_t end, F f) {
    auto m = static_cast<std::size_t>(std::upper_bound(g.offset.begin(), g.offset.end(), begin) -
                                      g.offset.begin());
    m = m == 0 ? 0 : m - 1;
    for (; m < g.params.size() && g.offset[m] < end; ++m) {
      const auto numel = params_[g.params[m]].numel();
      const auto lo = std::max(begin, g.offset[m]), hi = std::min(end, g.offset[m] + numel);
      if (lo < hi) f(g.params[m], lo - g.offset[m], lo - begin, hi - lo);
    }
  }

  // Copies the gradients at flat positions [begin, begin + out.numel()) into `out` (missing ones stay as they
  // are: zero).
  void read_flat_range(const Group& g, std::int64_t begin, torch::Tensor out) {
    for_flat_range(g, begin, begin + out.numel(),
                   [&](std::size_t index, auto in_param, auto in_range, auto len) {
                     const auto& grad = params_[index].grad();
                     if (grad.defined())
                       out.narrow(0, in_range, len).copy_(grad.reshape({-1}).narrow(0, in_param, len));
                   });
  }

  // Adds a reduced slice (a sum over ranks) into the master's gradient: gradients add up across backward
  // calls until the optimizer steps or zero_grad() runs, as autograd's do (hand-written accumulation).
  void set_master_grad(Group& g, const torch::Tensor& reduced_slice, std::int64_t at) {
    master_grad(g)
        .narrow(0, at, reduced_slice.numel())
        .add_(on_master_device(g, reduced_slice, at), 1.0 / world_.world_size());
  }

  // A reduced slice (positions [at, at + numel) of the shard) on the master's device: itself, or offloaded
  // from a GPU, copied into the group's pinned staging buffer.
  torch::Tensor on_master_device(Group& g, const torch::Tensor& slice, std::int64_t at) {
    if (slice.device() == g.master.device()) return slice;
    if (!g.master.is_cpu() || !slice.is_cuda()) return slice.to(g.master.device());
    if (!g.staging.defined())
      g.staging = torch::empty({g.shard}, g.master.options().requires_grad(false).pinned_memory(true));
    return g.staging.narrow(0, at, slice.numel()).copy_(slice);
  }

  // Stage 1: one reduce-scatter of each group's whole padded gradient; false when the model received no
  // gradient at all (it takes no part in this backward).
  bool reduce_scatter_all() {
    torch::NoGradGuard no_grad;
    const auto n = comm_.world_size();
    std::vector<std::string> unused;
    bool any = false;
    for (const auto& [index, r] : ref_) {
      if (params_[index].grad().defined()) {
        any = true;
      } else if (params_[index].requires_grad()) {
        unused.push_back(names_[index]);
      }
    }
    if (!any) return false;
    detail::check_unused(options_.name, unused, ctx_.config->ddp_find_unused_parameters);
    for (auto& g : groups_) {
      const auto& first = params_[g.params.front()];
      // Chunks of about bucket_bytes, each rank's k-th piece side by side, two reduce-scatters in flight;
      // no whole-model gradient copy is made.
      const auto per_rank = static_cast<std::int64_t>(options_.bucket_bytes / (first.element_size() * n));
      // Reduced straight into the master's gradient memory when the master has no gradient yet (the usual
      // step: zero_grad() dropped it) and lives on this device; else into a slice that is added to it.
      const bool direct = !g.master.grad().defined() && g.master.device() == first.device();
      if (direct && !sole_owner(g.grad_buf)) g.grad_buf = torch::empty_like(g.master);
      auto grad = direct ? g.grad_buf : torch::empty({g.shard}, first.options().requires_grad(false));
      detail::pipelined_chunks(g.shard, per_rank, 2, [&](std::int64_t at, std::int64_t len) {
        auto input = torch::zeros({n * len}, first.options().requires_grad(false));
        for (int r = 0; r < n; ++r)
          read_flat_range(g, r * g.shard + at, input.narrow(0, r * len, len));
        auto work = std::shared_ptr<CollectiveHandle>(detail::reduce_scatter_grads(
            comm_, grad.narrow(0, at, len), input, detail::wire_dtype(ctx_.config->ddp_comm_hook)));
        return std::function<void()>([work] { work->wait(); });
      });
      for (auto index : g.params)
        params_[index].mutable_grad() = torch::Tensor();
      if (shards_.across) shards_.across->all_reduce(grad, ReduceOp::Sum);  // hybrid: the other machines
      if (direct) {
        g.master.mutable_grad() = grad.mul_(1.0 / world_.world_size());
      } else {
        set_master_grad(g, grad, 0);
      }
    }
    return true;
  }

  // Stage 2: buckets of contiguous flat ranges of one sub-group, built in reverse model order across all
  // groups (the order backward produces gradients in) and launched strictly in bucket order, so that every
  // rank issues the same collectives. Built group by group, the last group's bucket came first: a model whose
  // biases and norms form a group of their own (no weight decay) had them in bucket 0, complete only when the
  // first layer's last gradient arrived, and every bucket behind it (the whole model's gradients, an untied
  // head's among them) waited for it, held until the end of backward (issue 51).
  void build_buckets() {
    if (options_.stage != 2) return;
    std::vector<std::size_t> indices;  // by model index, descending
    for (const auto& [index, r] : ref_)
      indices.push_back(index);
    std::sort(indices.begin(), indices.end(), std::greater<>());
    build_buckets(indices);
  }

  // Plans the buckets for gradients arriving in `indices`' order (every parameter of ref_ once).
  void build_buckets(const std::vector<std::size_t>& indices) {
    buckets_.clear();
    std::vector<std::pair<std::size_t, std::size_t>> order;  // (group, member)
    for (auto index : indices)
      order.emplace_back(ref_.at(index).group, ref_.at(index).member);
    std::vector<std::size_t> sizes;
    StageBucket b;
    std::uint64_t filled = 0;
    for (const auto& [gi, m] : order) {
      const auto& p = params_[groups_[gi].params[m]];
      const auto bytes = static_cast<std::uint64_t>(p.numel()) * p.element_size();
      // A bucket is one group's contiguous range: the next member must be the one before in flat order.
      const bool joins = !b.members.empty() && b.group == gi && b.members.back() == m + 1 &&
                         filled + bytes <= options_.bucket_bytes;
      if (!b.members.empty() && !joins) {
        sizes.push_back(b.members.size());
        close_bucket(b);
        b = StageBucket();
        filled = 0;
      }
      b.group = gi;
      b.members.push_back(m);
      filled += bytes;
    }
    if (!b.members.empty()) {
      sizes.push_back(b.members.size());
      close_bucket(b);
    }
    clock_ = detail::BucketClock(sizes);
  }

  // After the first synchronising backward, the buckets are planned again in the order its gradients
  // arrived, rank 0's (broadcast, so that every rank launches the same buckets), as PyTorch's DDP rebuilds
  // its buckets after the first iteration. Reverse model order is not backward's order inside a decoder
  // layer: it registers self_attn, mlp, then input_layernorm and post_attention_layernorm, so in reverse
  // order the layer's norms came first, and input_layernorm's gradient arrives last in the layer; buckets
  // launch strictly in order, so every bucket of the layer (its attention and MLP gradients) waited for it
  // (issue 51). Parameters that got no gradient follow in reverse model order. The sums do not change (each
  // bucket is still an element-wise sum in rank order).
  void plan_by_arrival() {
    planned_by_arrival_ = true;
    std::vector<std::int64_t> sent(params_.size(), -1);
    for (std::size_t k = 0; k < arrival_.size() && k < sent.size(); ++k)
      sent[k] = static_cast<std::int64_t>(arrival_[k]);
    arrival_.clear();
    auto order = torch::tensor(sent, torch::kInt64);
    // From rank 0 of the world, not of this machine's shard group: under hybrid sharding the machines'
    // parts are summed across them, so every machine must cut its buckets alike.
    world_.broadcast(order, 0);
    std::vector<std::size_t> indices;
    std::set<std::size_t> taken;
    const auto* got = order.data_ptr<std::int64_t>();
    for (std::size_t k = 0; k < sent.size() && got[k] >= 0; ++k) {
      const auto index = static_cast<std::size_t>(got[k]);
      if (ref_.count(index) != 0 && taken.insert(index).second) indices.push_back(index);
    }
    for (auto it = ref_.rbegin(); it != ref_.rend(); ++it) {
      if (taken.count(it->first) == 0) indices.push_back(it->first);
    }
    build_buckets(indices);
  }

  void close_bucket(StageBucket& b) {
    const auto& g = groups_[b.group];
    const auto first = b.members.back(), last = b.members.front();  // members are in reverse order
    b.begin = g.offset[first];
    b.end = g.offset[last] + params_[g.params[last]].numel();
    for (auto m : b.members)
      ref_[g.params[m]].bucket = buckets_.size();
    buckets_.push_back(std::move(b));
  }

  void install_hooks() {
    owned_.clear();
    for (const auto& [index, r] : ref_)
      owned_.push_back(index);
    if (options_.stage != 2) return;
    for (const auto& [index, r] : ref_) {
      // Frozen parameters have no gradient accumulator; their bucket slots are filled at the end of backward.
      if (params_[index].requires_grad() && hooked_.insert(index).second)
        hooks_.add(params_[index], index, [this](std::size_t i) { on_grad_ready(i); });
    }
  }

  // Some parameter holds a gradient no backward hook has handed over yet.
  bool holds_gradients() const {
    for (const auto& [index, r] : ref_) {
      if (params_[index].grad().defined()) return true;
    }
    return false;
  }

  void mark_ready(std::size_t index) {
    seen_[index] = true;
    torch::NoGradGuard no_grad;
    auto& b = buckets_[ref_.at(index).bucket];
    auto& g = groups_[b.group];
    auto& p = params_[index];
    // A bucket of one parameter (a parameter above reduce_bucket_size: the embedding, the LM head) is reduced
    // in the gradient autograd made, which nothing else holds: no copy of it exists beside it. (While post
    // hooks run, autograd's engine keeps the gradient it handed to AccumulateGrad in its list of the node's
    // inputs, which it drops after them: that is the second reference to a stolen gradient. When
    // AccumulateGrad stole it as `new_grad.detach()`, .grad is an alias of its own and the engine's tensor
    // the storage's one other owner: the embedding's and an untied head's gradients arrive so, and took the
    // copy path below, a second [vocab, hidden] buffer beside them; issue 51.)
    const auto& grad = p.grad();
    const bool sole = grad.defined() && ((grad.use_count() <= 2 && grad.storage().use_count() == 1) ||
                                         (grad.use_count() == 1 && grad.storage().use_count() == 2));
    if (b.members.size() == 1 && sole && grad.is_contiguous() && grad.layout() == torch::kStrided &&
        grad.scalar_type() == p.scalar_type()) {
      b.filling = grad.view({-1});
      p.mutable_grad() = torch::Tensor();
      for (auto launchable : clock_.mark(ref_.at(index).bucket))
        launch(launchable);
      return;
    }
    // Copy on arrival and free the gradient at once: a rank holds the bucket being filled, not its gradients
    // plus a copy.
    if (!b.filling.defined()) b.filling = torch::zeros({b.end - b.begin}, p.options().requires_grad(false));
    if (p.grad().defined()) {
      b.filling.narrow(0, g.offset[ref_.at(index).member] - b.begin, p.numel()).copy_(p.grad().reshape({-1}));
    }
    p.mutable_grad() = torch::Tensor();
    for (auto launchable : clock_.mark(ref_.at(index).bucket))
      launch(launchable);
  }

  struct Pending {
    std::size_t bucket;
    std::size_t group;
    torch::Tensor buffer;
    // (owner, flat offset within the group, reduced tensor, pending reduce)
    std::vector<std::tuple<int, std::int64_t, torch::Tensor, std::unique_ptr<CollectiveHandle>>> parts;
  };

  void launch(std::size_t bi) {
    torch::NoGradGuard no_grad;
    finish_pending();  // one bucket in flight: reducing bucket k overlaps filling bucket k+1
    auto& b = buckets_[bi];
    auto& g = groups_[b.group];
    Pending pending{bi, b.group, std::move(b.filling), {}};
    b.filling = torch::Tensor();
    // Reduce each owner's part of the bucket to that owner.
    for (int r = 0; r < comm_.world_size(); ++r) {
      const auto lo = std::max(b.begin, r * g.shard), hi = std::min(b.end, (r + 1) * g.shard);
      if (lo >= hi) continue;
      auto part = pending.buffer.narrow(0, lo - b.begin, hi - lo);  // a view: no copy
      auto work = detail::reduce_grads(comm_, part, r, detail::wire_dtype(ctx_.config->ddp_comm_hook));
      pending.parts.emplace_back(r, lo, std::move(part), std::move(work));
    }
    pending_.push_back(std::move(pending));
    if (!options_.overlap_comm) finish_pending();  // reduced before backward continues: one bucket at most
  }

  void finish_pending() {
    for (auto& pending : pending_) {
      auto& g = groups_[pending.group];
      for (auto& [owner, global, part, work] : pending.parts) {
        work->wait();
        if (owner != comm_.rank()) continue;
        // Hybrid sharding: the part, summed over this machine, is summed over the machines holding it too.
        if (shards_.across) shards_.across->all_reduce(part, ReduceOp::Sum);
        set_master_grad(g, part, global - comm_.rank() * g.shard);
      }
    }
    pending_.clear();
  }

  std::vector<Group> groups_;
  std::map<std::size_t, ParamRef> ref_;
  std::vector<StageBucket> buckets_;
  detail::BucketClock clock_;
  std::vector<bool> seen_;
  bool any_seen_ = false;
  std::vector<std::size_t> arrival_;  // the first synchronising backward's gradients, in arrival order
  bool planned_by_arrival_ = false;
  bool syncing_ = false;
  bool dirty_ = false;  // the optimizer touched a master since the model was last refreshed from them
  std::vector<std::size_t> owned_;  // parameters some prepared optimizer owns (refreshed from the masters)
  std::set<std::size_t> hooked_;
  std::vector<Pending> pending_;
  GradReadyHooks hooks_;  // last member: removed first, before what the callbacks use
};

}  // namespace

std::unique_ptr<Backend> make_zero_backend(const BackendContext& context, ZeroOptions options) {
  if (context.comm == nullptr) throw UsageError("the zero backend needs a communicator");
  if (context.config != nullptr) detail::refuse_power_sgd(*context.config, options.name);
  if (options.stage != 1 && options.stage != 2) {
    throw UnsupportedOperation(
        fmt::format("zero: make_zero_backend serves stages 1 and 2, got {} (stage 0 is DDP, stage 3 "
                    "make_full_shard_backend)",
                    options.stage));
  }
  auto shards = detail::shard_groups(*context.comm, options.hybrid, options.hybrid_shard_size, options.name);
  return std::make_unique<ZeroBackend>(context, std::move(options), std::move(shards));
}

namespace {

std::optional<c10::ScalarType> save_16bit(const Config& config) {
  if (!config.zero.zero3_save_16bit_model) return std::nullopt;
  // DeepSpeed's zero3_save_16bit_model: a consolidated copy in the training's 16-bit type, for inference.
  return config.mixed_precision == MixedPrecision::Bf16 ? torch::kBFloat16 : torch::kFloat16;
}

std::optional<detail::NvmeOptions> nvme_options(const ZeroConfig& z) {
  if (z.offload_optimizer_device != OffloadDevice::Nvme) return std::nullopt;
  detail::NvmeOptions o;
  o.path = z.offload_optimizer_nvme_path;
  o.buffer_count = z.offload_optimizer_buffer_count;
  o.read_ahead = z.offload_optimizer_pipeline_read;
  o.write_behind = z.offload_optimizer_pipeline_write;
  return o;
}

std::unique_ptr<Backend> make_zero_engine(const BackendContext& context) {
  const auto& z = context.config->zero;
  if (z.stage == 0) return make_ddp_backend(context);
  if (z.stage == 3) {
    FullShardOptions o;
    o.name = "zero";
    o.policy = UnitPolicy::PerModule;  // DeepSpeed gathers each module's own parameters
    o.reduce_every_micro_step = true;
    // Prefetching is on or off here (units are gathered whole): "auto" (hidden_size²) is on, as any size is.
    o.forward_prefetch = o.backward_prefetch = z.stage3_prefetch_bucket_size.value_or(1) > 0;
    o.offload =
        z.offload_param_device == OffloadDevice::Cpu || z.offload_optimizer_device == OffloadDevice::Cpu;
    o.nvme = nvme_options(z);
    if (z.offload_param_device == OffloadDevice::Nvme) {
      detail::NvmeOptions p;
      p.path = z.offload_param_nvme_path;
      p.buffer_count = z.offload_param_buffer_count;
      p.parameters = true;
      o.param_nvme = p;
    }
    o.save_16bit = save_16bit(*context.config);
    o.hpz_size = z.hpz_partition_size;
    return make_full_shard_backend(context, o);
  }
  ZeroOptions o;
  o.stage = z.stage;
  o.bucket_elements = z.reduce_bucket_size;
  o.bucket_from_model = !z.reduce_bucket_size.has_value();
  o.overlap_comm = z.overlap_comm;
  o.sub_group_numel = static_cast<std::int64_t>(
      std::min<std::uint64_t>(z.sub_group_size, std::numeric_limits<std::int64_t>::max()));
  o.offload_optimizer = z.offload_optimizer_device == OffloadDevice::Cpu;
  o.nvme = nvme_options(z);
  o.save_16bit = save_16bit(*context.config);
  return make_zero_backend(context, o);
}

std::vector<std::string> zero_notices(const BackendContext& context) {
  const auto& z = context.config->zero;
  std::vector<std::string> out;
  if (context.device.is_cpu()) {
    const char* why = "this run trains on the CPU, where that state lives already";
    if (z.offload_optimizer_device == OffloadDevice::Cpu)
      out.push_back(fmt::format("deepspeed_config.offload_optimizer_device: cpu has no effect: {}", why));
    if (z.offload_param_device == OffloadDevice::Cpu)
      out.push_back(fmt::format("deepspeed_config.offload_param_device: cpu has no effect: {}", why));
  }
  // Stage 3 honours it: a model built empty (accel::llm::from_pretrained_empty) is filled by load_model,
  // each rank reading only its slices (accel::loads_weights_sharded).
  if (z.zero3_init_flag && z.stage != 3) {
    out.push_back(fmt::format(
        "deepspeed_config.zero3_init_flag: true has no effect: zero_stage {} keeps every parameter whole on "
        "each rank; only stage 3 loads weights sharded (each rank reading the slices it owns)",
        z.stage));
  }
  return out;
}

// Stages 1-2 step the optimizer on CPU masters with offload_optimizer; stage 3 with either offload key.
std::vector<std::string> zero_optimizer_notices(const BackendContext& context,
                                                const torch::optim::Optimizer& optimizer) {
  const auto& z = context.config->zero;
  if (context.device.is_cpu() || z.stage == 0) return {};
  if (z.offload_optimizer_device == OffloadDevice::Cpu)
    return detail::offload_step_notices("deepspeed_config.offload_optimizer_device: cpu", optimizer);
  if (z.stage == 3 && z.offload_param_device == OffloadDevice::Cpu)
    return detail::offload_step_notices("deepspeed_config.offload_param_device: cpu", optimizer);
  return {};
}

}  // namespace

BackendDescriptor zero_backend_descriptor() {
  return detail::describe("zero", make_zero_engine, zero_notices, zero_optimizer_notices,
                          [](const Config& config) { return config.zero.activation_checkpointing; });
}

}  // namespace accel::backends
