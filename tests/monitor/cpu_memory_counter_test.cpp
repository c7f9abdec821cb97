// accel::CpuMemoryCounter, the wrapper around LibTorch's CPU allocator (process-wide: installed once,
// counting from then on):
//  - c10's raw_allocate / raw_deallocate work through it and are counted: raw_allocate asserts that a
//  DataPtr's
//    context is its data pointer, and LibTorch's bf16 CPU matmul takes its scratch memory that way (finetune
//    --bf16 true under tensor parallelism, where load_slices installs the counter, died of it);
//  - current and peak bytes: a tensor adds its bytes, freeing it takes them off, the peak stays until
//  reset_peak;
//  - install() is idempotent (a second call does not wrap twice or count twice); zero-byte allocations and
//    allocations freed by other threads leave the count where it was.
#include <catch2/catch.hpp>

#include <accel/monitor/memory.hpp>

#include <c10/core/CPUAllocator.h>
#include <torch/torch.h>

#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

using accel::CpuMemoryCounter;

TEST_CASE("CpuMemoryCounter: c10's raw_allocate and raw_deallocate work through it and are counted") {
  CpuMemoryCounter::install();
  REQUIRE(CpuMemoryCounter::installed());
  c10::Allocator* allocator = c10::GetCPUAllocator();
  REQUIRE(allocator->raw_deleter() != nullptr);  // "rawAllocate and rawDeallocate APIs are safe to use"
  const auto before = CpuMemoryCounter::current();
  void* p = nullptr;
  REQUIRE_NOTHROW(p = allocator->raw_allocate(4096));
  REQUIRE(p != nullptr);
  std::memset(p, 7, 4096);
  CHECK(CpuMemoryCounter::current() - before == 4096);
  REQUIRE_NOTHROW(allocator->raw_deallocate(p));
  CHECK(CpuMemoryCounter::current() == before);
  // Zero bytes: no pointer to free, nothing counted.
  void* z = nullptr;
  REQUIRE_NOTHROW(z = allocator->raw_allocate(0));
  REQUIRE_NOTHROW(allocator->raw_deallocate(z));
  CHECK(CpuMemoryCounter::current() == before);
}

TEST_CASE("CpuMemoryCounter: a bf16 matmul (raw_allocate scratch) runs and equals float32's within bf16") {
  CpuMemoryCounter::install();
  torch::manual_seed(0);
  const auto a = torch::randn({64, 64});
  const auto b = torch::randn({64, 64});
  const auto before = CpuMemoryCounter::current();
  torch::Tensor c;
  REQUIRE_NOTHROW(c = torch::mm(a.to(torch::kBFloat16), b.to(torch::kBFloat16)));
  CHECK(torch::allclose(
      c.to(torch::kFloat32),
      a.to(torch::kBFloat16).to(torch::kFloat32).mm(b.to(torch::kBFloat16).to(torch::kFloat32)), 2e-2, 2e-1));
  c = torch::Tensor();
  CHECK(CpuMemoryCounter::current() == before);  // the scratch was given back, and counted as given back
}

TEST_CASE("CpuMemoryCounter: current and peak bytes; install is idempotent") {
  CpuMemoryCounter::install();
  CpuMemoryCounter::install();  // a second install must not wrap the wrapper (bytes would count twice)
  const auto before = CpuMemoryCounter::current();
  CpuMemoryCounter::reset_peak();
  CHECK(CpuMemoryCounter::peak() == before);
  {
    const auto big = torch::empty({1 << 20}, torch::kUInt8);
    CHECK(CpuMemoryCounter::current() - before == (1u << 20));
    {
      const auto small = torch::empty({1 << 10}, torch::kUInt8);
      CHECK(CpuMemoryCounter::current() - before == (1u << 20) + (1u << 10));
      const auto copy = small.clone();  // Allocator::clone / copy_data path of storage copies
      CHECK(torch::equal(copy, small));
    }
    CHECK(CpuMemoryCounter::current() - before == (1u << 20));
    const auto empty = torch::empty({0});
    CHECK(CpuMemoryCounter::current() - before == (1u << 20));
  }
  CHECK(CpuMemoryCounter::current() == before);
  CHECK(CpuMemoryCounter::peak() - before >= (1u << 20) + 2 * (1u << 10));
  CHECK(CpuMemoryCounter::peak() - before < (1u << 20) + (1u << 16));
  CpuMemoryCounter::reset_peak();
  CHECK(CpuMemoryCounter::peak() == before);
}

TEST_CASE("CpuMemoryCounter: allocations made and freed on several threads leave the count where it was") {
  CpuMemoryCounter::install();
  const auto before = CpuMemoryCounter::current();
  std::vector<torch::Tensor> handed_over(4);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([t, &handed_over] {
      c10::Allocator* allocator = c10::GetCPUAllocator();
      for (int i = 0; i < 2000; ++i) {
        const auto x = torch::empty({64 + i % 7}, torch::kFloat32);
        allocator->raw_deallocate(allocator->raw_allocate(static_cast<std::size_t>(128 + i)));
      }
      handed_over[static_cast<std::size_t>(t)] = torch::empty({100}, torch::kFloat32);  // freed on main
    });
  }
  for (auto& th : threads) {
    th.join();
  }
  CHECK(CpuMemoryCounter::current() - before == 4 * 100 * sizeof(float));
  handed_over.clear();
  CHECK(CpuMemoryCounter::current() == before);
}
