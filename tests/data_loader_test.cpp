#include <catch2/catch.hpp>

#include "test_support.hpp"

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
