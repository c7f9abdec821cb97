#include "param_trigger.hpp"

#include <ATen/record_function.h>
#include <c10/core/StorageImpl.h>

#include <algorithm>
#include <atomic>
#include <memory>
#include <mutex>
#include <shared_mutex>

namespace accel::backends::detail {
namespace {

thread_local bool tl_quiet = false;

struct Registry {
  std::shared_mutex mu;
  std::vector<ParameterTrigger*> triggers;
  std::atomic<int> count{0};
  at::CallbackHandle handle = 0;
};

Registry& registry() {
  static auto* r = new Registry();  // never destroyed: callbacks may run during static destruction
  return *r;
}

struct PinContext final : at::ObserverContext {
  TriggerClient* client = nullptr;
  std::vector<std::size_t> tags;
};

std::unique_ptr<at::ObserverContext> on_start(const at::RecordFunction& fn) {
  auto& r = registry();
  if (tl_quiet || r.count.load(std::memory_order_acquire) == 0) return nullptr;
  TriggerClient* client = nullptr;
  std::vector<std::size_t> tags;
  {
    std::shared_lock lock(r.mu);
    for (auto* t : r.triggers) {
      tags = t->tags_of(fn.inputs());
      if (!tags.empty()) {
        client = &t->client();
        break;
      }
    }
  }
  if (client == nullptr) return nullptr;
  {
    Quiet quiet;
    client->on_operator_start(tags);
  }
  auto ctx = std::make_unique<PinContext>();
  ctx->client = client;
  ctx->tags = std::move(tags);
  return ctx;
}

void on_end(const at::RecordFunction& /*fn*/, at::ObserverContext* ctx) {
  if (ctx == nullptr) return;
  auto* pin = static_cast<PinContext*>(ctx);
  Quiet quiet;
  pin->client->on_operator_end(pin->tags);
}

}  // namespace

Quiet::Quiet() : prev_(tl_quiet), prev_record_(at::isRecordFunctionEnabled()) {
  tl_quiet = true;
  at::enableRecordFunction(false);  // cheaper than observing and ignoring every operator
}

Quiet::~Quiet() {
  at::enableRecordFunction(prev_record_);
  tl_quiet = prev_;
}

bool quiet() {
  return tl_quiet;
}

ParameterTrigger::~ParameterTrigger() {
  stop();
}

void ParameterTrigger::watch(const torch::Tensor& t, std::size_t tag) {
  tags_[t.unsafeGetTensorImpl()->unsafe_storage().unsafeGetStorageImpl()] = tag;
}

void ParameterTrigger::watch_live(const torch::Tensor& t, std::size_t tag) {
  std::unique_lock lock(registry().mu);  // tags_of reads tags_ under the shared lock
  watch(t, tag);
}

void ParameterTrigger::unwatch_live(const torch::Tensor& t) {
  std::unique_lock lock(registry().mu);
  tags_.erase(t.unsafeGetTensorImpl()->unsafe_storage().unsafeGetStorageImpl());
}

void ParameterTrigger::start() {
  if (started_) return;
  auto& r = registry();
  std::unique_lock lock(r.mu);
  r.triggers.push_back(this);
  if (r.count.fetch_add(1) == 0) {
    r.handle = at::addGlobalCallback(
        at::RecordFunctionCallback(&on_start, &on_end).needsInputs(true).scopes({at::RecordScope::FUNCTION}));
  }
  started_ = true;
}

void ParameterTrigger::stop() {
  if (!started_) return;
  auto& r = registry();
  std::unique_lock lock(r.mu);
  r.triggers.erase(std::remove(r.triggers.begin(), r.triggers.end(), this), r.triggers.end());
  if (r.count.fetch_sub(1) == 1) at::removeCallback(r.handle);
  started_ = false;
}

std::vector<std::size_t> ParameterTrigger::tags_of(c10::ArrayRef<const c10::IValue> inputs) const {
  std::vector<std::size_t> out;
  auto add = [&](const at::Tensor& t) {
    if (!t.defined() || !t.has_storage()) return;
    const auto it = tags_.find(t.unsafeGetTensorImpl()->unsafe_storage().unsafeGetStorageImpl());
    if (it != tags_.end() && std::find(out.begin(), out.end(), it->second) == out.end()) {
      out.push_back(it->second);
    }
  };
  for (const auto& iv : inputs) {
    if (iv.isTensor()) {
      add(iv.toTensor());
    } else if (iv.isList()) {
      for (const auto& e : iv.toListRef()) {
        if (e.isTensor()) add(e.toTensor());
      }
    }
  }
  return out;
}

}  // namespace accel::backends::detail
