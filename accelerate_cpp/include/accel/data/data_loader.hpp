#pragma once
/// \file data_loader.hpp
/// The data loader returned by `Accelerator::prepare_data_loader`: shards batches across ranks with Hugging
/// Face Accelerate's semantics, shuffles identically on every rank (reseeded per epoch with `seed + epoch`),
/// moves batches to the accelerator's device, remembers its position for `save_state`, and tells the
/// accelerator when it yields the last batch of an epoch (gradients always synchronise there).

#include <torch/arg.h>
#include <torch/data/example.h>
#include <torch/types.h>

#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <future>
#include <memory>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

namespace accel {

/// Options of a prepared data loader. Mirrors `torch::data::DataLoaderOptions` plus Accelerate's knobs.
struct DataLoaderOptions {
  DataLoaderOptions() = default;
  /* implicit */ DataLoaderOptions(std::size_t batch_size) : batch_size_(batch_size) {}
  /// Per-rank batch size (or the global one with `split_batches`). Example:
  /// `DataLoaderOptions(64).shuffle(true)`.
  TORCH_ARG(std::size_t, batch_size) = 1;
  /// Shuffle each epoch with the seed `seed + epoch`, identically on every rank.
  TORCH_ARG(bool, shuffle) = false;
  /// Drop the last incomplete round of batches instead of completing it.
  TORCH_ARG(bool, drop_last) = false;
  /// Base seed of the shuffling (default: the accelerator's seed, else 0).
  TORCH_ARG(std::optional<std::uint64_t>, seed);
  /// Override the config's `even_batches` / `split_batches` for this loader.
  TORCH_ARG(std::optional<bool>, even_batches);
  TORCH_ARG(std::optional<bool>, split_batches);
  /// Background threads building the next batches (`get_batch`) while the loop trains, as
  /// `torch::data::DataLoaderOptions::workers`: `workers` batches ahead, handed out in the same order as
  /// without them. `get_batch` is then called from those threads, so it must be safe to call concurrently
  /// (as for LibTorch's own loader workers), and random draws inside it (augmentation from the global
  /// generator) interleave with the training thread's: batches stay the same only for a deterministic
  /// `get_batch`, as with LibTorch's workers. 0 builds each batch when the loop asks for it.
  TORCH_ARG(std::size_t, workers) = 0;
  /// On a CUDA device: build batches in page-locked (pinned) memory and copy them to the GPU without blocking
  /// (PyTorch's `pin_memory=True`). No effect on the CPU.
  TORCH_ARG(bool, pin_memory) = false;
};

namespace detail {

/// The batches of sample indices one rank sees in one epoch.
struct ShardPlan {
  std::vector<std::vector<std::size_t>> batches;
  /// Samples in the epoch (the dataset size, minus what drop_last dropped): `gather_for_metrics` keeps
  /// exactly this many rows over the whole epoch.
  std::size_t total_samples = 0;
  /// Rows of the global last round that are real samples rather than wrap-around duplicates (0: none
  /// dropped).
  std::size_t last_round_remainder = 0;
};

/// Sample order of an epoch: 0..n-1, or a permutation drawn from a generator seeded `seed + epoch`.
std::vector<std::size_t> epoch_order(std::size_t n, bool shuffle, std::uint64_t seed, std::uint64_t epoch);

/// Accelerate's BatchSamplerShard: global batches of `batch_size` from `order`; rank r takes batches r, r+N,
/// ... With `even_batches` the last round is completed from the start of the epoch; with `split_batches` each
/// global batch of `batch_size` is cut into N slices instead.
ShardPlan plan_shard(const std::vector<std::size_t>& order, std::size_t batch_size, int rank, int world,
                     bool drop_last, bool even_batches, bool split_batches);

/// Position and end-of-data signal shared between a loader and its accelerator.
struct LoaderState {
  std::uint64_t epoch = 0;
  std::size_t next_batch = 0;  ///< batches of the current epoch already yielded
  bool at_last_batch = false;  ///< the batch just yielded is the epoch's last
  bool in_epoch = false;       ///< an iteration is in progress
  bool resumed = false;        ///< set by load_state: the next iteration continues at next_batch
  std::size_t remainder = 0;   ///< ShardPlan::last_round_remainder of the current epoch
  /// Batches an epoch yields on rank 0, the most any rank yields (the same every epoch, and on every rank; 0
  /// for a loader that does not say): bounds a restored position on every rank alike.
  std::size_t batches_in_epoch = 0;
  /// Samples of the data one batch position covers across all ranks (batch x N, or batch with
  /// split_batches): converts positions when a checkpoint is resumed on another number of processes.
  std::size_t samples_per_step = 0;
  std::uint64_t last_yield = 0;          ///< value of `clock` when this loader last yielded a batch
  std::shared_ptr<std::uint64_t> clock;  ///< shared by the loaders of one accelerator: which yielded last
  /// Called before each batch and at the end of an epoch: a step boundary, where sharded backends refresh the
  /// model's parameters after the user's optimizer.step(). Collective.
  std::function<void()> on_advance;
};

/// Moves a batch to a device. Overloads for the batch types of torch::data; add your own for custom batches.
/// A tensor in pinned memory is copied to a CUDA device without blocking.
inline torch::Tensor to_device(const torch::Tensor& t, const torch::Device& d) {
  return t.to(d, /*non_blocking=*/d.is_cuda() && t.is_pinned());
}
template <class D, class T>
torch::data::Example<D, T> to_device(const torch::data::Example<D, T>& e, const torch::Device& d) {
  return {to_device(e.data, d), to_device(e.target, d)};
}
template <class D>
torch::data::Example<D, torch::data::example::NoTarget> to_device(
    const torch::data::Example<D, torch::data::example::NoTarget>& e, const torch::Device& d) {
  return torch::data::Example<D, torch::data::example::NoTarget>(to_device(e.data, d));
}
template <class T>
std::vector<T> to_device(const std::vector<T>& v, const torch::Device& d) {
  std::vector<T> out;
  out.reserve(v.size());
  for (const auto& x : v)
    out.push_back(to_device(x, d));
  return out;
}

/// Batch types that can be built in pinned memory (pin_memory): tensors, Examples of them, vectors of those.
/// Specialise it (and add a `pin_memory` overload) for a batch type of your own; others are copied as they
/// are.
template <class B>
struct can_pin : std::false_type {};
template <>
struct can_pin<torch::Tensor> : std::true_type {};
template <class D, class T>
struct can_pin<torch::data::Example<D, T>>
    : std::bool_constant<can_pin<D>::value &&
                         (can_pin<T>::value || std::is_same_v<T, torch::data::example::NoTarget>)> {};
template <class T>
struct can_pin<std::vector<T>> : can_pin<T> {};

/// A batch in pinned memory.
inline torch::Tensor pin_memory(const torch::Tensor& t) {
  return t.is_cpu() ? t.pin_memory() : t;
}
template <class D, class T>
torch::data::Example<D, T> pin_memory(const torch::data::Example<D, T>& e) {
  return {pin_memory(e.data), pin_memory(e.target)};
}
template <class D>
torch::data::Example<D, torch::data::example::NoTarget> pin_memory(
    const torch::data::Example<D, torch::data::example::NoTarget>& e) {
  return torch::data::Example<D, torch::data::example::NoTarget>(pin_memory(e.data));
}
template <class T, std::enable_if_t<can_pin<T>::value, int> = 0>
std::vector<T> pin_memory(const std::vector<T>& v) {
  std::vector<T> out;
  out.reserve(v.size());
  for (const auto& x : v)
    out.push_back(pin_memory(x));
  return out;
}

}  // namespace detail

/// A sharded, device-placing loader over a `torch::data` batch dataset (anything with
/// `get_batch(ArrayRef<size_t>)` and `size()`, e.g. `MNIST(...).map(Stack<>())`).
/// Each `begin()` starts the next epoch (or resumes the one a checkpoint was saved in).
template <class Dataset>
class DataLoader {
 public:
  using Batch = decltype(std::declval<Dataset&>().get_batch(std::declval<c10::ArrayRef<std::size_t>>()));

  class Iterator {
   public:
    using iterator_category = std::input_iterator_tag;
    using value_type = Batch;
    using difference_type = std::ptrdiff_t;
    using pointer = Batch*;
    using reference = Batch&;

    Iterator() = default;
    explicit Iterator(DataLoader* loader) : loader_(loader) { fetch(); }
    Batch& operator*() { return *current_; }
    Batch* operator->() { return &*current_; }
    Iterator& operator++() {
      fetch();
      return *this;
    }
    bool operator==(const Iterator& o) const { return loader_ == o.loader_; }
    bool operator!=(const Iterator& o) const { return !(*this == o); }

   private:
    void fetch() {
      if (!loader_) return;
      current_ = loader_->next();
      if (!current_) loader_ = nullptr;
    }
    DataLoader* loader_ = nullptr;
    std::optional<Batch> current_;
  };

  DataLoader(Dataset dataset, DataLoaderOptions options, int rank, int world, torch::Device device,
             std::shared_ptr<detail::LoaderState> state)
      : dataset_(std::move(dataset)),
        options_(std::move(options)),
        rank_(rank),
        world_(world),
        device_(device),
        state_(std::move(state)) {
    state_->samples_per_step =
        options_.batch_size() *
        (options_.split_batches().value_or(false) ? 1 : static_cast<std::size_t>(world_));
    state_->batches_in_epoch = plan_for(state_->epoch, /*rank=*/0).batches.size();
  }

  Iterator begin() {
    start_epoch();
    return Iterator(this);
  }
  Iterator end() { return Iterator(); }

  /// Batches this rank yields per epoch.
  std::size_t size() { return plan_for(state_->epoch).batches.size(); }
  /// Samples in the dataset.
  std::size_t dataset_size() const { return *dataset_.size(); }
  /// The dataset indices of the next `count` batches this rank yields in the current epoch (fewer near its
  /// end), without yielding them: what Hugging Face's Trainer reads ahead (get_batch_samples) to count the
  /// items of an accumulation window before its first micro-step. Inside an iteration (after begin()).
  std::vector<std::vector<std::size_t>> upcoming(std::size_t count) const {
    std::vector<std::vector<std::size_t>> out;
    for (std::size_t k = state_->next_batch; k < plan_.batches.size() && out.size() < count; ++k)
      out.push_back(plan_.batches[k]);
    return out;
  }
  /// Epoch that the next (or current) iteration runs.
  std::uint64_t epoch() const { return state_->epoch; }
  /// Jump to an epoch (as `sampler.set_epoch` in PyTorch); resets the position within the epoch.
  void set_epoch(std::uint64_t e) {
    state_->epoch = e;
    state_->next_batch = 0;
    state_->in_epoch = false;
  }

 private:
  detail::ShardPlan plan_for(std::uint64_t epoch) const { return plan_for(epoch, rank_); }
  detail::ShardPlan plan_for(std::uint64_t epoch, int rank) const {
    const auto n = *dataset_.size();
    const auto order = detail::epoch_order(n, options_.shuffle(), options_.seed().value_or(0), epoch);
    return detail::plan_shard(order, options_.batch_size(), rank, world_, options_.drop_last(),
                              options_.even_batches().value_or(true),
                              options_.split_batches().value_or(false));
  }

  void start_epoch() {
    // An iteration left early (`break`) is abandoned and the next one starts a new epoch, as re-iterating a
    // PyTorch loader does; after load_state the restored epoch continues at the restored batch instead.
    if (!state_->resumed && state_->next_batch > 0) {
      state_->epoch += 1;
      state_->next_batch = 0;
    }
    state_->resumed = false;
    plan_ = plan_for(state_->epoch);
    ++plan_serial_;
    state_->in_epoch = true;
    state_->at_last_batch = false;
    state_->remainder = plan_.last_round_remainder;
  }

  std::optional<Batch> next() {
    if (state_->on_advance) state_->on_advance();
    if (state_->next_batch >= plan_.batches.size()) {
      state_->in_epoch = false;
      state_->at_last_batch = false;
      state_->epoch += 1;
      state_->next_batch = 0;
      return std::nullopt;
    }
    const std::size_t k = state_->next_batch++;
    if (state_->clock) state_->last_yield = ++*state_->clock;
    state_->at_last_batch = state_->next_batch == plan_.batches.size();
    return detail::to_device(options_.workers() > 0 ? prefetched(k) : build(plan_.batches[k]), device_);
  }

  Batch build(const std::vector<std::size_t>& indices) {
    if constexpr (detail::can_pin<Batch>::value) {
      if (options_.pin_memory() && device_.is_cuda()) return detail::pin_memory(dataset_.get_batch(indices));
    }
    return dataset_.get_batch(indices);
  }

  // Batch k of the plan, built in the background: `workers` batches ahead run on their own threads and are
  // handed out in plan order. A jump (new epoch, set_epoch, resume) drops what was built ahead.
  Batch prefetched(std::size_t k) {
    if (pending_.empty() || pending_first_ != k || pending_plan_ != plan_serial_) {
      pending_.clear();  // each future waits for its thread
      pending_first_ = next_scheduled_ = k;
      pending_plan_ = plan_serial_;
    }
    auto schedule = [this] {
      while (pending_.size() < options_.workers() && next_scheduled_ < plan_.batches.size()) {
        pending_.push_back(std::async(
            std::launch::async, [this, indices = plan_.batches[next_scheduled_]] { return build(indices); }));
        ++next_scheduled_;
      }
    };
    schedule();
    Batch batch = pending_.front().get();
    pending_.pop_front();
    ++pending_first_;
    schedule();  // keep `workers` batches building while the loop trains on this one
    return batch;
  }

  Dataset dataset_;
  DataLoaderOptions options_;
  int rank_;
  int world_;
  torch::Device device_;
  std::shared_ptr<detail::LoaderState> state_;
  detail::ShardPlan plan_;
  std::uint64_t plan_serial_ = 0;  // which plan_ the prefetched batches belong to
  // Declared last: destroyed first, waiting for the threads that still use dataset_ and plan_.
  std::deque<std::future<Batch>> pending_;
  std::size_t pending_first_ = 0;  // plan index of pending_.front()
  std::size_t next_scheduled_ = 0;
  std::uint64_t pending_plan_ = 0;
};

}  // namespace accel
