#pragma once
// What the two sharding engines share (zero_backend.cpp: ZeRO stages 1-2 and FSDP SHARD_GRAD_OP, the
// masters sharded; full_shard_backend.cpp: ZeRO stage 3 and FSDP FULL_SHARD, the parameters sharded too):
// the groups they shard over, the model's parameters they took over, the parameter trigger, the NVMe tier of
// the optimizer state, and the overrides that only read those.

#include <accel/backend/backend.hpp>
#include <accel/config/config.hpp>

#include "flat_shards.hpp"
#include "grad_reduce.hpp"
#include "grad_sentinel.hpp"
#include "module_state.hpp"
#include "nvme_tier.hpp"
#include "param_trigger.hpp"

#include <fmt/format.h>

#include <cstdlib>
#include <exception>
#include <iostream>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace accel::backends::detail {

/// Base of an engine whose optimizer steps flat, sharded masters. `Options` has `name` (the backend's name in
/// messages), `nvme` (an optional NvmeOptions: the optimizer state's tier) and `save_16bit`.
template <class Options>
class ShardedEngine : public Backend, private TriggerClient {
 public:
  ShardedEngine(const BackendContext& context, Options options, ShardGroups shards)
      : ctx_(context),
        world_(*context.comm),
        shards_(std::move(shards)),
        comm_(*shards_.shard),
        options_(std::move(options)),
        trigger_(*this) {}

  std::string name() const override { return options_.name; }
  // What the config's backend shards, from its fact sheet.
  BackendCapabilities capabilities() const override { return sharding_of(*ctx_.config); }

  std::vector<std::pair<std::string, NamedTensors>> extra_model_files(
      const NamedTensors& full_state) const override {
    return model_16bit_files(full_state, options_.save_16bit);
  }

 protected:
  /// Checks that `optimizer` steps only this model's parameters; with NVMe offload of the optimizer state,
  /// the tier is made with the first optimizer (its sub-groups tagged from `nvme_tag_base` up) and every
  /// later one is checked against it.
  void adopt_optimizer(torch::optim::Optimizer& optimizer, std::size_t nvme_tag_base) {
    check_shardable_optimizer(model_, optimizer, options_.name);
    if (options_.nvme && !nvme_) {
      nvme_ = make_optimizer_offload(*options_.nvme, options_.name, comm_.rank(), optimizer, trigger_,
                                     nvme_tag_base);
    } else if (options_.nvme) {
      make_optimizer_offload_check(optimizer, options_.name);
    }
  }

  /// For the destructor: an optimizer that outlives the accelerator gets its offloaded state back in memory.
  void restore_offloaded_state() noexcept {
    if (!nvme_) return;
    try {
      nvme_->restore_all();
    } catch (const std::exception&) {
    }
  }

  /// The gradients of `flats` (each with a `master`), the parameters outside them (`sharded(index)` false)
  /// as they are.
  template <class Flats, class Sharded>
  GradientTensors gradients_of(const Flats& flats, Sharded sharded) const {
    std::vector<torch::Tensor> masters;
    for (const auto& f : flats)
      masters.push_back(f.master);
    return sharded_gradients(std::move(masters), shards_.copies(), loose_parameters(params_, sharded));
  }

  /// Where each parameter of `flats` (each with `master`, `params`, `offset`, `shard`) lies in the
  /// optimizer's state tensors.
  template <class Flats>
  std::vector<OptimizerTensorLayout> layouts_of(const Flats& flats,
                                                const torch::optim::Optimizer& optimizer) const {
    std::vector<std::pair<torch::Tensor, OptimizerTensorLayout>> known;
    for (const auto& f : flats)
      known.emplace_back(f.master, flat_layout(names_, params_, f.params, f.offset, f.shard, comm_));
    return layouts_for(optimizer, known, options_.name);
  }

  /// An exception cannot leave LibTorch's operator callback (the kernel would run regardless): says what
  /// failed on this rank and aborts it.
  [[noreturn]] void abort_in_callback(const char* what, const std::exception& e) const noexcept {
    std::cerr << fmt::format(
                     "[accelerate-cpp] rank {}: {}: {} failed: {}\n[accelerate-cpp] an error cannot leave "
                     "LibTorch's operator callback: aborting this rank",
                     comm_.rank(), options_.name, what, e.what())
              << std::endl;
    std::abort();
  }

  BackendContext ctx_;
  Communicator& world_;  // every replica: the model's broadcast, buffers, loose gradients
  ShardGroups shards_;   // what the flat vectors are sharded over (and, hybrid, replicated across)
  Communicator& comm_;   // *shards_.shard
  Options options_;
  torch::nn::Module* model_ = nullptr;
  std::vector<std::string> names_;
  std::vector<torch::Tensor> params_;
  GradSentinels sentinels_;  // .grad of the managed parameters after a synchronising backward
  ParameterTrigger trigger_;
  std::unique_ptr<OptimizerStateOffload> nvme_;  // offload_optimizer_device: nvme (uses trigger_)
};

}  // namespace accel::backends::detail
