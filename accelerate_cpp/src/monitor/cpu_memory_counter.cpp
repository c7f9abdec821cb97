// CpuMemoryCounter: a wrapper around LibTorch's CPU allocator that counts live and peak bytes.
//
// c10's Allocator contract: raw_allocate() asserts that a DataPtr's context IS its data pointer and hands
// that pointer to raw_deleter() later (LibTorch's bf16 CPU matmul, oneDNN and other at::native kernels take
// scratch memory this way). So the wrapper's DataPtr keeps context == data, and what it needs at release (the
// wrapped allocation and its size) lives in a table keyed by the data pointer, split into shards to keep
// threads apart.
#include <accel/monitor/memory.hpp>

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <mutex>
#include <unordered_map>
#include <utility>

namespace accel {
namespace {

std::atomic<std::uint64_t> g_current{0};
std::atomic<std::uint64_t> g_peak{0};
std::atomic<bool> g_installed{false};
c10::Allocator* g_base = nullptr;  // the wrapped allocator, set once by install()

void add(std::uint64_t n) {
  const auto now = g_current.fetch_add(n) + n;
  auto peak = g_peak.load();
  while (now > peak && !g_peak.compare_exchange_weak(peak, now)) {
  }
}

struct Allocation {
  Allocation() = default;
  Allocation(c10::DataPtr&& i, std::uint64_t n) : inner(std::move(i)), bytes(n) {}
  c10::DataPtr inner;  // owns the memory: destroying it frees through the wrapped allocator's deleter
  std::uint64_t bytes = 0;
};

/// Live allocations by data pointer, in shards (one mutex each) chosen by the pointer's bits above its
/// alignment.
class AllocationTable {
 public:
  /// Takes `inner` in under `inner.get()`; false (and `inner` left alone) when that pointer is already live
  /// (only a zero-byte sentinel pointer can repeat).
  bool insert(c10::DataPtr& inner, std::uint64_t bytes) {
    auto& s = shard(inner.get());
    std::lock_guard<std::mutex> lock(s.mutex);
    return s.live.try_emplace(inner.get(), std::move(inner), bytes).second;
  }
  /// Removes and returns the allocation at `data`; false when there is none.
  bool take(void* data, Allocation& out) {
    auto& s = shard(data);
    std::lock_guard<std::mutex> lock(s.mutex);
    const auto it = s.live.find(data);
    if (it == s.live.end()) {
      return false;
    }
    out = std::move(it->second);
    s.live.erase(it);
    return true;
  }

 private:
  static constexpr std::size_t kShards = 16;
  struct Shard {
    std::mutex mutex;
    std::unordered_map<void*, Allocation> live;
  };
  Shard& shard(void* data) {
    const auto bits = reinterpret_cast<std::uintptr_t>(data) >> 6;  // CPU allocations are 64-byte aligned
    return shards_[(bits ^ (bits >> 4) ^ (bits >> 8)) % kShards];
  }
  std::array<Shard, kShards> shards_;
};

AllocationTable& table() {
  static auto* t =
      new AllocationTable();  // never destroyed: tensors freed at process exit still call into it
  return *t;
}

/// The wrapper's deleter (its raw_deleter too): `data` is both the pointer and the context.
void release(void* data) {
  if (data == nullptr) {
    return;
  }
  Allocation a;
  if (table().take(data, a)) {
    g_current.fetch_sub(a.bytes);
    return;  // `a.inner` frees the memory here
  }
  // Not ours: raw memory the wrapped allocator handed out before install(), or a zero-byte sentinel.
  if (g_base != nullptr && g_base->raw_deleter() != nullptr) {
    g_base->raw_deleter()(data);
  }
}

class CountingAllocator final : public c10::Allocator {
 public:
  explicit CountingAllocator(c10::Allocator* base) : base_(base) {}

  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr inner = base_->allocate(n);
    void* data = inner.get();
    if (data == nullptr) {
      return inner;  // zero bytes: nothing to count or free
    }
    const auto device = inner.device();
    if (!table().insert(inner, n)) {
      return inner;  // a repeated zero-byte sentinel (insert left `inner` alone): the base's own DataPtr
    }
    add(n);
    return c10::DataPtr(data, data, &release, device);
  }

  c10::DeleterFnPtr raw_deleter() const override { return &release; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

 private:
  c10::Allocator* base_;
};

}  // namespace

void CpuMemoryCounter::install() {
  static std::once_flag once;
  std::call_once(once, [] {
    g_base = c10::GetCPUAllocator();
    // Never destroyed: tensors freed at process exit still call into it.
    static auto* allocator = new CountingAllocator(g_base);
    c10::SetCPUAllocator(allocator, /*priority=*/100);
    g_installed = true;
  });
}

bool CpuMemoryCounter::installed() noexcept {
  return g_installed;
}
std::uint64_t CpuMemoryCounter::current() noexcept {
  return g_current;
}
std::uint64_t CpuMemoryCounter::peak() noexcept {
  return g_peak;
}
void CpuMemoryCounter::reset_peak() noexcept {
  g_peak = g_current.load();
}

}  // namespace accel
