#include <catch2/catch.hpp>

#include "test_support.hpp"

#include <condition_variable>
#include <mutex>
#include <set>
#include <thread>

using accel::detail::plan_shard;

namespace {

std::vector<std::size_t> iota(std::size_t n) {
  std::vector<std::size_t> v(n);
  for (std::size_t i = 0; i < n; ++i)
    v[i] = i;
  return v;
}

std::vector<std::size_t> counts(std::size_t n, std::size_t batch, int world, bool even) {
  std::vector<std::size_t> out;
  for (int r = 0; r < world; ++r)
    out.push_back(plan_shard(iota(n), batch, r, world, false, even, false).batches.size());
  return out;
}

}  // namespace

TEST_CASE("data: one process yields consecutive batches, the last one partial") {
  const auto plan = plan_shard(iota(10), 4, 0, 1, false, true, false);
  REQUIRE(plan.batches == std::vector<std::vector<std::size_t>>{{0, 1, 2, 3}, {4, 5, 6, 7}, {8, 9}});
  REQUIRE(plan.total_samples == 10);
  REQUIRE(plan_shard(iota(10), 4, 0, 1, true, true, false).batches.size() == 2);
}

TEST_CASE("data: rank r takes batches r, r+N, ... (Accelerate's BatchSamplerShard)") {
  REQUIRE(plan_shard(iota(8), 2, 0, 2, false, true, false).batches ==
          std::vector<std::vector<std::size_t>>{{0, 1}, {4, 5}});
  REQUIRE(plan_shard(iota(8), 2, 1, 2, false, true, false).batches ==
          std::vector<std::vector<std::size_t>>{{2, 3}, {6, 7}});
}

TEST_CASE("data: even_batches completes the last round from the start, and off, ranks differ") {
  // The cases of Accelerate's own tests: 3 samples with batch 1, 7 samples with batch 2, over 2 ranks.
  REQUIRE(counts(3, 1, 2, true) == std::vector<std::size_t>{2, 2});
  REQUIRE(counts(3, 1, 2, false) == std::vector<std::size_t>{2, 1});
  REQUIRE(counts(7, 2, 2, true) == std::vector<std::size_t>{2, 2});
  REQUIRE(counts(7, 2, 2, false) == std::vector<std::size_t>{2, 2});
  REQUIRE(plan_shard(iota(7), 2, 1, 2, false, true, false).batches.back() == std::vector<std::size_t>{6, 0});
  REQUIRE(plan_shard(iota(7), 2, 1, 2, false, false, false).batches.back() == std::vector<std::size_t>{6});
}

TEST_CASE("data: shards cover the data exactly once (without even_batches padding)") {
  for (std::size_t n : {1u, 5u, 22u, 64u}) {
    for (int world : {2, 3}) {
      std::vector<int> seen(n, 0);
      for (int r = 0; r < world; ++r) {
        for (const auto& b : plan_shard(iota(n), 4, r, world, false, false, false).batches) {
          for (auto i : b)
            seen[i] += 1;
        }
      }
      for (std::size_t i = 0; i < n; ++i)
        REQUIRE(seen[i] == 1);
    }
  }
}

TEST_CASE("data: 22 samples over 2 ranks with batch 4 leave 6 real rows in the last round") {
  const auto plan = plan_shard(iota(22), 4, 0, 2, false, true, false);
  REQUIRE(plan.batches.size() == 3);
  REQUIRE(plan.last_round_remainder == 6);
}

TEST_CASE("data: split_batches cuts each global batch into N slices") {
  REQUIRE(plan_shard(iota(8), 4, 1, 2, false, true, true).batches ==
          std::vector<std::vector<std::size_t>>{{2, 3}, {6, 7}});
  REQUIRE_THROWS_WITH(
      plan_shard(iota(8), 3, 0, 2, false, true, true),
      "data loader: split_batches needs a batch_size divisible by the 2 processes, got 3; use a "
      "multiple of 2");
}

TEST_CASE("data: shuffling is a permutation, identical for the same seed+epoch, new each epoch") {
  const auto a = accel::detail::epoch_order(50, true, 42, 0);
  REQUIRE(a == accel::detail::epoch_order(50, true, 42, 0));
  REQUIRE(a != accel::detail::epoch_order(50, true, 42, 1));
  REQUIRE(accel::detail::epoch_order(50, true, 41, 1) == accel::detail::epoch_order(50, true, 42, 0));
  auto sorted = a;
  std::sort(sorted.begin(), sorted.end());
  REQUIRE(sorted == iota(50));
}

TEST_CASE("data: the prepared loader yields device batches, advances epochs and reports the last batch") {
  accel::Accelerator acc(accel::AcceleratorOptions().config(accel::test::make_config()));
  auto loader = acc.prepare_data_loader(accel::test::Regression(10).map(torch::data::transforms::Stack<>()),
                                        torch::data::DataLoaderOptions(4));
  REQUIRE(loader->size() == 3);
  std::vector<std::int64_t> sizes;
  torch::Tensor first_epoch_first;
  for (auto& batch : *loader) {
    sizes.push_back(batch.data.size(0));
    if (!first_epoch_first.defined()) first_epoch_first = batch.data.clone();
    REQUIRE(batch.data.device() == acc.device());
  }
  REQUIRE(sizes == std::vector<std::int64_t>{4, 4, 2});
  REQUIRE(loader->epoch() == 1);
  auto it = loader->begin();
  REQUIRE_FALSE(torch::equal(it->data, first_epoch_first));  // reshuffled for epoch 1
}

namespace {

// Rows whose value is their index; get_batch records its threads, how many calls overlap, and can fail.
struct Probe : torch::data::datasets::BatchDataset<Probe, torch::Tensor> {
  struct Shared {
    std::mutex m;
    std::condition_variable cv;
    int active = 0, max_active = 0, calls = 0;
    std::set<std::thread::id> threads;
    int fail_at = -1;
    bool wait_for_overlap = false;
  };
  std::shared_ptr<Shared> shared = std::make_shared<Shared>();
  std::size_t n;
  explicit Probe(std::size_t n) : n(n) {}
  torch::Tensor get_batch(c10::ArrayRef<std::size_t> indices) override {
    std::unique_lock<std::mutex> lock(shared->m);
    const int call = shared->calls++;
    if (call == shared->fail_at) throw std::runtime_error("get_batch failed on purpose");
    shared->threads.insert(std::this_thread::get_id());
    shared->max_active = std::max(shared->max_active, ++shared->active);
    shared->cv.notify_all();
    // The first two calls wait for each other (bounded, so a loader without overlap fails instead of
    // hanging).
    if (shared->wait_for_overlap && call < 2)
      shared->cv.wait_for(lock, std::chrono::seconds(20), [&] { return shared->max_active >= 2; });
    --shared->active;
    std::vector<std::int64_t> v(indices.begin(), indices.end());
    return torch::tensor(v, torch::kInt64);
  }
  torch::optional<std::size_t> size() const override { return n; }
};

std::vector<std::vector<std::int64_t>> epochs_of(accel::Accelerator& acc, Probe probe, std::size_t workers,
                                                 int epochs, int break_after = -1) {
  auto loader = acc.prepare_data_loader(std::move(probe),
                                        accel::DataLoaderOptions(4).shuffle(true).seed(3).workers(workers));
  std::vector<std::vector<std::int64_t>> out;
  for (int e = 0; e < epochs; ++e) {
    int k = 0;
    for (auto& batch : *loader) {
      out.emplace_back(batch.data_ptr<std::int64_t>(), batch.data_ptr<std::int64_t>() + batch.numel());
      if (++k == break_after && e == 0) break;  // an abandoned epoch: the next iteration starts a new one
    }
  }
  return out;
}

}  // namespace

TEST_CASE("data: workers build batches ahead on other threads, in the same order as without them") {
  accel::Accelerator acc(accel::AcceleratorOptions().config(accel::test::make_config()));
  Probe inline_probe(30), background(30);
  background.shared->wait_for_overlap = true;
  const auto expected = epochs_of(acc, inline_probe, 0, 3, 2);
  const auto got = epochs_of(acc, background, 3, 3, 2);
  CHECK(got == expected);  // 2 batches of epoch 0, then epochs 1 and 2 in full, shuffled identically
  CHECK(expected.size() == 2 + 8 + 8);
  CHECK(inline_probe.shared->max_active == 1);
  CHECK(inline_probe.shared->threads == std::set<std::thread::id>{std::this_thread::get_id()});
  CHECK(background.shared->max_active >= 2);  // batches were built concurrently
  CHECK(background.shared->threads.count(std::this_thread::get_id()) == 0);  // never on the loop's thread
}

TEST_CASE("data: an error in a worker's get_batch reaches the loop") {
  accel::Accelerator acc(accel::AcceleratorOptions().config(accel::test::make_config()));
  Probe probe(40);
  probe.shared->fail_at = 5;
  CHECK_THROWS_WITH(epochs_of(acc, probe, 2, 1), Catch::Contains("get_batch failed on purpose"));
}

namespace {
struct OwnBatchItem {
  int value = 0;
};
}  // namespace

// Batches of a program's own type are copied as they are: pin_memory applies only to what it can pin.
static_assert(accel::detail::can_pin<torch::Tensor>::value);
static_assert(accel::detail::can_pin<std::vector<torch::data::Example<>>>::value);
static_assert(
    accel::detail::can_pin<torch::data::Example<torch::Tensor, torch::data::example::NoTarget>>::value);
static_assert(!accel::detail::can_pin<std::vector<OwnBatchItem>>::value);
static_assert(!accel::detail::can_pin<torch::data::Example<torch::Tensor, int>>::value);
