#include "zero_backend.hpp"

#include <accel/errors.hpp>

#include "../common/grad_hooks.hpp"
#include "../common/grad_utils.hpp"
#include "../ddp/ddp_backend.hpp"
#include "full_shard_backend.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <deque>

namespace accel::backends {
namespace {

/// One optimizer parameter group laid out flat and sharded.
struct Group {
  std::vector<std::size_t> params;   // indices into ZeroBackend::params_
  std::vector<std::int64_t> offset;  // flat offset of each of `params`
  std::int64_t numel = 0;            // P of this group
  std::int64_t shard = 0;            // S = ceil(P / N)
  torch::Tensor master;              // [S]: this rank's slice, the tensor the optimizer updates
};

/// Stage-2 bucket: a contiguous flat range [begin, end) of one group.
struct Bucket {
  std::size_t group = 0;
  std::vector<std::size_t> members;  // indices into Group::params
  std::int64_t begin = 0, end = 0;
  std::size_t ready = 0;
  torch::Tensor filling;  // [end - begin]: gradients copied in as they arrive (each freed at once)
};

struct ParamRef {
  std::size_t group = 0, member = 0, bucket = 0;
};

class ZeroBackend final : public Backend {
 public:
  ZeroBackend(const BackendContext& context, ZeroOptions options)
      : ctx_(context), comm_(*context.comm), options_(std::move(options)) {}

  std::string name() const override { return options_.name; }
  bool shards_optimizer_state() const override { return true; }

  void prepare_model(torch::nn::Module& model) override {
    if (model_ != nullptr) throw UsageError(fmt::format("the {} backend prepares one model", options_.name));
    model_ = &model;
    for (auto& [name, p] : detail::take_over_model(comm_, model, options_.name)) {
      names_.push_back(name);
      params_.push_back(p);
    }
  }

  void prepare_optimizer(torch::optim::Optimizer& optimizer) override {
    detail::check_shardable_optimizer(model_, optimizer, options_.name);
    const auto n = comm_.world_size();
    for (auto& pg : optimizer.param_groups()) {
      Group g;
      for (const auto& p : pg.params()) {
        const auto index = index_of(p);
        if (ref_.count(index) != 0) {
          throw UsageError(
              fmt::format("{}: parameter '{}' is in two optimizer groups", options_.name, names_[index]));
        }
        ref_[index] = ParamRef{groups_.size(), g.params.size(), 0};
        g.params.push_back(index);
        g.offset.push_back(g.numel);
        g.numel += p.numel();
      }
      if (g.params.empty()) continue;
      g.shard = detail::shard_size(g.numel, n);
      const auto& first = params_[g.params.front()];
      for (auto index : g.params) {
        const auto& p = params_[index];
        if (p.scalar_type() != first.scalar_type() || p.device() != first.device()) {
          throw UnsupportedOperation(
              fmt::format("{}: parameters of one optimizer group must share dtype and device; '{}' differs",
                          options_.name, names_[index]));
        }
      }
      // Offload: the master slice (and so the optimizer state, created like it) lives in CPU memory.
      g.master = detail::flat_slice(params_, g.params, g.offset, g.shard, comm_, options_.offload_optimizer);
      pg.params() = {g.master};
      groups_.push_back(std::move(g));
    }
    build_buckets();
    install_hooks();
  }

  void before_backward(bool sync) override {
    if (dirty_) {
      throw UsageError(fmt::format(
          "{}: optimizer.step() updated the sharded parameters but the model was not refreshed before this "
          "forward; iterate a data loader from accelerator.prepare_data_loader() (it refreshes at every "
          "batch), "
          "or call accelerator.sync_parameters() after optimizer.step()",
          options_.name));
    }
    syncing_ = sync;
    if (!sync) return;
    seen_.assign(params_.size(), false);
    for (auto& b : buckets_) {
      b.ready = 0;
      b.filling = torch::Tensor();
    }
    next_bucket_ = 0;
    pending_.clear();
  }

  void after_backward(bool sync) override {
    if (!sync) return;
    syncing_ = false;
    if (options_.stage == 1) {
      reduce_scatter_all();
    } else {
      std::vector<std::string> unused;
      for (const auto& [index, r] : ref_) {
        if (!seen_[index] && params_[index].requires_grad()) unused.push_back(names_[index]);
      }
      if (!unused.empty() && !ctx_.config->ddp_find_unused_parameters) {
        throw UsageError(
            fmt::format("{}: parameter(s) {} received no gradient in this backward; make every "
                        "parameter take part in the loss, or set `ddp_find_unused_parameters: true` "
                        "to reduce them as zeros",
                        options_.name, fmt::join(unused, ", ")));
      }
      for (const auto& [index, r] : ref_) {
        if (!seen_[index]) mark_ready(index);
      }
      finish_pending();
      // A rank whose slice is only padding received nothing: give it zeros, so that every rank's optimizer
      // steps (and holds state for) the same tensors.
      for (auto& g : groups_) {
        if (!g.master.grad().defined()) g.master.mutable_grad() = torch::zeros_like(g.master);
      }
    }
    // Gradients of parameters no optimizer updates are not needed either.
    for (auto& p : params_)
      p.mutable_grad() = torch::Tensor();
    // The user's optimizer.step() comes next and updates the masters. Version counters cannot tell us when:
    // LibTorch's SGD updates through .data(), which does not bump them (seen on 2.11).
    dirty_ = true;
  }

  double clip_grad_norm(double max_norm, double norm_type) override {
    std::vector<torch::Tensor> masters;
    for (const auto& g : groups_)
      masters.push_back(g.master);
    return detail::clip_sharded_grad_norm(comm_, masters, max_norm, norm_type, options_.name);
  }

  std::vector<OptimizerTensorLayout> optimizer_layout(
      const torch::optim::Optimizer& optimizer) const override {
    std::vector<std::pair<torch::Tensor, OptimizerTensorLayout>> known;
    for (const auto& g : groups_)
      known.emplace_back(g.master, detail::flat_layout(names_, params_, g.params, g.offset, g.shard, comm_));
    return detail::layouts_for(optimizer, known, options_.name);
  }

  void sync_parameters() override {
    if (!dirty_) return;
    torch::NoGradGuard no_grad;
    const auto n = comm_.world_size();
    for (auto& g : groups_) {
      const auto& first = params_[g.params.front()];
      const auto slice = g.master.device() == first.device() ? g.master : g.master.to(first.device());
      // Gathered in chunks of about gather_bucket_bytes, two in flight: the copy of one chunk into the
      // parameters overlaps the transfer of the next, and no whole-model buffer is ever allocated.
      const auto per_rank = std::clamp<std::int64_t>(
          static_cast<std::int64_t>(options_.gather_bucket_bytes / (first.element_size() * n)), 1, g.shard);
      struct Chunk {
        std::int64_t at, len;
        torch::Tensor out;
        std::unique_ptr<CollectiveHandle> work;
      };
      std::deque<Chunk> in_flight;
      auto finish = [&](Chunk& c) {
        c.work->wait();
        for (int r = 0; r < n; ++r)
          write_flat_range(g, r * g.shard + c.at, c.out.narrow(0, r * c.len, c.len));
      };
      for (std::int64_t at = 0; at < g.shard; at += per_rank) {
        const auto len = std::min(per_rank, g.shard - at);
        if (in_flight.size() == 2) {
          finish(in_flight.front());
          in_flight.pop_front();
        }
        Chunk c{at, len, torch::empty({n * len}, first.options().requires_grad(false)), nullptr};
        c.work = comm_.all_gather_async(c.out, slice.narrow(0, at, len));
        in_flight.push_back(std::move(c));
      }
      for (auto& c : in_flight)
        finish(c);
    }
    dirty_ = false;
  }

  std::vector<torch::Tensor> gradient_buffers() const override {
    std::vector<torch::Tensor> out;
    for (const auto& pending : pending_)
      out.push_back(pending.buffer);  // a bucket of gradients being reduced
    return out;
  }

  NamedTensors model_state() override {
    sync_parameters();
    return detail::module_state(*model_);
  }

  void load_model_state(const std::map<std::string, torch::Tensor>& state) override {
    detail::load_module_state(*model_, state);
    // The masters are the optimizer's copy of the weights: reload this rank's slices from the model.
    torch::NoGradGuard no_grad;
    for (auto& g : groups_)
      g.master.copy_(detail::flat_slice(params_, g.params, g.offset, g.shard, comm_));
    dirty_ = false;
  }

  void on_grad_ready(std::size_t index) {
    if (!syncing_ || options_.stage != 2 || ref_.count(index) == 0 || seen_[index]) return;
    mark_ready(index);
  }

 private:
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

  // Copies `values` into the parameters covering flat positions [begin, begin + values.numel()).
  void write_flat_range(const Group& g, std::int64_t begin, const torch::Tensor& values) {
    for_flat_range(
        g, begin, begin + values.numel(), [&](std::size_t index, auto in_param, auto in_range, auto len) {
          params_[index].view({-1}).narrow(0, in_param, len).copy_(values.narrow(0, in_range, len));
        });
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

  void set_master_grad(Group& g, const torch::Tensor& reduced_slice, std::int64_t at) {
    auto& grad = g.master.mutable_grad();
    if (!grad.defined()) grad = torch::zeros_like(g.master);
    grad.narrow(0, at, reduced_slice.numel()).copy_(reduced_slice).div_(comm_.world_size());  // no temporary
  }

  // Stage 1: one reduce-scatter of each group's whole padded gradient.
  void reduce_scatter_all() {
    torch::NoGradGuard no_grad;
    const auto n = comm_.world_size();
    for (auto& g : groups_) {
      const auto& first = params_[g.params.front()];
      for (std::size_t m = 0; m < g.params.size(); ++m) {
        if (!params_[g.params[m]].grad().defined() && params_[g.params[m]].requires_grad() &&
            !ctx_.config->ddp_find_unused_parameters) {
          throw UsageError(
              fmt::format("{}: parameter {} received no gradient in this backward; set "
                          "`ddp_find_unused_parameters: true` to reduce it as zeros",
                          options_.name, names_[g.params[m]]));
        }
      }
      // Chunks of about bucket_bytes, each rank's k-th piece side by side, two reduce-scatters in flight;
      // no whole-model gradient copy is made.
      const auto per_rank = std::clamp<std::int64_t>(
          static_cast<std::int64_t>(options_.bucket_bytes / (first.element_size() * n)), 1, g.shard);
      auto grad = torch::empty({g.shard}, first.options().requires_grad(false));
      std::deque<std::unique_ptr<CollectiveHandle>> in_flight;
      for (std::int64_t at = 0; at < g.shard; at += per_rank) {
        const auto len = std::min(per_rank, g.shard - at);
        if (in_flight.size() == 2) {
          in_flight.front()->wait();
          in_flight.pop_front();
        }
        auto input = torch::zeros({n * len}, first.options().requires_grad(false));
        for (int r = 0; r < n; ++r)
          read_flat_range(g, r * g.shard + at, input.narrow(0, r * len, len));
        in_flight.push_back(comm_.reduce_scatter_async(grad.narrow(0, at, len), input));
      }
      for (auto& w : in_flight)
        w->wait();
      for (auto index : g.params)
        params_[index].mutable_grad() = torch::Tensor();
      g.master.mutable_grad() = torch::Tensor();
      set_master_grad(g, grad.to(g.master.device()), 0);
    }
  }

  // Stage 2: buckets of contiguous flat ranges, built in reverse parameter order (the order backward produces
  // gradients in), launched strictly in bucket order so that every rank issues the same collectives.
  void build_buckets() {
    if (options_.stage != 2) return;
    for (std::size_t gi = groups_.size(); gi-- > 0;) {
      auto& g = groups_[gi];
      Bucket b;
      b.group = gi;
      std::uint64_t bytes = 0;
      for (std::size_t m = g.params.size(); m-- > 0;) {
        const auto& p = params_[g.params[m]];
        const auto p_bytes = static_cast<std::uint64_t>(p.numel()) * p.element_size();
        if (!b.members.empty() && bytes + p_bytes > options_.bucket_bytes) {
          close_bucket(b);
          b = Bucket{};
          b.group = gi;
          bytes = 0;
        }
        b.members.push_back(m);
        bytes += p_bytes;
      }
      if (!b.members.empty()) close_bucket(b);
    }
  }

  void close_bucket(Bucket& b) {
    const auto& g = groups_[b.group];
    const auto first = b.members.back(), last = b.members.front();  // members are in reverse order
    b.begin = g.offset[first];
    b.end = g.offset[last] + params_[g.params[last]].numel();
    for (auto m : b.members)
      ref_[g.params[m]].bucket = buckets_.size();
    buckets_.push_back(std::move(b));
  }

  void install_hooks() {
    if (options_.stage != 2) return;
    for (const auto& [index, r] : ref_) {
      // Frozen parameters have no gradient accumulator; their bucket slots are filled at the end of backward.
      if (params_[index].requires_grad())
        hooks_.add(params_[index], index, [this](std::size_t i) { on_grad_ready(i); });
    }
  }

  void mark_ready(std::size_t index) {
    seen_[index] = true;
    torch::NoGradGuard no_grad;
    auto& b = buckets_[ref_.at(index).bucket];
    auto& g = groups_[b.group];
    auto& p = params_[index];
    // Copy on arrival and free the gradient at once: a rank holds the bucket being filled, not its gradients
    // plus a copy.
    if (!b.filling.defined()) b.filling = torch::zeros({b.end - b.begin}, p.options().requires_grad(false));
    if (p.grad().defined()) {
      b.filling.narrow(0, g.offset[ref_.at(index).member] - b.begin, p.numel()).copy_(p.grad().reshape({-1}));
    }
    p.mutable_grad() = torch::Tensor();
    b.ready += 1;
    while (next_bucket_ < buckets_.size() &&
           buckets_[next_bucket_].ready == buckets_[next_bucket_].members.size()) {
      launch(next_bucket_++);
    }
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
      auto work = comm_.reduce_async(part, r);
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
        if (owner == comm_.rank())
          set_master_grad(g, part.to(g.master.device()), global - comm_.rank() * g.shard);
      }
    }
    pending_.clear();
  }

  BackendContext ctx_;
  Communicator& comm_;
  ZeroOptions options_;
  torch::nn::Module* model_ = nullptr;
  std::vector<std::string> names_;
  std::vector<torch::Tensor> params_;
  std::vector<Group> groups_;
  std::map<std::size_t, ParamRef> ref_;
  std::vector<Bucket> buckets_;
  std::vector<bool> seen_;
  std::size_t next_bucket_ = 0;
  bool syncing_ = false;
  bool dirty_ = false;  // a sync backward happened since the model was last refreshed from the masters
  std::vector<Pending> pending_;
  detail::GradReadyHooks hooks_;  // last member: removed first, before what the callbacks use
};

}  // namespace

std::unique_ptr<Backend> make_zero_backend(const BackendContext& context, ZeroOptions options) {
  if (context.comm == nullptr) throw UsageError("the zero backend needs a communicator");
  if (options.stage != 1 && options.stage != 2) {
    throw UnsupportedOperation(
        fmt::format("zero: make_zero_backend serves stages 1 and 2, got {} (stage 0 is DDP, stage 3 "
                    "make_full_shard_backend)",
                    options.stage));
  }
  return std::make_unique<ZeroBackend>(context, std::move(options));
}

std::unique_ptr<Backend> make_zero_backend_from_config(const BackendContext& context) {
  const auto& z = context.config->zero;
  if (z.stage == 0) return make_ddp_backend(context);
  if (z.stage == 3) {
    FullShardOptions o;
    o.name = "zero";
    o.policy = UnitPolicy::PerModule;  // DeepSpeed gathers each module's own parameters
    o.reduce_every_micro_step = true;
    o.forward_prefetch = o.backward_prefetch = z.stage3_prefetch_bucket_size > 0;
    o.offload =
        z.offload_param_device == OffloadDevice::Cpu || z.offload_optimizer_device == OffloadDevice::Cpu;
    return make_full_shard_backend(context, o);
  }
  ZeroOptions o;
  o.stage = z.stage;
  o.bucket_bytes = z.reduce_bucket_size;
  o.overlap_comm = z.overlap_comm;
  o.gather_bucket_bytes = z.allgather_bucket_size;
  o.offload_optimizer = z.offload_optimizer_device == OffloadDevice::Cpu;
  return make_zero_backend(context, o);
}

std::unique_ptr<Backend> make_fsdp_backend_from_config(const BackendContext& context) {
  const auto& f = context.config->fsdp;
  switch (f.sharding_strategy) {
    case ShardingStrategy::NoShard:
      return make_ddp_backend(context);
    case ShardingStrategy::ShardGradOp: {
      ZeroOptions o;
      o.stage = 2;
      o.bucket_bytes = static_cast<std::uint64_t>(context.config->ddp_bucket_cap_mb * 1024 * 1024);
      o.gather_bucket_bytes = o.bucket_bytes;
      o.offload_optimizer = f.offload_params;
      o.name = "fsdp";
      return make_zero_backend(context, o);
    }
    case ShardingStrategy::FullShard: {
      FullShardOptions o;
      o.name = "fsdp";
      switch (f.auto_wrap_policy) {
        case AutoWrapPolicy::PerChildWrap:
          o.policy = UnitPolicy::PerChild;
          break;
        case AutoWrapPolicy::SizeBasedWrap:
          o.policy = UnitPolicy::SizeBased;
          break;
        case AutoWrapPolicy::TransformerBasedWrap:
          o.policy = UnitPolicy::ClassBased;
          break;
        case AutoWrapPolicy::NoWrap:
          o.policy = UnitPolicy::Whole;
          break;
      }
      o.min_num_params = f.min_num_params;
      std::string names = f.transformer_layer_cls_to_wrap;
      for (std::size_t at = 0; at <= names.size();) {
        const auto comma = std::min(names.find(',', at), names.size());
        auto name = names.substr(at, comma - at);
        name.erase(0, name.find_first_not_of(' '));
        name.erase(name.find_last_not_of(' ') + 1);
        if (!name.empty()) o.wrap_classes.push_back(name);
        at = comma + 1;
      }
      o.forward_prefetch = f.forward_prefetch;
      o.backward_prefetch = f.backward_prefetch != BackwardPrefetch::NoPrefetch;
      o.offload = f.offload_params;
      return make_full_shard_backend(context, o);
    }
  }
  throw UnsupportedOperation("fsdp: unknown sharding strategy");
}

}  // namespace accel::backends
