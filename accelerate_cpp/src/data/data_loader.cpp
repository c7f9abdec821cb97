#include <accel/data/data_loader.hpp>
#include <accel/errors.hpp>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/ops/randperm.h>
#include <fmt/format.h>

namespace accel::detail {

std::vector<std::size_t> epoch_order(std::size_t n, bool shuffle, std::uint64_t seed, std::uint64_t epoch) {
  std::vector<std::size_t> order(n);
  if (!shuffle) {
    for (std::size_t i = 0; i < n; ++i)
      order[i] = i;
    return order;
  }
  // Same draw as PyTorch's RandomSampler with a generator seeded `seed + epoch`: identical on every rank.
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed + epoch);
  const auto perm = at::randperm(static_cast<std::int64_t>(n), gen, at::TensorOptions().dtype(at::kLong));
  const auto* p = perm.data_ptr<std::int64_t>();
  for (std::size_t i = 0; i < n; ++i)
    order[i] = static_cast<std::size_t>(p[i]);
  return order;
}

namespace {

std::vector<std::vector<std::size_t>> global_batches(const std::vector<std::size_t>& order,
                                                     std::size_t batch_size, bool drop_last) {
  std::vector<std::vector<std::size_t>> batches;
  for (std::size_t begin = 0; begin < order.size(); begin += batch_size) {
    const auto end = std::min(order.size(), begin + batch_size);
    if (drop_last && end - begin < batch_size) break;
    batches.emplace_back(order.begin() + static_cast<std::ptrdiff_t>(begin),
                         order.begin() + static_cast<std::ptrdiff_t>(end));
  }
  return batches;
}

// A single process uses the plain loader, as Accelerate does.
ShardPlan plan_single(const std::vector<std::size_t>& order, std::size_t batch_size, bool drop_last) {
  ShardPlan plan;
  plan.batches = global_batches(order, batch_size, drop_last);
  for (const auto& b : plan.batches)
    plan.total_samples += b.size();
  return plan;
}

// split_batches: each global batch of `batch_size` is cut into N equal slices (Accelerate requires
// divisibility).
ShardPlan plan_split_batches(const std::vector<std::size_t>& order, std::size_t batch_size, std::size_t n,
                             std::size_t r, bool drop_last, bool even_batches) {
  if (batch_size % n != 0) {
    throw UsageError(
        fmt::format("data loader: split_batches needs a batch_size divisible by the {} processes, got {}; "
                    "use a multiple of {}",
                    n, batch_size, n));
  }
  ShardPlan plan;
  const std::size_t slice = batch_size / n;
  auto batches = global_batches(order, batch_size, drop_last);
  for (auto& b : batches)
    plan.total_samples += b.size();
  for (auto& b : batches) {
    if (b.size() < batch_size && even_batches) {
      // Complete the last global batch from the start of the epoch.
      for (std::size_t i = 0; b.size() < batch_size; i = (i + 1) % order.size())
        b.push_back(order[i]);
      plan.last_round_remainder = plan.total_samples % batch_size;
    }
    const std::size_t begin = std::min(b.size(), r * slice), end = std::min(b.size(), begin + slice);
    if (begin < end) {
      plan.batches.emplace_back(b.begin() + static_cast<std::ptrdiff_t>(begin),
                                b.begin() + static_cast<std::ptrdiff_t>(end));
    }
  }
  return plan;
}

// even_batches without split_batches: the last round's batches, completed from the samples of the first
// round (`initial_data`); `batch` and `idx` are the last global batch and its index.
void complete_last_round(ShardPlan& plan, std::vector<std::size_t> initial_data,
                         std::vector<std::size_t> batch, std::size_t idx, std::size_t batch_size,
                         std::size_t n, std::size_t r) {
  while (initial_data.size() < batch_size) {
    const auto copy = initial_data;
    initial_data.insert(initial_data.end(), copy.begin(), copy.end());
  }
  if (batch.size() == batch_size) {
    batch.clear();
    idx += 1;
  }
  std::size_t cycle = 0;
  while (idx % n != 0 || !batch.empty()) {
    // Python slicing truncates past the end; so do we.
    const std::size_t end = std::min(initial_data.size(), cycle + batch_size - batch.size());
    batch.insert(batch.end(), initial_data.begin() + static_cast<std::ptrdiff_t>(cycle),
                 initial_data.begin() + static_cast<std::ptrdiff_t>(end));
    if (idx % n == r) plan.batches.push_back(batch);
    cycle = end;
    batch.clear();
    idx += 1;
  }
  plan.last_round_remainder = plan.total_samples % (batch_size * n);
}

// Port of accelerate.data_loader.BatchSamplerShard._iter_with_no_split.
ShardPlan plan_no_split(const std::vector<std::size_t>& order, std::size_t batch_size, std::size_t n,
                        std::size_t r, bool drop_last, bool even_batches) {
  ShardPlan plan;
  const auto batches = global_batches(order, batch_size, drop_last);
  std::vector<std::size_t> initial_data;
  std::vector<std::size_t> to_yield;
  std::vector<std::size_t> batch;
  std::size_t idx = 0;
  for (std::size_t i = 0; i < batches.size(); ++i) {
    idx = i;
    batch = batches[i];
    plan.total_samples += batch.size();
    if (!drop_last && i < n) initial_data.insert(initial_data.end(), batch.begin(), batch.end());
    if (i % n == r) to_yield = batch;
    if (i % n == n - 1 && batch.size() == batch_size) {
      plan.batches.push_back(to_yield);
      to_yield.clear();
    }
  }
  if (drop_last || initial_data.empty()) return plan;
  if (!even_batches) {
    if (!to_yield.empty()) plan.batches.push_back(to_yield);
    return plan;
  }
  if (to_yield.size() == batch_size) plan.batches.push_back(to_yield);
  complete_last_round(plan, std::move(initial_data), std::move(batch), idx, batch_size, n, r);
  return plan;
}

}  // namespace

ShardPlan plan_shard(const std::vector<std::size_t>& order, std::size_t batch_size, int rank, int world,
                     bool drop_last, bool even_batches, bool split_batches) {
  if (batch_size == 0) throw UsageError("data loader: batch_size must be at least 1");
  if (world < 1 || rank < 0 || rank >= world) {
    throw UsageError(fmt::format("data loader: rank {} is outside a world of {} processes", rank, world));
  }
  const std::size_t n = static_cast<std::size_t>(world);
  const std::size_t r = static_cast<std::size_t>(rank);
  if (world == 1) return plan_single(order, batch_size, drop_last);
  if (split_batches) return plan_split_batches(order, batch_size, n, r, drop_last, even_batches);
  return plan_no_split(order, batch_size, n, r, drop_last, even_batches);
}

}  // namespace accel::detail
