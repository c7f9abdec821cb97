#pragma once
/// \file communicator.hpp
/// The only code that talks to c10d: rendezvous through a TCPStore hosted by rank 0, ProcessGroupGloo for CPU
/// tensors and ProcessGroupNCCL for CUDA tensors (or Gloo on host copies), collective timeouts,
/// per-collective byte counters, and an optional debug mode that compares every rank's call before each
/// collective so that a mismatch becomes a DistributedError on every rank instead of a hang. Every collective
/// method must be called by all ranks in the same order ("collective").

#include <accel/distributed/process_state.hpp>

#include <torch/types.h>

#include <array>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace accel {

/// Reduction of `all_reduce` / `reduce_scatter`.
enum class ReduceOp { Sum, Mean, Max, Min };

/// Collective types, for byte counters and debug descriptions.
enum class Collective {
  AllReduce,
  Broadcast,
  AllGather,
  ReduceScatter,
  Reduce,
  Barrier,
  Exchange,
  PointToPoint,  ///< `send_async` / `recv_async` ("send_recv"): payload = bytes sent or received, wire = sent
  AllToAll,      ///< `all_to_all`: payload = input bytes, wire = the (N-1)/N of them sent to other ranks
  kCount
};

/// Name of a collective type ("all_reduce", ...).
const char* to_string(Collective c);

/// How reduce-scatter, all-gather and reduce run on CPU tensors (Gloo).
enum class CpuCollectives {
  Auto,          ///< the faster one as measured by bench_collectives (see BENCHMARKS.md): point-to-point
  Builtin,       ///< ProcessGroupGloo's own `_reduce_scatter_base` / `_allgather_base` / `reduce`
  PointToPoint,  ///< pairwise exchange over the same group's send/recv (detail/p2p_collectives)
};

/// Parses "auto", "builtin" or "p2p"; UsageError naming `source` (e.g. the environment variable) otherwise.
CpuCollectives parse_cpu_collectives(const std::string& value, const std::string& source);

/// Which process group carries the collectives of CUDA tensors.
enum class CudaCollectives {
  Nccl,  ///< ProcessGroupNCCL, one GPU per rank (NCCL refuses two ranks on one device)
  /// ProcessGroupGloo on host copies: each CUDA tensor is copied to the host, the CPU collective runs, and
  /// the result is copied back (as `init_process_group("gloo")` in PyTorch does for CUDA tensors). Slower
  /// than NCCL, but ranks may share a GPU: for running multi-rank code on a machine with fewer GPUs than
  /// ranks.
  Gloo,
};

/// Parses "nccl" or "gloo"; UsageError naming `source` (e.g. the environment variable) otherwise.
CudaCollectives parse_cuda_collectives(const std::string& value, const std::string& source);

/// Options of a Communicator.
struct CommunicatorOptions {
  /// Timeout of every collective and of the rendezvous.
  std::chrono::milliseconds timeout{std::chrono::minutes(30)};
  /// Compare operation, shapes and dtypes across ranks before each collective.
  bool debug = false;
  /// Algorithm of reduce-scatter, all-gather and reduce on CPU tensors (environment: ACCEL_CPU_COLLECTIVES).
  CpuCollectives cpu_collectives = CpuCollectives::Auto;
  /// Process group of CUDA tensors' collectives (environment: ACCEL_CUDA_COLLECTIVES); fixed when the
  /// communicator is created (a later set_options does not change it).
  CudaCollectives cuda_collectives = CudaCollectives::Nccl;
};

/// Bytes moved by one collective type, counted on this rank.
struct ByteCount {
  std::uint64_t calls = 0;    ///< collectives issued
  std::uint64_t payload = 0;  ///< bytes of the tensors handed to the collective (inputs), in bytes
  /// Bytes this rank sends over the wire with the bandwidth-optimal (ring) algorithm, in bytes:
  /// all_reduce 2(N-1)/N x payload, all_gather and reduce_scatter (N-1)/N x the full tensor, broadcast
  /// payload on the root. Gloo's actual algorithm may differ; this is the standard volume benchmarks compare
  /// against.
  std::uint64_t wire = 0;
};

/// A pending asynchronous collective.
class CollectiveHandle {
 public:
  virtual ~CollectiveHandle() = default;
  /// Blocks until the collective finished; rethrows its failure as DistributedError.
  virtual void wait() = 0;
};

/// Process-group wrapper. One per Accelerator; not thread-safe.
class Communicator {
 public:
  /// Connects to the job described by `state` (rendezvous through rank 0's TCPStore at
  /// master_addr:master_port; blocks until every rank joined or the timeout passed). With one process nothing
  /// is opened and every collective is the identity. Throws DistributedError naming address, port and rank.
  /// Like PyTorch's default process group, a connection lives until the process exits: a later call with the
  /// same layout and device returns the same communicator (with `options` applied), so a program may create
  /// several Accelerators one after the other.
  static std::shared_ptr<Communicator> create(const ProcessState& state, torch::Device device,
                                              CommunicatorOptions options = {});
  virtual ~Communicator() = default;

  int rank() const noexcept { return state_.rank; }
  int world_size() const noexcept { return state_.world_size; }
  const ProcessState& state() const noexcept { return state_; }
  const CommunicatorOptions& options() const noexcept { return options_; }
  /// Changes the timeout (of waits started from now on) and the debug mode.
  void set_options(const CommunicatorOptions& options) { options_ = options; }

  /// In-place all-reduce of one tensor (collective).
  virtual void all_reduce(torch::Tensor& tensor, ReduceOp op) = 0;
  /// Asynchronous in-place all-reduce (SUM) of tensors that stay alive until `wait()` (collective).
  virtual std::unique_ptr<CollectiveHandle> all_reduce_async(std::vector<torch::Tensor> tensors) = 0;
  /// Asynchronous sum of every rank's `tensor` into `root`'s `tensor` (others' content is unspecified after);
  /// the tensor stays alive until `wait()` (collective).
  virtual std::unique_ptr<CollectiveHandle> reduce_async(torch::Tensor tensor, int root) = 0;
  /// In-place broadcast from `root` (collective).
  virtual void broadcast(torch::Tensor& tensor, int root) = 0;
  /// Concatenation along dim 0 of every rank's tensor, which must all have the same shape (collective).
  virtual torch::Tensor all_gather(const torch::Tensor& tensor) = 0;
  /// Every rank's `input` (world_size x shard numel) summed, this rank's shard returned (collective).
  virtual torch::Tensor reduce_scatter(const torch::Tensor& input, ReduceOp op) = 0;
  /// Asynchronous all-gather: every rank's contiguous `input` (same numel everywhere) is written, in rank
  /// order, into the contiguous `output` of world_size x input numel elements. Both stay alive until `wait()`
  /// (collective).
  virtual std::unique_ptr<CollectiveHandle> all_gather_async(torch::Tensor output, torch::Tensor input) = 0;
  /// Asynchronous reduce-scatter (sum): the sum of every rank's contiguous `input` (world_size x output numel
  /// elements), this rank's part written to the contiguous `output`. Both stay alive until `wait()`
  /// (collective).
  virtual std::unique_ptr<CollectiveHandle> reduce_scatter_async(torch::Tensor output,
                                                                 torch::Tensor input) = 0;
  /// All-to-all with equal blocks (torch.distributed.all_to_all_single without split sizes): `input`'s dim 0,
  /// a multiple of world_size(), is cut into world_size() equal blocks and block j is sent to rank j; the
  /// result (the shape of `input`) holds in rank order the block every rank sent to this one. Sequence
  /// parallelism (DeepSpeed Ulysses) exchanges attention heads for positions with it. UsageError (naming the
  /// shape and the group size) when dim 0 is not a multiple of world_size(). Collective.
  virtual torch::Tensor all_to_all(const torch::Tensor& input) = 0;
  /// Blocks until all ranks arrive (collective).
  virtual void barrier() = 0;
  /// Every rank's string, indexed by rank; goes through the store, not the process group (collective).
  virtual std::vector<std::string> exchange(const std::string& mine) = 0;

  /// Sub-groups, as torch.distributed.new_subgroups_by_enumeration: `groups` lists disjoint groups of this
  /// communicator's ranks that together hold every rank, the same lists on every rank. Returns the
  /// communicator of the group holding this rank: its rank() is this rank's index in that list, its
  /// world_size() the list's length, and its collectives involve only the group (its own Gloo and NCCL
  /// process groups over this job's store). A group of one rank gets a single-process communicator.
  /// UsageError (naming the rank and the list) for a rank missing, repeated or out of range; DistributedError
  /// when the ranks pass different lists. Collective.
  virtual std::shared_ptr<Communicator> split(const std::vector<std::vector<int>>& groups) = 0;
  /// The ranks of this communicator in the job (`process_index()`), indexed by rank(): 0..N-1 for the job's
  /// communicator, the group's list for one made by split().
  const std::vector<int>& job_ranks() const noexcept { return job_ranks_; }

  /// Tags of `send_async` / `recv_async` lie in [0, kPointToPointTagLimit); the tags above are reserved for
  /// the point-to-point algorithms of reduce-scatter, all-gather and reduce.
  static constexpr int kPointToPointTagLimit = 1 << 30;
  /// Asynchronous send of the contiguous `tensor` to rank `dst` (point to point, not collective: only `dst`
  /// calls the matching `recv_async(..., rank(), tag)`). Messages from one rank to another with one tag are
  /// received in the order they were sent. The tensor stays alive until `wait()`, which blocks until the
  /// transfer is done, which may not happen before `dst` posted the receive (Gloo): wait on a send only
  /// where the peer can reach its receive without this rank (pipeline_schedule.hpp's rules). Counted under
  /// Collective::PointToPoint. UsageError (naming rank, peer and tag) for a peer that is not another rank, a
  /// tag outside [0, kPointToPointTagLimit), a non-contiguous tensor, or a single process.
  virtual std::unique_ptr<CollectiveHandle> send_async(torch::Tensor tensor, int dst, int tag) = 0;
  /// Asynchronous receive from rank `src` into the contiguous `tensor`, which must have the sent message's
  /// size in bytes; it stays alive until `wait()`, which blocks until the data arrived (or the timeout
  /// passed: DistributedError). The same rules and errors as `send_async`.
  virtual std::unique_ptr<CollectiveHandle> recv_async(torch::Tensor tensor, int src, int tag) = 0;

  /// Bytes counted for one collective type since construction or the last reset.
  ByteCount bytes(Collective c) const { return counters_[static_cast<std::size_t>(c)]; }
  /// Sum of `wire` over all collective types.
  std::uint64_t total_wire_bytes() const;
  void reset_counters() { counters_ = {}; }
  /// Counts this communicator's collectives on `parent` too (which must outlive it; null: stop): a group an
  /// engine splits off for its own traffic (hybrid sharding) then shows in the accelerator's counters.
  void count_into(Communicator* parent) noexcept { count_into_ = parent; }

 protected:
  Communicator(ProcessState state, CommunicatorOptions options, std::vector<int> job_ranks = {})
      : state_(std::move(state)), options_(options), job_ranks_(std::move(job_ranks)) {
    if (job_ranks_.empty()) {
      for (int r = 0; r < state_.world_size; ++r)
        job_ranks_.push_back(r);
    }
  }
  /// Checks `groups` (see split) and returns the index of the group holding this rank.
  std::size_t check_groups(const std::vector<std::vector<int>>& groups) const;
  void count(Collective c, std::uint64_t payload, std::uint64_t wire);

  ProcessState state_;
  CommunicatorOptions options_;
  std::vector<int> job_ranks_;
  std::array<ByteCount, static_cast<std::size_t>(Collective::kCount)> counters_{};
  Communicator* count_into_ = nullptr;
};

}  // namespace accel
