#include "full_shard_backend.hpp"

#include <accel/errors.hpp>

#include <accel/backend/grad_ready_hooks.hpp>
#include "../common/flat_shards.hpp"
#include "../common/grad_reduce.hpp"
#include "../common/grad_sentinel.hpp"
#include "../common/module_state.hpp"
#include "../common/param_trigger.hpp"
#include "../common/sharded_engine.hpp"
#include "../common/storage_guard.hpp"

#include <ATen/record_function.h>
#include <c10/core/StorageImpl.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/csrc/autograd/graph_task.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <iostream>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <unordered_map>

namespace accel::backends {
namespace {

// Tag of the parameter trigger for operators on a master (the optimizer stepping it); units are tagged by
// their index.
constexpr std::size_t kUnitMasterTag = static_cast<std::size_t>(-1);
// With NVMe offload each master (and its optimizer state) has its own tag, from this one up (above any unit).
constexpr std::size_t kNvmeTagBase = std::size_t{1} << 40;

/// The parameters of one unit that belong to one optimizer group, laid out flat and sharded.
struct Flat {
  std::vector<std::size_t> params;   // indices into FullShardBackend::params_
  std::vector<std::int64_t> offset;  // flat offset of each of `params`
  std::int64_t numel = 0;            // U
  std::int64_t shard = 0;            // S = ceil(U / N)
  torch::Tensor master;              // [S]: this rank's slice, the tensor the user's optimizer updates
  torch::Tensor gathered;            // [N*S] while the unit is gathered (the parameters point into it)
  torch::Tensor secondary;           // hpZ: [N*S/g], this rank's piece of the unit for its group of g
  std::unique_ptr<CollectiveHandle> gathering;
  torch::Tensor grad;  // [N*S] full gradient being accumulated (until it is reduce-scattered)
  std::size_t grads_seen = 0;
  std::size_t trainable = 0;  // parameters with requires_grad: the gradients a complete backward delivers
  bool launched = false;      // reduce-scatter of this backward launched
  // Parameters without gradient (requires_grad false at prepare): gathered with their unit, never reduced,
  // in no optimizer; `master` is this rank's slice of them.
  bool frozen = false;
};

struct Unit {
  std::string name;
  std::vector<std::size_t> params;  // indices into params_, in model order
  std::vector<std::size_t> flats;   // indices into flats_
  bool live = false;                // parameters point into gathered memory
  bool gathering = false;           // an all-gather into `Flat::gathered` is in flight
  int pins = 0;                     // operators running on this unit's parameters
};

struct ParamSlot {
  std::size_t flat = 0;
  std::int64_t offset = 0;
};

// A parameter built without memory (accel::llm::from_pretrained_empty, Accelerate's init_empty_weights): its
// storage has the tensor's size but a null data pointer, and reading it throws. Such a model is taken over
// without the broadcast, each rank's slices start at zero and Accelerator::load_model fills them.
bool memoryless(const torch::Tensor& p) {
  const auto* s = p.unsafeGetTensorImpl()->unsafe_storage().unsafeGetStorageImpl();
  return p.numel() > 0 && s != nullptr &&
         s->nbytes() == static_cast<std::size_t>(p.numel()) * p.element_size() &&
         const_cast<c10::StorageImpl*>(s)->_mutable_data_ptr_no_checks().get() == nullptr;
}

// This rank's slice of a flat vector whose memoryless members read as zeros (detail::flat_slice otherwise).
torch::Tensor deferred_flat_slice(const std::vector<torch::Tensor>& params,
                                  const std::vector<std::size_t>& indices,
                                  const std::vector<std::int64_t>& offsets, std::int64_t shard,
                                  const Communicator& comm, bool to_cpu) {
  torch::NoGradGuard no_grad;
  const auto& first = params[indices.front()];
  const auto begin = comm.rank() * shard;
  auto slice = torch::zeros({shard}, first.options().requires_grad(false));
  for (std::size_t m = 0; m < indices.size(); ++m) {
    const auto& p = params[indices[m]];
    const auto lo = std::max(offsets[m], begin), hi = std::min(offsets[m] + p.numel(), begin + shard);
    if (memoryless(p) || lo >= hi) continue;
    slice.narrow(0, lo - begin, hi - lo).copy_(p.detach().reshape({-1}).narrow(0, lo - offsets[m], hi - lo));
  }
  return to_cpu ? slice.to(torch::kCPU) : slice;
}

class FullShardBackend final : public detail::ShardedEngine<FullShardOptions> {
 public:
  using ShardedEngine::ShardedEngine;

  ~FullShardBackend() override {
    trigger_.stop();
    sentinels_.clear(params_);  // the model goes back to plain LibTorch
    restore_offloaded_state();
    if (param_tier_) {
      try {
        // The shards back in memory for good (the files go with the tier): the optimizer's parameters.
        for (std::size_t fi = 0; fi < flats_.size(); ++fi)
          param_tier_->load(fi);
        stepping_.clear();
      } catch (const std::exception&) {
      }
      param_tier_.reset();  // nothing goes out any more (the gather below must not drop the shards)
    }
    // Leave the whole model behind for code after the accelerator (torch::save at the end of main): every
    // rank destroys its accelerator at the same point, so gathering is collective as usual. Not during
    // unwinding, where another rank may never arrive; the parameters then stay released (and throw on use).
    if (std::uncaught_exceptions() == 0 && !flats_.empty()) {
      try {
        std::lock_guard lock(mu_);
        detail::Quiet quiet;
        gather_all();
        for (auto& unit : units_)
          unit.live = false;  // the parameters now own their gathered memory for good
      } catch (const std::exception&) {
      }
    }
  }

  void prepare_model(torch::nn::Module& model) override {
    model_ = &model;
    std::map<const c10::StorageImpl*, std::string> owner;
    for (auto& [name, p] : take_over(model)) {
      const auto* storage = p.unsafeGetTensorImpl()->unsafe_storage().unsafeGetStorageImpl();
      if (!owner.emplace(storage, name).second) {
        throw UnsupportedOperation(
            fmt::format("{}: parameters '{}' and '{}' share memory (tied weights); sharding parameters needs "
                        "each to own its storage; use stage 2 / SHARD_GRAD_OP for this model",
                        options_.name, owner.at(storage), name));
      }
      names_.push_back(name);
      params_.push_back(p);
    }
    UnitPlanOptions plan;
    plan.policy = options_.policy;
    plan.min_num_params = options_.min_num_params;
    plan.wrap_classes = options_.wrap_classes;
    const auto units = detail::plan_units(model, plan);
    if (plan.policy == UnitPolicy::ClassBased && plan.wrap_classes.empty() && comm_.rank() == 0) {
      std::cerr << "accelerate-cpp: note: fsdp_config.fsdp_transformer_layer_cls_to_wrap is empty: each "
                << detail::repeated_block_class(model) << " is a unit (" << units.size() - 1
                << " of them, the rest in the root unit): the module type repeated in a ModuleList or "
                   "Sequential with the most parameters; name the class there to choose another\n";
    }
    for (const auto& unit : units)
      add_unit(unit.name, unit.params);
    shard_frozen();
  }

  void prepare_optimizer(torch::optim::Optimizer& optimizer) override {
    adopt_optimizer(optimizer, kNvmeTagBase);
    const bool new_tier = options_.param_nvme && !param_tier_;
    if (new_tier) {
      param_tier_ = std::make_unique<detail::NvmeTier>(
          *options_.param_nvme, fmt::format("{} rank {}", options_.name, comm_.rank()));
      if (!param_tier_->notice().empty() && comm_.rank() == 0)
        std::cerr << "[accelerate-cpp] " << param_tier_->notice() << std::endl;
    }
    const auto n = comm_.world_size();
    const auto first_new_flat = flats_.size();
    trigger_.stop();
    detail::Quiet quiet;
    torch::NoGradGuard no_grad;
    for (auto& pg : optimizer.param_groups()) {
      std::vector<bool> in_group(params_.size(), false);
      for (const auto& p : pg.params()) {
        const auto index = index_of(p);
        // A frozen parameter handed to the optimizer (`model->parameters()` after freezing) stays in its
        // frozen shard and out of the optimizer, as DeepSpeed's ZeRO-3 leaves it out: it gets no gradient, so
        // the optimizer would skip it (no state, no weight decay) on one process too.
        if (slot_[index] && flats_[slot_[index]->flat].frozen) continue;
        if (slot_[index]) {
          throw UsageError(
              fmt::format("{}: parameter '{}' is in two optimizer groups", options_.name, names_[index]));
        }
        in_group[index] = true;
        slot_[index] = ParamSlot{};
      }
      std::vector<torch::Tensor> masters;
      for (std::size_t u = 0; u < units_.size(); ++u) {
        Flat f;
        for (auto index : units_[u].params) {
          if (!in_group[index]) continue;
          const auto& p = params_[index];
          check_ownership(index);
          if (!f.params.empty() && (p.scalar_type() != params_[f.params.front()].scalar_type() ||
                                    p.device() != params_[f.params.front()].device())) {
            throw UnsupportedOperation(fmt::format(
                "{}: parameters of one unit and optimizer group must share dtype and device; '{}' differs",
                options_.name, names_[index]));
          }
          *slot_[index] = ParamSlot{flats_.size(), f.numel};
          f.params.push_back(index);
          f.offset.push_back(f.numel);
          f.numel += p.numel();
        }
        if (f.params.empty()) continue;
        f.shard = detail::shard_size(f.numel, n);
        // NVMe offload: the shards stay in CPU memory (or their own files), their optimizer state goes to the
        // files.
        const bool to_cpu = options_.offload || options_.nvme.has_value() || param_tier_;
        f.master = deferred_ ? deferred_flat_slice(params_, f.params, f.offset, f.shard, comm_, to_cpu)
                             : detail::flat_slice(params_, f.params, f.offset, f.shard, comm_, to_cpu);
        if (nvme_) nvme_->add_group(flats_.size(), f.master, &optimizer);
        // With either NVMe tier each shard has its own tag: the optimizer's step on it is seen per shard.
        trigger_.watch(f.master, nvme_ || param_tier_ ? kNvmeTagBase + flats_.size() : kUnitMasterTag);
        masters.push_back(f.master);
        units_[u].flats.push_back(flats_.size());
        flats_.push_back(std::move(f));
      }
      pg.params() = masters;
    }
    // At rest a rank keeps only its slices: free the parameters' memory (tensors, shapes and autograd
    // metadata stay, so the model and its optimizer hooks keep working).
    for (std::size_t fi = first_new_flat; fi < flats_.size(); ++fi) {
      for (auto index : flats_[fi].params) {
        free_storage(index);
        // Frozen parameters (requires_grad false) get no gradient and have no gradient accumulator to hook.
        if (params_[index].requires_grad()) {
          hooks_.add(params_[index], index, [this](std::size_t i) { on_grad(i); });
          flats_[fi].trainable += 1;
        }
      }
      if (param_tier_) param_tier_->evict(fi, {flats_[fi].master});  // the shard to its file
    }
    // The frozen shards (made by prepare_model, before the tier) go to their files too.
    for (std::size_t fi = 0; new_tier && fi < first_new_flat; ++fi) {
      if (flats_[fi].frozen) param_tier_->evict(fi, {flats_[fi].master});
    }
    trigger_.start();
  }

  void before_backward(bool sync) override {
    if (!at::isRecordFunctionEnabled()) {
      throw UsageError(fmt::format(
          "{}: at::RecordFunction is disabled on this thread (a DisableRecordFunctionGuard?); sharded "
          "parameters are gathered through it, so the forward and backward must run with it enabled",
          options_.name));
    }
    std::lock_guard lock(mu_);
    sentinels_.clear(params_);  // autograd would add this backward's gradients into them
    // Reshard after forward: backward gathers each unit again (prefetching in reverse forward order; with hpZ
    // from the secondary copies kept now).
    release_all(/*keep_secondary=*/true);
    if (recording_) {  // the first backward records the units it uses
      backward_use_.assign(units_.size(), false);
      recording_backward_ = true;
    }
    recording_ = false;
    any_seen_ = false;
    // ZeRO reduce-scatters on every micro-step (no full gradient stays resident between micro-steps); FSDP's
    // no_sync keeps accumulating the unsharded gradient locally and communicates on the sync step only.
    syncing_ = sync || options_.reduce_every_micro_step;
    for (auto& f : flats_) {
      f.grads_seen = 0;
      f.launched = false;
    }
    seen_.assign(params_.size(), false);
  }

  void after_backward(bool sync) override {
    std::unique_lock lock(mu_);
    detail::Quiet quiet;
    release_all();
    recording_backward_ = false;
    // A model this backward gave no gradient (the generator during the discriminator's backward) takes no
    // part, unless it holds unit gradients accumulated locally on earlier micro-steps (FSDP's no_sync): on a
    // synchronising backward those are reduced now, into the optimizer's slices, where the user's
    // zero_grad() reaches them as it reaches a DDP model's .grad (issue 29: kept locally they leaked into
    // the next step).
    const bool holds = syncing_ && sync && !any_seen_ && holds_unit_gradients();
    if (syncing_ && (any_seen_ || holds)) {
      std::vector<std::string> unused;
      for (const auto& f : flats_) {
        if (f.launched || f.frozen || !any_seen_) continue;
        for (auto index : f.params) {
          if (!seen_[index] && params_[index].requires_grad()) unused.push_back(names_[index]);
        }
      }
      if (!unused.empty() && !ctx_.config->ddp_find_unused_parameters) {
        finish_reduce();
        syncing_ = false;
        for (auto& f : flats_)
          f.grad = torch::Tensor();  // nothing of this failed backward leaks into the next one
      }
      detail::check_unused(options_.name, unused, ctx_.config->ddp_find_unused_parameters);
      for (std::size_t fi = 0; fi < flats_.size(); ++fi) {
        if (!flats_[fi].launched && !flats_[fi].frozen) launch_reduce(fi);
      }
      finish_reduce();
    }
    const bool took_part = syncing_ && (any_seen_ || holds);
    syncing_ = false;
    if (!sync) return;
    const auto loose = detail::loose_parameters(
        params_, [&](std::size_t index) { return !slot_.empty() && slot_[index].has_value(); });
    if (!took_part && !detail::any_grad(loose)) return;
    detail::end_sync_step(world_, *model_, *ctx_.config, loose);
    // LibTorch's clip_grad_norm_ on the model's parameters must not find "no gradient" and do nothing.
    if (took_part) {
      sentinels_.plant(params_, names_, options_.name,
                       [&](std::size_t i) { return !slot_.empty() && slot_[i].has_value(); });
    }
  }

  GradientTensors gradients() const override {
    std::vector<torch::Tensor> masters;  // the frozen shards get no gradient: not in norms or clipping
    for (const auto& f : flats_) {
      if (!f.frozen) masters.push_back(f.master);
    }
    return detail::sharded_gradients(
        std::move(masters), shards_.copies(),
        detail::loose_parameters(params_, [&](std::size_t index) { return slot_[index].has_value(); }));
  }

  void sync_parameters() override {
    // Units gathered before the user's optimizer.step() hold old values; the step itself releases them (see
    // on_operator_start). A step boundary: the shards the step changed go to their files.
    if (param_tier_) {
      std::lock_guard lock(mu_);
      write_stepped({});
    }
  }

  std::vector<OptimizerTensorLayout> optimizer_layout(
      const torch::optim::Optimizer& optimizer) const override {
    return layouts_of(flats_, optimizer);
  }

  std::vector<torch::Tensor> parameter_buffers() const override {
    std::vector<torch::Tensor> out;
    for (const auto& unit : units_) {
      if (!unit.gathering || unit.live) continue;  // a live unit is counted through its parameters
      for (auto fi : unit.flats)
        out.push_back(flats_[fi].gathered);
    }
    for (const auto& f : flats_) {
      if (f.secondary.defined()) out.push_back(f.secondary);  // hpZ's copies
      if (f.frozen) out.push_back(f.master);                  // frozen shards: no optimizer holds them
    }
    return out;
  }

  std::vector<torch::Tensor> gradient_buffers() const override {
    std::vector<torch::Tensor> out;
    for (const auto& f : flats_) {
      if (f.grad.defined()) out.push_back(f.grad);
    }
    if (pending_) out.push_back(pending_->input);  // a unit gradient being reduce-scattered
    return out;
  }

  NamedTensors model_state() override {
    require_loaded("get_state_dict / save_state");
    std::lock_guard lock(mu_);
    detail::Quiet quiet;
    gather_all();
    NamedTensors out;
    for (const auto& item : model_->named_parameters())
      out.emplace_back(item.key(), item.value().detach().clone());
    for (const auto& item : model_->named_buffers())
      out.emplace_back(item.key(), item.value().detach().clone());
    release_all();
    return out;
  }

  void visit_model_state(const std::function<void(NamedTensors)>& sink) override {
    require_loaded("save_model");
    std::lock_guard lock(mu_);
    detail::Quiet quiet;
    release_all();
    for (std::size_t u = 0; u < units_.size(); ++u) {
      start_gather(u);
      materialise(u);
      NamedTensors piece;
      for (auto index : units_[u].params)
        piece.emplace_back(names_[index], params_[index].detach());
      sink(std::move(piece));
      release(u);
    }
    sink(detail::module_buffers(*model_));
  }

  // A sharded operation: each rank copies into its slices the parts of the parameters they hold, straight
  // from `state` (which load_model maps from the files), and nothing is gathered: no rank holds the whole
  // model, and a model built without memory (empty weights) gets its values here.
  void load_model_state(const std::map<std::string, torch::Tensor>& state) override {
    std::lock_guard lock(mu_);
    detail::Quiet quiet;
    release_all();
    check_state(state);  // every tensor checked before any is copied
    torch::NoGradGuard no_grad;
    for (std::size_t fi = 0; fi < flats_.size(); ++fi) {
      auto& f = flats_[fi];
      if (param_tier_) {
        param_tier_->load(fi);
        param_tier_->mark_changed(fi);
      }
      const auto begin = comm_.rank() * f.shard;
      for (std::size_t m = 0; m < f.params.size(); ++m) {
        const auto index = f.params[m];
        const auto lo = std::max(f.offset[m], begin);
        const auto hi = std::min(f.offset[m] + params_[index].numel(), begin + f.shard);
        const auto it = state.find(names_[index]);
        if (lo >= hi || it == state.end()) continue;  // absent: kept (check_state)
        const auto source = it->second.reshape({-1}).narrow(0, lo - f.offset[m], hi - lo);
        f.master.narrow(0, lo - begin, hi - lo).copy_(source);
      }
      if (param_tier_ && !is_stepping(fi)) param_tier_->evict(fi, {f.master});
    }
    // Trainable parameters outside every optimizer (and frozen views) stay whole on each rank, as they do
    // without sharding.
    for (std::size_t i = 0; i < params_.size(); ++i) {
      if (slot_[i] || state.count(names_[i]) == 0) continue;
      auto& p = params_[i];
      if (memoryless(p)) detail::point_storage_into(p, torch::empty({p.numel()}, p.options()), 0);
      p.detach().copy_(state.at(names_[i]));
    }
    for (const auto& item : model_->named_buffers())
      item.value().detach().copy_(state.at(item.key()));
    unloaded_.assign(params_.size(), false);
  }

  // --- called by the trigger ---

  void on_operator_start(const std::vector<std::size_t>& tags) noexcept override {
    // NVMe offload: the sub-group the optimizer is about to step comes in (the one before goes out); when a
    // unit is used again, the step is over and its last sub-group goes out.
    bool nvme_master = false;
    const bool nvme_tag = std::find_if(tags.begin(), tags.end(), [](std::size_t t) {
                            return t >= kNvmeTagBase && t != kUnitMasterTag;
                          }) != tags.end();
    if (param_tier_) {
      try {
        std::lock_guard lock(mu_);
        if (nvme_tag) {
          step_shards(tags);
        } else {
          write_stepped({});
        }
      } catch (const std::exception& e) {
        abort_in_callback("NVMe offload of the parameter shards", e);
      }
    }
    if (nvme_) {
      try {
        nvme_master = nvme_->on_operator(tags);
        if (!nvme_master && !nvme_tag) nvme_->end_step();
      } catch (const std::exception& e) {
        abort_in_callback("NVMe offload of the optimizer state", e);
      }
    }
    if (nvme_master || (param_tier_ && nvme_tag) ||
        std::find(tags.begin(), tags.end(), kUnitMasterTag) != tags.end()) {
      // The user's optimizer.step() is updating the shards: units gathered before it hold old values.
      // (LibTorch's SGD writes through .data(), which version counters do not see; the storage is the same.)
      std::lock_guard lock(mu_);
      release_all();
      return;
    }
    // The offloaded state read outside a step (save_state holds it in memory). With the shards on NVMe too,
    // such reads share the shards' tags and went through step_shards above: their shards were read and are
    // written again at the next boundary (correct, one extra read and write of them per save_state).
    if (nvme_tag) return;
    touch(tags);
  }

  void hold_optimizer_state(bool hold) override {
    if (nvme_) nvme_->hold(hold);
  }

  void on_operator_end(const std::vector<std::size_t>& tags) noexcept override {
    if (std::find_if(tags.begin(), tags.end(), [](std::size_t t) { return t >= kNvmeTagBase; }) != tags.end())
      return;
    std::lock_guard lock(mu_);
    for (auto u : tags)
      units_[u].pins -= 1;
  }

  /// Makes `used` live before an operator runs (and pins them until it ends); releases the others and
  /// prefetches the next unit. Exceptions cannot leave a RecordFunction callback (LibTorch swallows them and
  /// the kernel would then read freed memory), so a failure ends the process with a message naming the unit.
  void touch(const std::vector<std::size_t>& used) noexcept {
    std::lock_guard lock(mu_);
    try {
      for (auto u : used) {
        for (auto index : units_[u].params) {
          if (unloaded_[index]) throw UsageError(unloaded_message(index, "a forward"));
        }
      }
      for (auto u : used)
        units_[u].pins += 1;
      const bool backward = torch::autograd::get_current_graph_task_id() != -1;
      std::optional<std::size_t> next;
      bool moved = false;
      for (auto u : used) {
        if (current_ && *current_ == u) continue;
        current_ = u;
        moved = true;
        if (recording_ && std::find(order_.begin(), order_.end(), u) == order_.end()) order_.push_back(u);
        if (backward && recording_backward_) backward_use_[u] = true;
        next = prefetch_target(u, backward);
      }
      if (moved) {
        // Release before gathering: the peak stays at the units in use plus the one prefetched.
        for (std::size_t v = 0; v < units_.size(); ++v) {
          auto& unit = units_[v];
          if ((unit.live || unit.gathering) && unit.pins == 0 && (!next || *next != v)) release(v, !backward);
        }
      }
      for (auto u : used)
        materialise(u, backward);
      if (next && !units_[*next].live && !units_[*next].gathering) start_gather(*next, backward);
    } catch (const std::exception& e) {
      std::cerr << fmt::format(
                       "[accelerate-cpp] rank {}: {}: gathering the parameters of unit '{}' failed: {}\n"
                       "[accelerate-cpp] an operator is about to read them, and an error cannot leave "
                       "LibTorch's operator callback: aborting this rank",
                       comm_.rank(), options_.name, used.empty() ? "?" : units_[used.front()].name, e.what())
                << std::endl;
      std::abort();
    }
  }

 private:
  // --- units (planned by common/unit_plan) ---

  void add_unit(const std::string& name, const std::vector<std::size_t>& params) {
    Unit u;
    u.name = name;
    u.params = params;
    for (auto index : u.params)
      trigger_.watch(params_[index], units_.size());
    units_.push_back(std::move(u));
  }

  // detail::take_over_model, except that memoryless parameters (a model built with empty weights, the same
  // ones on every rank) are not broadcast: each rank fills its own slices in load_model_state.
  std::vector<std::pair<std::string, torch::Tensor>> take_over(torch::nn::Module& model) {
    detail::check_same_model_everywhere(world_, model, options_.name);
    std::string flags;
    for (const auto& item : model.named_parameters())
      flags += memoryless(item.value()) ? '1' : '0';
    const auto all = world_.exchange(flags);
    for (std::size_t r = 1; r < all.size(); ++r) {
      if (all[r] != all[0]) {
        throw DistributedError(fmt::format(
            "{}: rank {} built the model with other parameters empty (without memory) than rank 0; build it "
            "the same way on every rank (accel::llm::from_pretrained_empty everywhere, or nowhere)",
            options_.name, r));
      }
    }
    torch::NoGradGuard no_grad;
    std::vector<std::pair<std::string, torch::Tensor>> out;
    for (const auto& item : model.named_parameters()) {
      auto p = item.value();
      const bool empty = flags[out.size()] == '1';
      unloaded_.push_back(empty);
      if (!empty) world_.broadcast(p, 0);
      deferred_ = deferred_ || empty;
      out.emplace_back(item.key(), p);
    }
    for (auto& b : model.buffers())
      world_.broadcast(b, 0);
    return out;
  }

  // detail::check_module_state, except on the first load of a model built without memory, which takes from
  // `state` what it was built without: a parameter built with memory (LoRA adapters added after
  // accel::llm::from_pretrained_empty) that `state` lacks keeps its value.
  void check_state(const std::map<std::string, torch::Tensor>& state) const {
    if (std::find(unloaded_.begin(), unloaded_.end(), true) == unloaded_.end()) {
      detail::check_module_state(*model_, state);
      return;
    }
    auto filled = state;  // the tensors are shared, not copied; the check reads shapes and types only
    for (std::size_t i = 0; i < params_.size(); ++i) {
      if (!unloaded_[i]) filled.emplace(names_[i], params_[i]);
    }
    detail::check_module_state(*model_, filled);
  }

  std::string unloaded_message(std::size_t index, const std::string& what) const {
    return fmt::format(
        "{}: parameter '{}' was built without memory (empty weights) and has not been loaded; {} needs its "
        "values: call accelerator.load_model(model, dir) after prepare (each rank reads the slices it owns)",
        options_.name, names_[index], what);
  }

  void require_loaded(const std::string& what) const {
    for (std::size_t i = 0; i < unloaded_.size(); ++i) {
      if (unloaded_[i]) throw UsageError(unloaded_message(i, what));
    }
  }

  std::size_t index_of(const torch::Tensor& p) const {
    return detail::parameter_index(params_, p, options_.name);
  }

  // DeepSpeed's ZeRO-3 and FSDP shard every parameter, frozen ones too: each unit's parameters without
  // gradient (a LoRA model's base, a frozen teacher) form flat vectors of their own, one per dtype and
  // device, sharded as the optimizer's are, gathered with their unit and never reduced. Frozen views stay
  // whole.
  void shard_frozen() {
    slot_.assign(params_.size(), std::nullopt);
    detail::Quiet quiet;
    torch::NoGradGuard no_grad;
    const bool to_cpu = options_.offload || options_.nvme.has_value() || options_.param_nvme.has_value();
    for (std::size_t u = 0; u < units_.size(); ++u) {
      std::vector<Flat> made;
      for (auto index : units_[u].params) {
        const auto& p = params_[index];
        if (p.requires_grad() || !owns_storage(index)) continue;
        auto same = [&](const Flat& f) {
          const auto& q = params_[f.params.front()];
          return q.scalar_type() == p.scalar_type() && q.device() == p.device();
        };
        auto it = std::find_if(made.begin(), made.end(), same);
        if (it == made.end()) {
          made.emplace_back();
          made.back().frozen = true;
          it = made.end() - 1;
        }
        it->params.push_back(index);
        it->offset.push_back(it->numel);
        it->numel += p.numel();
      }
      for (auto& f : made) {
        f.shard = detail::shard_size(f.numel, comm_.world_size());
        f.master = deferred_ ? deferred_flat_slice(params_, f.params, f.offset, f.shard, comm_, to_cpu)
                             : detail::flat_slice(params_, f.params, f.offset, f.shard, comm_, to_cpu);
        for (std::size_t m = 0; m < f.params.size(); ++m) {
          slot_[f.params[m]] = ParamSlot{flats_.size(), f.offset[m]};
          free_storage(f.params[m]);
        }
        units_[u].flats.push_back(flats_.size());
        flats_.push_back(std::move(f));
      }
    }
    if (!flats_.empty()) trigger_.start();  // a model without optimizer (a frozen teacher) gathers too
  }

  bool owns_storage(std::size_t index) const {
    const auto& p = params_[index];
    return p.is_contiguous() && p.storage_offset() == 0 &&
           p.storage().nbytes() == static_cast<std::size_t>(p.numel()) * p.element_size();
  }

  void check_ownership(std::size_t index) const {
    if (!owns_storage(index)) {
      throw UnsupportedOperation(fmt::format(
          "{}: parameter '{}' does not own its storage (a view of another tensor, or non-contiguous); "
          "sharded parameters must be plain contiguous tensors",
          options_.name, names_[index]));
    }
  }

  // --- memory of the parameters ---

  void free_storage(std::size_t index) {
    detail::release_storage(
        params_[index],
        fmt::format("accelerate-cpp: parameter '{}' is sharded by the {} backend and holds no data at rest; "
                    "read the whole model with accelerator.get_state_dict(model) (on every rank) or "
                    "save_state, or save after the accelerator is destroyed (it gathers the model then)",
                    names_[index], options_.name));
  }

  // `backward`: with hpZ copies of this unit (made after its forward), gathers inside the secondary group.
  void start_gather(std::size_t u, bool backward = false) {
    detail::Quiet quiet;
    auto& unit = units_[u];
    const bool secondary = backward && shards_.secondary &&
                           std::all_of(unit.flats.begin(), unit.flats.end(),
                                       [&](std::size_t fi) { return flats_[fi].secondary.defined(); });
    for (auto fi : unit.flats) {
      auto& f = flats_[fi];
      const auto& first = params_[f.params.front()];
      f.gathered = torch::empty({f.shard * comm_.world_size()}, first.options().requires_grad(false));
      if (secondary) {
        f.gathering = shards_.secondary->all_gather_async(f.gathered, f.secondary);
        continue;
      }
      if (param_tier_) param_tier_->load(fi);  // read ahead by the unit gathered before, where it could
      auto input = f.master.device() == first.device() ? f.master : f.master.to(first.device());
      f.gathering = comm_.all_gather_async(f.gathered, input);
    }
    unit.gathering = true;
    // The shards of the unit gathered after this one start coming in from their files.
    if (param_tier_ && !secondary) {
      if (const auto next = prefetch_target(u, backward)) {
        for (auto fi : units_[*next].flats)
          param_tier_->prefetch(fi);
      }
    }
  }

  // NVMe parameter offload: a unit's all-gather is done; its shards' memory goes (their files have them),
  // except a shard the optimizer's step is changing.
  void gathered(std::size_t fi) {
    if (param_tier_ && !is_stepping(fi)) param_tier_->drop(fi);
  }

  bool is_stepping(std::size_t fi) const {
    return std::find(stepping_.begin(), stepping_.end(), fi) != stepping_.end();
  }

  // NVMe parameter offload: an operator (the user's optimizer step) reads or writes the shards tagged in
  // `tags`: they come in, marked changed, and the shards an earlier operator of the step changed go out to
  // their files (one shard's step at a time, as the optimizer steps them).
  void step_shards(const std::vector<std::size_t>& tags) {
    std::vector<std::size_t> now;
    for (auto t : tags) {
      if (t < kNvmeTagBase || t == kUnitMasterTag) continue;
      const auto fi = t - kNvmeTagBase;
      if (fi < flats_.size()) now.push_back(fi);
    }
    if (now.empty()) return;
    if (now.size() > 1 && !warned_multi_shard_) {
      warned_multi_shard_ = true;
      std::cerr
          << fmt::format(
                 "[accelerate-cpp] {} rank {}: the optimizer updates {} parameter shards in one call (a "
                 "fused multi-tensor step), so with offload_param_device: nvme they are all in memory "
                 "during optimizer.step(); LibTorch's torch::optim::AdamW/Adam step one tensor at a time "
                 "and keep one shard in memory",
                 options_.name, comm_.rank(), now.size())
          << std::endl;
    }
    write_stepped(now);
    for (auto fi : now) {
      param_tier_->load(fi);
      param_tier_->mark_changed(fi);
      if (!is_stepping(fi)) stepping_.push_back(fi);
    }
  }

  // Writes the shards the step changed, except `keep`, to their files and frees their memory.
  void write_stepped(const std::vector<std::size_t>& keep) {
    std::vector<std::size_t> kept;
    for (auto fi : stepping_) {
      if (std::find(keep.begin(), keep.end(), fi) != keep.end()) {
        kept.push_back(fi);
        continue;
      }
      param_tier_->evict(fi, {flats_[fi].master});
    }
    stepping_ = std::move(kept);
  }

  void materialise(std::size_t u, bool backward = false) {
    auto& unit = units_[u];
    if (unit.live) return;
    if (!unit.gathering) start_gather(u, backward);
    detail::Quiet quiet;
    for (auto fi : unit.flats) {
      auto& f = flats_[fi];
      f.gathering->wait();
      f.gathering.reset();
      gathered(fi);
      // The parameters' storages point into the gathered buffer, which they keep alive.
      for (std::size_t m = 0; m < f.params.size(); ++m)
        detail::point_storage_into(params_[f.params[m]], f.gathered, f.offset[m]);
    }
    unit.gathering = false;
    unit.live = true;
  }

  // `keep_secondary`: hpZ, released after its forward (the values are the step's): this rank keeps its piece
  // of the unit for its secondary group, from which backward gathers it.
  void release(std::size_t u, bool keep_secondary = false) {
    auto& unit = units_[u];
    detail::Quiet quiet;
    if (keep_secondary && shards_.secondary && unit.live && torch::GradMode::is_enabled()) {
      const auto g = shards_.secondary->world_size();
      for (auto fi : unit.flats) {
        auto& f = flats_[fi];
        const auto piece = f.gathered.numel() / g;
        f.secondary = f.gathered.narrow(0, shards_.secondary->rank() * piece, piece).clone();
      }
    }
    if (unit.gathering) {
      for (auto fi : unit.flats) {
        auto& f = flats_[fi];
        if (f.gathering) {
          f.gathering->wait();  // every rank started it: finish before dropping the buffer
          gathered(fi);
        }
        f.gathering.reset();
      }
      unit.gathering = false;
    }
    for (auto fi : unit.flats) {
      for (auto index : flats_[fi].params)
        free_storage(index);
      flats_[fi].gathered = torch::Tensor();
    }
    unit.live = false;
    if (current_ && *current_ == u) current_.reset();
  }

  // `keep_secondary` only between a forward and its backward (before_backward); everywhere else the values
  // may change next (the optimizer steps, a state is loaded) or the backward is over: hpZ's copies go.
  void release_all(bool keep_secondary = false) {
    for (std::size_t u = 0; u < units_.size(); ++u) {
      if (units_[u].live || units_[u].gathering) release(u, keep_secondary);
    }
    if (!keep_secondary) {
      for (auto& f : flats_)
        f.secondary = torch::Tensor();
    }
  }

  void gather_all() {
    for (std::size_t u = 0; u < units_.size(); ++u) {
      if (!units_[u].live && !units_[u].gathering) start_gather(u);
    }
    for (std::size_t u = 0; u < units_.size(); ++u)
      materialise(u);
  }

  std::optional<std::size_t> prefetch_target(std::size_t u, bool backward) const {
    if (recording_) return std::nullopt;
    const auto it = std::find(order_.begin(), order_.end(), u);
    if (it == order_.end()) return std::nullopt;
    const auto pos = static_cast<std::size_t>(it - order_.begin());
    if (!backward && options_.forward_prefetch && pos + 1 < order_.size()) return order_[pos + 1];
    // In backward, skip the units the first backward never used and that hold nothing trainable: a frozen
    // embedding (LoRA) comes after the first block in reverse order, and no operator of backward reads it.
    // DeepSpeed never fetches such a module in backward (its pre-backward hook runs only for outputs that
    // need a gradient), nor does PyTorch's FSDP prefetch it; gathered, it was a unit whole for nothing at
    // the end of every backward (Qwen2.5-1.5B: 0.93 GB; issue 51).
    for (auto k = pos; backward && options_.backward_prefetch && k > 0; --k) {
      const auto v = order_[k - 1];
      if (recording_backward_ || v >= backward_use_.size() || backward_use_[v] || trains(v)) return v;
    }
    return std::nullopt;
  }

  // Some parameter of unit u gets a gradient.
  bool trains(std::size_t u) const {
    return std::any_of(units_[u].flats.begin(), units_[u].flats.end(),
                       [&](std::size_t fi) { return !flats_[fi].frozen; });
  }

  // --- gradients ---

  void on_grad(std::size_t index) {
    std::lock_guard lock(mu_);
    detail::Quiet quiet;
    torch::NoGradGuard no_grad;
    auto& p = params_[index];
    const auto& slot = *slot_[index];
    auto& f = flats_[slot.flat];
    if (p.grad().defined()) {
      if (!f.grad.defined()) f.grad = torch::zeros({f.shard * comm_.world_size()}, p.grad().options());
      f.grad.narrow(0, slot.offset, p.numel()).add_(p.grad().reshape({-1}));
    }
    p.mutable_grad() = torch::Tensor();  // the full gradient lives on only in the flat buffer
    if (!syncing_ || seen_[index]) return;
    any_seen_ = true;
    seen_[index] = true;
    f.grads_seen += 1;
    if (f.grads_seen == f.trainable) launch_reduce(slot.flat);
  }

  struct PendingReduce {
    std::size_t flat;
    torch::Tensor input;
    torch::Tensor out;
    std::unique_ptr<CollectiveHandle> work;
  };

  bool holds_unit_gradients() const {
    for (const auto& f : flats_) {
      if (f.trainable > 0 && f.grad.defined()) return true;
    }
    return false;
  }

  void launch_reduce(std::size_t fi) {
    detail::Quiet quiet;
    finish_reduce();  // one reduce-scatter in flight: it overlaps the next unit's backward
    auto& f = flats_[fi];
    const auto& first = params_[f.params.front()];
    if (!f.grad.defined()) f.grad = torch::zeros({f.shard * comm_.world_size()}, first.options());
    PendingReduce pending{fi, f.grad, torch::empty({f.shard}, f.grad.options()), nullptr};
    pending.work = detail::reduce_scatter_grads(comm_, pending.out, f.grad,
                                                detail::wire_dtype(ctx_.config->ddp_comm_hook));
    f.grad = torch::Tensor();  // the handle keeps it until the collective finished
    f.launched = true;
    pending_ = std::move(pending);
  }

  void finish_reduce() {
    if (!pending_) return;
    detail::Quiet quiet;
    pending_->work->wait();
    auto& f = flats_[pending_->flat];
    // Hybrid sharding: the shard, summed over this machine, is summed over the machines holding it too.
    if (shards_.across) shards_.across->all_reduce(pending_->out, ReduceOp::Sum);
    pending_->out.div_(world_.world_size());
    // Accumulates, as autograd does: earlier micro-steps' slices (restored by the accelerator) add up.
    auto reduced = pending_->out.to(f.master.device());
    auto& grad = f.master.mutable_grad();
    grad = grad.defined() ? grad.add_(reduced) : reduced;
    pending_.reset();
  }

  std::vector<Unit> units_;
  std::vector<Flat> flats_;
  std::vector<std::optional<ParamSlot>> slot_;
  std::recursive_mutex mu_;  // unit state: operators may run on several threads
  std::optional<std::size_t> current_;
  std::vector<std::size_t> order_;  // units in the order the first forward used them
  bool recording_ = true;
  // The units the first backward used (by unit), recorded while recording_backward_.
  std::vector<bool> backward_use_;
  bool recording_backward_ = false;
  bool syncing_ = false;
  bool any_seen_ = false;   // some gradient of this model arrived in this backward
  std::vector<bool> seen_;  // gradient arrived in this sync backward, by parameter index
  std::optional<PendingReduce> pending_;
  std::unique_ptr<detail::NvmeTier> param_tier_;  // offload_param_device: nvme: one group per flat
  std::vector<std::size_t> stepping_;             // flats the optimizer's step has changed in memory
  bool warned_multi_shard_ = false;
  std::vector<bool> unloaded_;  // by parameter: built without memory, not loaded yet
  bool deferred_ = false;       // some parameter was built without memory
  GradReadyHooks hooks_;        // last member: removed first, before what the callbacks use
};

}  // namespace

std::unique_ptr<Backend> make_full_shard_backend(const BackendContext& context, FullShardOptions options) {
  if (context.comm == nullptr)
    throw UsageError(fmt::format("the {} backend needs a communicator", options.name));
  if (context.config != nullptr) detail::refuse_power_sgd(*context.config, options.name);
  auto shards = detail::shard_groups(*context.comm, options.hybrid, options.hybrid_shard_size, options.name);
  shards.secondary = detail::secondary_groups(*shards.shard, options.hpz_size, options.name, *context.comm);
  return std::make_unique<FullShardBackend>(context, std::move(options), std::move(shards));
}

}  // namespace accel::backends
