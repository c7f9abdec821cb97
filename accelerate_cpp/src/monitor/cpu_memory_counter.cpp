// CpuMemoryCounter: a wrapper around LibTorch's CPU allocator that counts live and peak bytes.
#include <accel/monitor/memory.hpp>

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <atomic>
#include <mutex>

namespace accel {
namespace {

std::atomic<std::uint64_t> g_current{0};
std::atomic<std::uint64_t> g_peak{0};
std::atomic<bool> g_installed{false};

void add(std::uint64_t n) {
  const auto now = g_current.fetch_add(n) + n;
  auto peak = g_peak.load();
  while (now > peak && !g_peak.compare_exchange_weak(peak, now)) {
  }
}

struct Allocation {
  c10::DataPtr inner;
  std::uint64_t bytes;
};

class CountingAllocator final : public c10::Allocator {
 public:
  explicit CountingAllocator(c10::Allocator* base) : base_(base) {}

  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr inner = base_->allocate(n);
    void* data = inner.get();
    const auto device = inner.device();
    add(n);
    return c10::DataPtr(data, new Allocation{std::move(inner), n}, &release, device);
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

 private:
  static void release(void* ctx) {
    auto* a = static_cast<Allocation*>(ctx);
    g_current.fetch_sub(a->bytes);
    delete a;  // frees the memory through the wrapped allocator's own deleter
  }

  c10::Allocator* base_;
};

}  // namespace

void CpuMemoryCounter::install() {
  static std::once_flag once;
  std::call_once(once, [] {
    // Never destroyed: tensors freed at process exit still call into it.
    static auto* allocator = new CountingAllocator(c10::GetCPUAllocator());
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
