#pragma once
// The parameter trigger: one process-wide at::RecordFunction callback that tells engines when an operator is
// about to read (or write) one of their tensors. Stage 3 / FULL_SHARD gathers a released unit there; ZeRO
// stages 1-2 learn that the optimizer stepped their shards and refresh the model before the next operator
// reads it. The only process-wide state of the library: LibTorch keeps RecordFunction callbacks in a global
// registry, so one callback serves every live engine.
//
// Code that includes ATen/record_function.h must be compiled with LibTorch's NDEBUG setting (Release).

#include <torch/types.h>

#include <c10/util/ArrayRef.h>

#include <cstddef>
#include <unordered_map>
#include <vector>

namespace c10 {
struct StorageImpl;
class IValue;
}  // namespace c10

namespace accel::backends::detail {

/// While alive, the calling thread's operators are not reported to any client (an engine's own work).
class Quiet {
 public:
  Quiet();
  ~Quiet();
  Quiet(const Quiet&) = delete;
  Quiet& operator=(const Quiet&) = delete;

 private:
  bool prev_;
  bool prev_record_;
};

/// True while the calling thread is inside a Quiet scope.
bool quiet();

/// Receives the operators whose inputs include a watched storage.
class TriggerClient {
 public:
  virtual ~TriggerClient() = default;
  /// Before the operator's kernel runs; `tags` are the tags of the watched storages among its inputs, each
  /// once. An exception cannot leave LibTorch's callback (the kernel would run regardless), so
  /// implementations report a failure and abort.
  virtual void on_operator_start(const std::vector<std::size_t>& tags) noexcept = 0;
  /// After the kernel ran, with the same tags.
  virtual void on_operator_end(const std::vector<std::size_t>& tags) noexcept = 0;
};

/// One client's registration. Views share their base's storage, so an operator on a view of a watched
/// tensor (a weight saved for backward, `.data()`, a slice) is reported too.
class ParameterTrigger {
 public:
  explicit ParameterTrigger(TriggerClient& client) : client_(client) {}
  ~ParameterTrigger();
  ParameterTrigger(const ParameterTrigger&) = delete;
  ParameterTrigger& operator=(const ParameterTrigger&) = delete;

  /// Reports operators on `t`'s storage with `tag`. Only before start(), or while stopped.
  void watch(const torch::Tensor& t, std::size_t tag);
  /// The same while started (also from a client's callback, which holds no lock): tensors an engine learns
  /// of later, such as the optimizer state it offloads. The caller keeps `t` alive while it is watched.
  void watch_live(const torch::Tensor& t, std::size_t tag);
  /// Stops reporting operators on `t`'s storage (watched with watch_live).
  void unwatch_live(const torch::Tensor& t);
  /// Starts (registers with the process-wide callback); idempotent.
  void start();
  /// Stops reporting; idempotent.
  void stop();
  bool started() const noexcept { return started_; }
  /// Tags of the watched storages among `inputs` (tensors and tensor lists), each once, in order of
  /// appearance.
  std::vector<std::size_t> tags_of(c10::ArrayRef<const c10::IValue> inputs) const;
  TriggerClient& client() const noexcept { return client_; }

 private:
  TriggerClient& client_;
  std::unordered_map<const c10::StorageImpl*, std::size_t> tags_;  // read-only while started
  bool started_ = false;
};

}  // namespace accel::backends::detail
