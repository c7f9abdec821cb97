#include <accel/distributed/communicator.hpp>
#include <accel/distributed/open_communicator.hpp>
#include <accel/errors.hpp>

#include "distributed/c10d_backends.hpp"
#include "distributed/p2p_collectives.hpp"
#include "distributed/run_id.hpp"

#include <ATen/core/grad_mode.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <chrono>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <unistd.h>

#include <map>
#include <mutex>
#include <sstream>

namespace accel {

const char* to_string(Collective c) {
  switch (c) {
    case Collective::AllReduce:
      return "all_reduce";
    case Collective::Broadcast:
      return "broadcast";
    case Collective::AllGather:
      return "all_gather";
    case Collective::ReduceScatter:
      return "reduce_scatter";
    case Collective::Reduce:
      return "reduce";
    case Collective::Barrier:
      return "barrier";
    case Collective::Exchange:
      return "exchange";
    case Collective::PointToPoint:
      return "send_recv";
    case Collective::AllToAll:
      return "all_to_all";
    case Collective::kCount:
      break;
  }
  return "?";
}

std::uint64_t Communicator::total_wire_bytes() const {
  std::uint64_t total = 0;
  for (const auto& c : counters_)
    total += c.wire;
  return total;
}

void Communicator::count(Collective c, std::uint64_t payload, std::uint64_t wire) {
  auto& counter = counters_[static_cast<std::size_t>(c)];
  counter.calls += 1;
  counter.payload += payload;
  counter.wire += wire;
  if (count_into_ != nullptr) count_into_->count(c, payload, wire);
}

std::size_t Communicator::check_groups(const std::vector<std::vector<int>>& groups) const {
  std::vector<int> seen(static_cast<std::size_t>(world_size()), 0);
  std::size_t mine = groups.size();
  for (std::size_t g = 0; g < groups.size(); ++g) {
    for (int r : groups[g]) {
      if (r < 0 || r >= world_size()) {
        throw UsageError(fmt::format("split: rank {} in group {} is outside [0, {}) (groups: {})", r,
                                     fmt::join(groups[g], ","), world_size(), fmt::join(groups, " ")));
      }
      if (seen[static_cast<std::size_t>(r)]++ != 0) {
        throw UsageError(
            fmt::format("split: rank {} is in more than one group (groups: {}); the groups must "
                        "be disjoint",
                        r, fmt::join(groups, " ")));
      }
      if (r == rank()) mine = g;
    }
  }
  for (int r = 0; r < world_size(); ++r) {
    if (seen[static_cast<std::size_t>(r)] == 0) {
      throw UsageError(fmt::format(
          "split: rank {} is in no group (groups: {}); the groups must hold every rank in [0, {})", r,
          fmt::join(groups, " "), world_size()));
    }
  }
  return mine;
}

CpuCollectives parse_cpu_collectives(const std::string& value, const std::string& source) {
  if (value == "auto") return CpuCollectives::Auto;
  if (value == "builtin") return CpuCollectives::Builtin;
  if (value == "p2p") return CpuCollectives::PointToPoint;
  throw UsageError(
      fmt::format("{}: unknown CPU collective algorithm '{}'; use auto, builtin or p2p", source, value));
}

CudaCollectives parse_cuda_collectives(const std::string& value, const std::string& source) {
  if (value == "nccl") return CudaCollectives::Nccl;
  if (value == "gloo") return CudaCollectives::Gloo;
  throw UsageError(fmt::format(
      "{}: unknown process group '{}' for CUDA tensors; use nccl (one GPU per rank) or gloo (host copies, "
      "ranks may share a GPU)",
      source, value));
}

namespace {

const char* op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum:
      return "sum";
    case ReduceOp::Mean:
      return "mean";
    case ReduceOp::Max:
      return "max";
    case ReduceOp::Min:
      return "min";
  }
  return "?";
}

c10d::ReduceOp to_c10d(ReduceOp op) {
  switch (op) {
    case ReduceOp::Max:
      return c10d::ReduceOp::MAX;
    case ReduceOp::Min:
      return c10d::ReduceOp::MIN;
    default:
      return c10d::ReduceOp::SUM;  // Mean = Sum, then divided: Gloo has no AVG on every dtype
  }
}

std::string describe(const torch::Tensor& t) {
  return fmt::format("shape=[{}], dtype={}, device={}", fmt::join(t.sizes(), ", "),
                     c10::toString(t.scalar_type()), t.device().type() == torch::kCPU ? "cpu" : "cuda");
}

/// One process: every collective is the identity.
class SingleProcessCommunicator final : public Communicator {
 public:
  SingleProcessCommunicator(ProcessState s, CommunicatorOptions o, std::vector<int> job_ranks = {})
      : Communicator(std::move(s), o, std::move(job_ranks)) {}
  std::shared_ptr<Communicator> split(const std::vector<std::vector<int>>& groups) override {
    check_groups(groups);
    return std::make_shared<SingleProcessCommunicator>(state_, options_, job_ranks_);
  }
  void all_reduce(torch::Tensor&, ReduceOp) override {}
  std::unique_ptr<CollectiveHandle> all_reduce_async(std::vector<torch::Tensor>) override {
    struct Done : CollectiveHandle {
      void wait() override {}
    };
    return std::make_unique<Done>();
  }
  std::unique_ptr<CollectiveHandle> reduce_async(torch::Tensor, int) override { return all_reduce_async({}); }
  void broadcast(torch::Tensor&, int) override {}
  torch::Tensor all_gather(const torch::Tensor& t) override { return t.dim() == 0 ? t.reshape({1}) : t; }
  torch::Tensor reduce_scatter(const torch::Tensor& input, ReduceOp) override { return input; }
  torch::Tensor all_to_all(const torch::Tensor& input) override { return input; }
  std::unique_ptr<CollectiveHandle> all_gather_async(torch::Tensor output, torch::Tensor input) override {
    output.view({-1}).copy_(input.view({-1}));
    return all_reduce_async({});
  }
  std::unique_ptr<CollectiveHandle> reduce_scatter_async(torch::Tensor output, torch::Tensor input) override {
    output.view({-1}).copy_(input.view({-1}));
    return all_reduce_async({});
  }
  void barrier() override {}
  std::vector<std::string> exchange(const std::string& mine) override { return {mine}; }
  std::unique_ptr<CollectiveHandle> send_async(torch::Tensor, int dst, int tag) override {
    throw UsageError(fmt::format(
        "send_async to rank {} (tag {}): point-to-point needs at least 2 processes, this job has 1; start it "
        "with accel-launch --num_processes N",
        dst, tag));
  }
  std::unique_ptr<CollectiveHandle> recv_async(torch::Tensor, int src, int tag) override {
    throw UsageError(fmt::format(
        "recv_async from rank {} (tag {}): point-to-point needs at least 2 processes, this job has 1; start "
        "it with accel-launch --num_processes N",
        src, tag));
  }
};

class WorkHandle final : public CollectiveHandle {
 public:
  WorkHandle(c10::intrusive_ptr<c10d::Work> work, std::vector<torch::Tensor> keep,
             std::chrono::milliseconds timeout, std::string what)
      : work_(std::move(work)), keep_(std::move(keep)), timeout_(timeout), what_(std::move(what)) {}
  void wait() override {
    try {
      work_->wait(timeout_);
    } catch (const std::exception& e) {
      throw DistributedError(fmt::format("{} failed: {}", what_, detail::c10d_failure(e)));
    }
  }

 private:
  c10::intrusive_ptr<c10d::Work> work_;
  std::vector<torch::Tensor> keep_;
  std::chrono::milliseconds timeout_;
  std::string what_;
};

// A collective run on copies (CUDA tensors on the host under CudaCollectives::Gloo, several tensors in one
// flat buffer): wait() waits for it, then copies each result back to the caller's tensor.
class CopyBackHandle final : public CollectiveHandle {
 public:
  CopyBackHandle(std::unique_ptr<CollectiveHandle> inner,
                 std::vector<std::pair<torch::Tensor, torch::Tensor>> back)
      : inner_(std::move(inner)), back_(std::move(back)) {}
  void wait() override {
    inner_->wait();
    const at::NoGradGuard no_grad;  // parameters (broadcast at prepare) are leaves that require grad
    for (auto& [device_tensor, host] : back_)
      device_tensor.copy_(host);
    back_.clear();
  }

 private:
  std::unique_ptr<CollectiveHandle> inner_;
  std::vector<std::pair<torch::Tensor, torch::Tensor>> back_;
};

torch::Tensor to_host(const torch::Tensor& t) {
  return t.detach().to(torch::kCPU).contiguous();
}

// What to do about a failed connection to the store: rank 0 fails at once when its port is taken, another
// rank after the timeout when rank 0 never listened. (A rank that never connected is named by
// wait_for_ranks.)
std::string rendezvous_hint(const ProcessState& st, const std::string& error) {
  if (st.rank != 0) return "; check that rank 0 runs and MASTER_ADDR/MASTER_PORT point at it";
  if (error.find("EADDRINUSE") != std::string::npos || error.find("already in use") != std::string::npos)
    return "; the port is already in use: choose another with --main_process_port (0 picks a free one)";
  return "; check that the port is free (--main_process_port) and every rank started";
}

std::string first_line(const std::string& s) {
  return s.substr(0, s.find('\n'));
}

std::vector<std::uint8_t> bytes_of(const std::string& text) {
  return {text.begin(), text.end()};
}

std::string text_of(const std::vector<std::uint8_t>& bytes) {
  return {bytes.begin(), bytes.end()};
}

// The job's identity in rank 0's store. Rank 0 publishes it as soon as the store exists (the run id last:
// readers wait for it), and every other rank reads it before it writes anything there, so that a rank of
// another job that reached this port (two jobs given one --main_process_port) is refused before it touches
// this job's keys. (Without it, such a rank joined the job: the two jobs' ranks trained together, or the
// healthy job failed.)
constexpr const char* kRunIdKey = "accel/run/id";
constexpr const char* kRunWorldKey = "accel/run/world_size";
constexpr const char* kRunOwnerKey = "accel/run/owner";

// Rank 0's TCPStore server, or a client of it. No rank counts itself in TCPStore's own "init/" barrier
// (waitWorkers): a stranger would count there before it could be refused; join_rendezvous waits instead.
c10::intrusive_ptr<c10d::Store> connect_store(const ProcessState& st, std::chrono::milliseconds timeout) {
  const auto started = std::chrono::steady_clock::now();
  try {
    c10d::TCPStoreOptions so;
    so.port = static_cast<std::uint16_t>(st.master_port);
    so.isServer = st.rank == 0;
    so.numWorkers = st.world_size;
    so.waitWorkers = false;
    so.timeout = timeout;
    return c10::make_intrusive<c10d::TCPStore>(st.master_addr, so);
  } catch (const std::exception& e) {
    // The time actually waited: a refused or taken port fails at once, long before the timeout.
    const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    throw DistributedError(
        fmt::format("rank {}: rendezvous with {}:{} failed after {:.1f} s (timeout {} s): {}{}", st.rank,
                    st.master_addr, st.master_port, waited, timeout.count() / 1000.0, first_line(e.what()),
                    rendezvous_hint(st, e.what())));
  }
}

// Rank 0: publishes the job's identity. Every other rank: refuses a store of another job.
void check_run_identity(c10d::Store& store, const ProcessState& st, const std::string& run_id,
                        std::chrono::milliseconds timeout) {
  if (st.rank == 0) {
    char host[256] = "?";
    ::gethostname(host, sizeof(host) - 1);
    store.set(kRunOwnerKey, bytes_of(fmt::format("world size {}, rank 0 is pid {} on {}, port {}",
                                                 st.world_size, ::getpid(), host, st.master_port)));
    store.set(kRunWorldKey, bytes_of(std::to_string(st.world_size)));
    store.set(kRunIdKey, bytes_of(run_id));
    return;
  }
  try {
    store.wait({kRunIdKey}, timeout);
  } catch (const std::exception& e) {
    throw DistributedError(fmt::format(
        "rank {}: the rendezvous store at {}:{} did not say which job it belongs to (timeout {} s: {}): "
        "what listens there is not rank 0 of an accelerate-cpp job of this version (another program, or an "
        "older accelerate-cpp), or rank 0 stopped; choose another port with --main_process_port (0 picks a "
        "free one)",
        st.rank, st.master_addr, st.master_port, timeout.count() / 1000.0, first_line(e.what())));
  }
  const std::string theirs = text_of(store.get(kRunIdKey));
  const std::string their_world = text_of(store.get(kRunWorldKey));
  if (theirs == run_id && their_world == std::to_string(st.world_size)) return;
  throw DistributedError(fmt::format(
      "rank {} of run '{}' (world size {}, port {}) reached the rendezvous store at {}:{} of another job: "
      "run '{}' ({}). Two jobs use port {}, and this rank was refused before it touched the other job. Give "
      "each job its own port (--main_process_port; 0 picks a free one on a single machine); the launchers of "
      "one multi-machine job must all be given the same --run_id (it reaches the ranks as "
      "TORCHELASTIC_RUN_ID)",
      st.rank, run_id, st.world_size, st.master_port, st.master_addr, st.master_port, theirs,
      text_of(store.get(kRunOwnerKey)), st.master_port));
}

// Each checked rank says so; rank 0 waits for all of them (TCPStore's own barrier, left off, did that).
void wait_for_ranks(c10d::Store& store, const ProcessState& st, std::chrono::milliseconds timeout) {
  auto key = [](int r) { return fmt::format("accel/run/joined/{}", r); };
  store.set(key(st.rank), bytes_of("1"));
  if (st.rank != 0) return;
  std::vector<std::string> keys;
  for (int r = 0; r < st.world_size; ++r)
    keys.push_back(key(r));
  try {
    store.wait(keys, timeout);
  } catch (const std::exception&) {
    std::vector<int> missing;
    for (int r = 0; r < st.world_size; ++r) {
      if (!store.check({key(r)})) missing.push_back(r);
    }
    throw DistributedError(fmt::format(
        "rank 0: rendezvous at {}:{}: not every one of the {} ranks connected within {} s (missing: rank(s) "
        "{}): check that each started and is still running (accel-launch names a rank that exited) and that "
        "all use this MASTER_ADDR/MASTER_PORT",
        st.master_addr, st.master_port, st.world_size, timeout.count() / 1000.0, fmt::join(missing, ", ")));
  }
}

// The job's store, once this rank is known to belong to the job it holds (run id and world size agree).
c10::intrusive_ptr<c10d::Store> join_rendezvous(const ProcessState& st, std::chrono::milliseconds timeout) {
  auto store = connect_store(st, timeout);
  check_run_identity(*store, st, detail::run_id_from_environment(), timeout);
  wait_for_ranks(*store, st, timeout);
  return store;
}

class C10dCommunicator final : public Communicator {
 public:
  // The job's communicator: rendezvous through rank 0's TCPStore.
  C10dCommunicator(ProcessState s, torch::Device device, CommunicatorOptions o)
      : Communicator(std::move(s), o), device_(device), store_(join_rendezvous(state_, options_.timeout)) {
    me_ = fmt::format("rank {}", state_.rank);
    create_process_groups();
  }

  // A sub-group: `state` holds the rank in the group and its size, `store` is the job's store under the
  // group's own prefix.
  C10dCommunicator(ProcessState s, torch::Device device, CommunicatorOptions o, std::vector<int> job_ranks,
                   c10::intrusive_ptr<c10d::Store> store)
      : Communicator(std::move(s), o, std::move(job_ranks)), device_(device), store_(std::move(store)) {
    me_ = fmt::format("rank {} (rank {} of group [{}])", job_ranks_[static_cast<std::size_t>(state_.rank)],
                      state_.rank, fmt::join(job_ranks_, ", "));
    create_process_groups();
  }

  // A communicator that is destroyed (open_communicator's; the job's communicators live until exit) shuts
  // its NCCL group down as torch.distributed.destroy_process_group does. Without it ProcessGroupNCCL's
  // destructor warns "destroy_process_group() was not called before program exit" (seen on the H200).
  ~C10dCommunicator() override {
    if (!nccl_) return;
    try {
      nccl_->shutdown();
    } catch (const std::exception&) {  // NOLINT(bugprone-empty-catch): nothing to do at teardown
    }
  }
  C10dCommunicator(const C10dCommunicator&) = delete;
  C10dCommunicator& operator=(const C10dCommunicator&) = delete;

  std::shared_ptr<Communicator> split(const std::vector<std::vector<int>>& groups) override {
    const auto mine = check_groups(groups);
    // Every rank must pass the same lists: compared through the store, so a mismatch is an error, not a
    // process group that never forms.
    const auto text = fmt::format("{}", fmt::join(groups, " "));
    const auto all = exchange(text);
    for (std::size_t r = 0; r < all.size(); ++r) {
      if (all[r] != text) {
        throw DistributedError(fmt::format(
            "{}: split: the ranks pass different groups (this rank {}, rank {} {}); every rank must pass the "
            "same lists",
            me(), text, job_ranks_[r], all[r]));
      }
    }
    const auto seq = split_seq_++;
    const auto& group = groups[mine];
    std::vector<int> job;
    int index = 0;
    for (std::size_t i = 0; i < group.size(); ++i) {
      job.push_back(job_ranks_[static_cast<std::size_t>(group[i])]);
      if (group[i] == rank()) index = static_cast<int>(i);
    }
    ProcessState sub = state_;
    sub.rank = index;
    sub.world_size = static_cast<int>(group.size());
    if (group.size() == 1) return std::make_shared<SingleProcessCommunicator>(sub, options_, std::move(job));
    auto store = c10::make_intrusive<c10d::PrefixStore>(fmt::format("accel/split/{}/{}", seq, mine), store_);
    return std::make_shared<C10dCommunicator>(sub, device_, options_, std::move(job), std::move(store));
  }

  void all_reduce(torch::Tensor& tensor, ReduceOp op) override {
    if (staged(tensor)) return in_place_on_host(tensor, [&](torch::Tensor& host) { all_reduce(host, op); });
    check("all_reduce", fmt::format("{}, op={}", describe(tensor), op_name(op)));
    std::vector<torch::Tensor> ts{tensor};
    c10d::AllreduceOptions o;
    o.reduceOp = to_c10d(op);
    o.timeout = options_.timeout;
    run("all_reduce", [&] { return backend_for(tensor)->allreduce(ts, o); });
    if (op == ReduceOp::Mean) tensor.div_(world_size());
    count(Collective::AllReduce, tensor.nbytes(), ring_all_reduce(tensor.nbytes()));
  }

  std::unique_ptr<CollectiveHandle> all_reduce_async(std::vector<torch::Tensor> tensors) override {
    if (tensors.empty())
      throw UsageError(fmt::format("{}: all_reduce_async needs at least one tensor", me()));
    if (tensors.size() > 1) return coalesced_all_reduce(tensors);
    if (staged(tensors.front())) {
      auto host = to_host(tensors.front());
      return std::make_unique<CopyBackHandle>(all_reduce_async({host}),
                                              std::vector{std::pair{tensors.front(), host}});
    }
    std::string desc;
    std::uint64_t bytes = 0;
    for (const auto& t : tensors) {
      desc += (desc.empty() ? "" : "; ") + describe(t);
      bytes += t.nbytes();
    }
    check("all_reduce", desc + ", op=sum");
    c10d::AllreduceOptions o;
    o.timeout = options_.timeout;
    c10::intrusive_ptr<c10d::Work> work;
    try {
      work = backend_for(tensors.front())->allreduce(tensors, o);
    } catch (const std::exception& e) {
      throw DistributedError(fmt::format("{}: all_reduce failed: {}", me(), detail::c10d_failure(e)));
    }
    count(Collective::AllReduce, bytes, ring_all_reduce(bytes));
    return std::make_unique<WorkHandle>(std::move(work), std::move(tensors), options_.timeout,
                                        fmt::format("{}: all_reduce", me()));
  }

  std::unique_ptr<CollectiveHandle> reduce_async(torch::Tensor tensor, int root) override {
    if (staged(tensor)) {
      auto host = to_host(tensor);
      auto inner = reduce_async(host, root);
      // Only the root's tensor receives the sum (the others' are left as they are, as NCCL leaves them).
      std::vector<std::pair<torch::Tensor, torch::Tensor>> back;
      if (rank() == root) back.emplace_back(tensor, host);
      return std::make_unique<CopyBackHandle>(std::move(inner), std::move(back));
    }
    check("reduce", fmt::format("{}, root={}", describe(tensor), root));
    std::vector<torch::Tensor> ts{tensor};
    count(Collective::Reduce, tensor.nbytes(), rank() == root ? 0 : tensor.nbytes());
    if (point_to_point(tensor) && tensor.is_contiguous()) {
      return detail::p2p_reduce(*gloo_, tensor, root, next_tags(), kP2PChunk, options_.timeout,
                                fmt::format("{}: reduce", me()));
    }
    c10d::ReduceOptions o;
    o.rootRank = root;
    o.timeout = options_.timeout;
    c10::intrusive_ptr<c10d::Work> work;
    try {
      work = backend_for(tensor)->reduce(ts, o);
    } catch (const std::exception& e) {
      throw DistributedError(fmt::format("{}: reduce failed: {}", me(), detail::c10d_failure(e)));
    }
    return std::make_unique<WorkHandle>(std::move(work), std::move(ts), options_.timeout,
                                        fmt::format("{}: reduce", me()));
  }

  void broadcast(torch::Tensor& tensor, int root) override {
    if (staged(tensor)) return in_place_on_host(tensor, [&](torch::Tensor& host) { broadcast(host, root); });
    check("broadcast", fmt::format("{}, root={}", describe(tensor), root));
    std::vector<torch::Tensor> ts{tensor};
    c10d::BroadcastOptions o;
    o.rootRank = root;
    o.timeout = options_.timeout;
    run("broadcast", [&] { return backend_for(tensor)->broadcast(ts, o); });
    count(Collective::Broadcast, tensor.nbytes(), rank() == root ? tensor.nbytes() : 0);
  }

  torch::Tensor all_gather(const torch::Tensor& tensor) override {
    if (staged(tensor)) return all_gather(to_host(tensor)).to(tensor.device());
    check("all_gather", describe(tensor));
    auto in = tensor.dim() == 0 ? tensor.reshape({1}).contiguous() : tensor.contiguous();
    auto sizes = in.sizes().vec();
    sizes[0] *= world_size();
    auto out = torch::empty(sizes, in.options());
    if (point_to_point(in)) {
      detail::p2p_all_gather(*gloo_, out, in, next_tags(), kP2PChunk, options_.timeout,
                             fmt::format("{}: all_gather", me()))
          ->wait();
    } else {
      c10d::AllgatherOptions o;
      o.timeout = options_.timeout;
      run("all_gather", [&] { return backend_for(in)->_allgather_base(out, in, o); });
    }
    count(Collective::AllGather, in.nbytes(), in.nbytes() * static_cast<std::uint64_t>(world_size() - 1));
    return out;
  }

  torch::Tensor all_to_all(const torch::Tensor& input) override {
    if (input.dim() == 0 || input.size(0) % world_size() != 0) {
      throw UsageError(
          fmt::format("{}: all_to_all of {}: dim 0 must be a multiple of the group size {} (one "
                      "equal block per rank)",
                      me(), describe(input), world_size()));
    }
    if (staged(input)) return all_to_all(to_host(input)).to(input.device());
    check("all_to_all", describe(input));
    auto in = input.contiguous();
    auto out = torch::empty_like(in);
    c10d::AllToAllOptions o;
    o.timeout = options_.timeout;
    std::vector<std::int64_t> equal;  // empty split sizes: equal blocks
    run("all_to_all", [&] { return backend_for(in)->alltoall_base(out, in, equal, equal, o); });
    count(Collective::AllToAll, in.nbytes(),
          in.nbytes() / static_cast<std::uint64_t>(world_size()) *
              static_cast<std::uint64_t>(world_size() - 1));
    return out;
  }

  torch::Tensor reduce_scatter(const torch::Tensor& input, ReduceOp op) override {
    if (staged(input)) return reduce_scatter(to_host(input), op).to(input.device());
    check("reduce_scatter", fmt::format("{}, op={}", describe(input), op_name(op)));
    if (input.numel() % world_size() != 0) {
      throw UsageError(
          fmt::format("reduce_scatter: {} elements do not split into {} equal shards; pad the input",
                      input.numel(), world_size()));
    }
    auto in = input.contiguous();
    auto out = torch::empty({in.numel() / world_size()}, in.options());
    auto flat = in.view({-1});
    if (point_to_point(in) && (op == ReduceOp::Sum || op == ReduceOp::Mean)) {
      detail::p2p_reduce_scatter(*gloo_, out, flat, next_tags(), kP2PChunk, options_.timeout,
                                 fmt::format("{}: reduce_scatter", me()))
          ->wait();
    } else {
      c10d::ReduceScatterOptions o;
      o.reduceOp = to_c10d(op);
      o.timeout = options_.timeout;
      run("reduce_scatter", [&] { return backend_for(in)->_reduce_scatter_base(out, flat, o); });
    }
    if (op == ReduceOp::Mean) out.div_(world_size());
    count(Collective::ReduceScatter, in.nbytes(), in.nbytes() / world_size() * (world_size() - 1));
    return out;
  }

  std::unique_ptr<CollectiveHandle> all_gather_async(torch::Tensor output, torch::Tensor input) override {
    check_split("all_gather", output, input);
    if (staged(input)) {
      auto host_out = torch::empty(output.sizes(), output.options().device(torch::kCPU));
      auto inner = all_gather_async(host_out, to_host(input));
      return std::make_unique<CopyBackHandle>(std::move(inner), std::vector{std::pair{output, host_out}});
    }
    check("all_gather", describe(input));
    c10d::AllgatherOptions o;
    o.timeout = options_.timeout;
    auto in = input.view({-1}), out = output.view({-1});
    count(Collective::AllGather, in.nbytes(), in.nbytes() * static_cast<std::uint64_t>(world_size() - 1));
    if (point_to_point(in)) {
      return detail::p2p_all_gather(*gloo_, out, in, next_tags(), kP2PChunk, options_.timeout,
                                    fmt::format("{}: all_gather", me()));
    }
    c10::intrusive_ptr<c10d::Work> work;
    try {
      work = backend_for(in)->_allgather_base(out, in, o);
    } catch (const std::exception& e) {
      throw DistributedError(fmt::format("{}: all_gather failed: {}", me(), detail::c10d_failure(e)));
    }
    return std::make_unique<WorkHandle>(std::move(work), std::vector<torch::Tensor>{in, out},
                                        options_.timeout, fmt::format("{}: all_gather", me()));
  }

  std::unique_ptr<CollectiveHandle> reduce_scatter_async(torch::Tensor output, torch::Tensor input) override {
    check_split("reduce_scatter", input, output);
    if (staged(input)) {
      auto host_out = torch::empty(output.sizes(), output.options().device(torch::kCPU));
      auto inner = reduce_scatter_async(host_out, to_host(input));
      return std::make_unique<CopyBackHandle>(std::move(inner), std::vector{std::pair{output, host_out}});
    }
    check("reduce_scatter", fmt::format("{}, op=sum", describe(input)));
    c10d::ReduceScatterOptions o;
    o.reduceOp = to_c10d(ReduceOp::Sum);
    o.timeout = options_.timeout;
    auto in = input.view({-1}), out = output.view({-1});
    count(Collective::ReduceScatter, in.nbytes(),
          out.nbytes() * static_cast<std::uint64_t>(world_size() - 1));
    if (point_to_point(in)) {
      return detail::p2p_reduce_scatter(*gloo_, out, in, next_tags(), kP2PChunk, options_.timeout,
                                        fmt::format("{}: reduce_scatter", me()));
    }
    c10::intrusive_ptr<c10d::Work> work;
    try {
      work = backend_for(in)->_reduce_scatter_base(out, in, o);
    } catch (const std::exception& e) {
      throw DistributedError(fmt::format("{}: reduce_scatter failed: {}", me(), detail::c10d_failure(e)));
    }
    return std::make_unique<WorkHandle>(std::move(work), std::vector<torch::Tensor>{in, out},
                                        options_.timeout, fmt::format("{}: reduce_scatter", me()));
  }

  std::unique_ptr<CollectiveHandle> send_async(torch::Tensor tensor, int dst, int tag) override {
    if (staged(tensor) && tensor.is_contiguous()) return point_to_point_op(true, to_host(tensor), dst, tag);
    return point_to_point_op(true, std::move(tensor), dst, tag);
  }

  std::unique_ptr<CollectiveHandle> recv_async(torch::Tensor tensor, int src, int tag) override {
    if (staged(tensor) && tensor.is_contiguous()) {
      auto host = torch::empty(tensor.sizes(), tensor.options().device(torch::kCPU));
      auto inner = point_to_point_op(false, host, src, tag);
      return std::make_unique<CopyBackHandle>(std::move(inner), std::vector{std::pair{tensor, host}});
    }
    return point_to_point_op(false, std::move(tensor), src, tag);
  }

  void barrier() override {
    check("barrier", "");
    c10d::BarrierOptions o;
    o.timeout = options_.timeout;
    run("barrier", [&] { return gloo_->barrier(o); });
    count(Collective::Barrier, 0, 0);
  }

  std::vector<std::string> exchange(const std::string& mine) override {
    const auto seq = exchange_seq_++;
    auto key = [&](int r) { return fmt::format("accel/x/{}/{}", seq, r); };
    store_->set(key(rank()), std::vector<std::uint8_t>(mine.begin(), mine.end()));
    std::vector<std::string> keys;
    for (int r = 0; r < world_size(); ++r)
      keys.push_back(key(r));
    wait_keys(keys, fmt::format("exchange #{}", seq));
    std::vector<std::string> out;
    for (const auto& k : keys) {
      const auto v = store_->get(k);
      out.emplace_back(v.begin(), v.end());
    }
    // Everyone has read the previous round once they wrote this one: drop our key of the previous round.
    if (seq > 0) store_->deleteKey(fmt::format("accel/x/{}/{}", seq - 1, rank()));
    count(Collective::Exchange, mine.size(), mine.size());
    return out;
  }

 private:
  // "rank 3", or for a sub-group "rank 3 (rank 1 of group [1, 3])": the job's rank first, as users and
  // accel-launch know ranks.
  const std::string& me() const noexcept { return me_; }

  void create_process_groups() {
    const auto& st = state_;
    try {
      auto gloo_options = c10d::ProcessGroupGloo::Options::create();
      gloo_options->timeout = options_.timeout;
      const bool loopback = st.master_addr.rfind("127.", 0) == 0 || st.master_addr == "localhost";
      gloo_options->devices.push_back(loopback ? c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1")
                                               : c10d::ProcessGroupGloo::createDefaultDevice());
      gloo_ = c10::make_intrusive<c10d::ProcessGroupGloo>(
          c10::make_intrusive<c10d::PrefixStore>("gloo", store_), st.rank, st.world_size, gloo_options);
      if (device_.is_cuda() && options_.cuda_collectives == CudaCollectives::Nccl) {
        nccl_ = detail::make_nccl_backend(c10::make_intrusive<c10d::PrefixStore>("nccl", store_), st.rank,
                                          st.world_size, options_.timeout);
      }
    } catch (const Error&) {
      throw;
    } catch (const std::exception& e) {
      throw DistributedError(
          fmt::format("{}: creating the process group failed: {}", me_, first_line(e.what())));
    }
  }

  std::uint64_t ring_all_reduce(std::uint64_t bytes) const {
    return 2 * bytes * static_cast<std::uint64_t>(world_size() - 1) /
           static_cast<std::uint64_t>(world_size());
  }

  // `whole` must be contiguous with world_size x the numel of the contiguous `part`, on the same device.
  void check_split(const char* op, const torch::Tensor& whole, const torch::Tensor& part) const {
    if (!whole.is_contiguous() || !part.is_contiguous() || whole.numel() != part.numel() * world_size() ||
        whole.device() != part.device() || whole.scalar_type() != part.scalar_type()) {
      throw UsageError(fmt::format(
          "{}: needs contiguous tensors of one dtype and device, the whole holding world_size ({}) x the "
          "part's elements; got {} and {}",
          op, world_size(), describe(whole), describe(part)));
    }
  }

  std::unique_ptr<CollectiveHandle> point_to_point_op(bool send, torch::Tensor tensor, int peer, int tag) {
    const char* op = send ? "send_async" : "recv_async";
    const auto what = fmt::format("{}: {} {} rank {} (tag {}, {})", me(), op, send ? "to" : "from", peer, tag,
                                  tensor.defined() ? describe(tensor) : "undefined tensor");
    if (peer < 0 || peer >= world_size() || peer == rank()) {
      throw UsageError(fmt::format("{}: the peer must be another rank in [0, {})", what, world_size()));
    }
    if (tag < 0 || tag >= kPointToPointTagLimit) {
      throw UsageError(fmt::format(
          "{}: the tag must lie in [0, 2^30); the tags above are reserved for accel's collectives", what));
    }
    if (!tensor.defined() || !tensor.is_contiguous()) {
      throw UsageError(fmt::format("{}: needs a defined, contiguous tensor; pass tensor.contiguous()", what));
    }
    std::vector<torch::Tensor> ts{tensor};
    c10::intrusive_ptr<c10d::Work> work;
    try {
      work = send ? backend_for(tensor)->send(ts, peer, tag) : backend_for(tensor)->recv(ts, peer, tag);
    } catch (const Error&) {
      throw;
    } catch (const std::exception& e) {
      throw DistributedError(fmt::format("{} failed: {}", what, detail::c10d_failure(e)));
    }
    count(Collective::PointToPoint, tensor.nbytes(), send ? tensor.nbytes() : 0);
    return std::make_unique<WorkHandle>(std::move(work), std::move(ts), options_.timeout, what);
  }

  // Chunk of the point-to-point reduce-scatter: additions of one chunk overlap the transfer of the next.
  static constexpr std::int64_t kP2PChunk = 1 << 18;

  // Reduce-scatter, all-gather and reduce of CPU tensors go point to point unless the built-in one was asked
  // for (bench_collectives measured p2p faster at every size on Gloo; BENCHMARKS.md).
  bool point_to_point(const torch::Tensor& t) const {
    return !t.is_cuda() && options_.cpu_collectives != CpuCollectives::Builtin;
  }

  // Tags of the next point-to-point collective: every rank issues collectives in the same order, so the
  // counter agrees; above 2^30, clear of the tags a program's own send/recv would use.
  detail::P2PTags next_tags() {
    constexpr std::int64_t kBase = std::int64_t{1} << 30, kRounds = 1 << 16;
    return {kBase + static_cast<std::int64_t>(p2p_seq_++ % kRounds) * detail::P2PTags::kChunks};
  }

  // Several tensors reduced each on its own: one process-group call on a list would take them for one
  // buffer's copies on several devices (Gloo sums them into each other, NCCL wants one per device), so they
  // travel as one flat buffer and are copied back when the reduction is done.
  std::unique_ptr<CollectiveHandle> coalesced_all_reduce(const std::vector<torch::Tensor>& tensors) {
    const auto& first = tensors.front();
    std::vector<torch::Tensor> parts;
    for (const auto& t : tensors) {
      if (t.scalar_type() != first.scalar_type() || t.device() != first.device()) {
        throw UsageError(
            fmt::format("{}: all_reduce_async needs tensors of one dtype and device; got {} and {}", me(),
                        describe(first), describe(t)));
      }
      parts.push_back(t.detach().reshape({-1}));
    }
    auto flat = torch::cat(parts);
    std::vector<std::pair<torch::Tensor, torch::Tensor>> back;
    std::int64_t at = 0;
    for (const auto& t : tensors) {
      back.emplace_back(t, flat.narrow(0, at, t.numel()).view(t.sizes()));
      at += t.numel();
    }
    return std::make_unique<CopyBackHandle>(all_reduce_async({flat}), std::move(back));
  }

  // An in-place collective of a CUDA tensor on a host copy, the result copied back.
  template <class F>
  static void in_place_on_host(torch::Tensor& tensor, F&& collective) {
    auto host = to_host(tensor);
    collective(host);
    const at::NoGradGuard no_grad;  // a parameter is a leaf that requires grad
    tensor.copy_(host);
  }

  // CudaCollectives::Gloo: a CUDA tensor's collective runs on a host copy (no NCCL group was created).
  bool staged(const torch::Tensor& t) const {
    return t.defined() && t.is_cuda() && device_.is_cuda() && !nccl_;
  }

  c10d::Backend* backend_for(const torch::Tensor& t) {
    if (t.is_cuda()) {
      if (!nccl_) {
        throw UsageError(fmt::format("{}: a CUDA tensor reached a collective, but the accelerator runs on {}",
                                     me(), device_.str()));
      }
      return nccl_.get();
    }
    return gloo_.get();
  }

  template <class F>
  void run(const char* what, F&& start) {
    try {
      start()->wait(options_.timeout);
    } catch (const Error&) {
      throw;
    } catch (const std::exception& e) {
      throw DistributedError(fmt::format("{}: {} failed: {}", me(), what, detail::c10d_failure(e)));
    }
  }

  void wait_keys(const std::vector<std::string>& keys, const std::string& what) {
    const auto started = std::chrono::steady_clock::now();
    try {
      store_->wait(keys, options_.timeout);
    } catch (const std::exception&) {
      const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
      std::vector<int> missing;
      for (int r = 0; r < world_size(); ++r) {
        if (!store_->check({keys[static_cast<std::size_t>(r)]}))
          missing.push_back(job_ranks_[static_cast<std::size_t>(r)]);
      }
      throw DistributedError(fmt::format(
          "{}: rank(s) {} did not reach {} (waited {:.1f} s, timeout {} s); they are stuck, crashed, "
          "or took a different code path",
          me(), fmt::join(missing, ", "), what, waited, options_.timeout.count() / 1000.0));
    }
  }

  // Debug mode: every rank publishes a description of the collective it is about to run and compares it with
  // everyone else's. A mismatch (or a rank that never arrives) is a DistributedError on every rank.
  void check(const char* op, const std::string& args) {
    if (!options_.debug) return;
    const auto seq = debug_seq_++;
    const std::string mine = fmt::format("{}({})", op, args);
    auto key = [&](int r) { return fmt::format("accel/debug/{}/{}", seq, r); };
    store_->set(key(rank()), std::vector<std::uint8_t>(mine.begin(), mine.end()));
    std::vector<std::string> keys;
    for (int r = 0; r < world_size(); ++r)
      keys.push_back(key(r));
    wait_keys(keys, fmt::format("collective #{} ({} on {})", seq, mine, me()));
    std::vector<std::string> calls;
    bool same = true;
    for (const auto& k : keys) {
      const auto v = store_->get(k);
      calls.emplace_back(v.begin(), v.end());
      same = same && calls.back() == mine;
    }
    if (seq > 0) store_->deleteKey(fmt::format("accel/debug/{}/{}", seq - 1, rank()));
    if (!same) {
      std::string lines;
      for (int r = 0; r < world_size(); ++r)
        lines += fmt::format("\n  rank {}: {}", job_ranks_[static_cast<std::size_t>(r)],
                             calls[static_cast<std::size_t>(r)]);
      throw DistributedError(fmt::format(
          "{}: collective #{} differs across ranks (debug mode caught it instead of a hang):{}\nEvery "
          "rank must call the same collectives, in the same order, with the same shapes and dtypes; pad with "
          "accelerator.pad_across_processes() when sizes differ.",
          me(), seq, lines));
    }
  }

  torch::Device device_;
  c10::intrusive_ptr<c10d::Store> store_;
  c10::intrusive_ptr<c10d::Backend> gloo_;
  c10::intrusive_ptr<c10d::Backend> nccl_;
  std::uint64_t debug_seq_ = 0;
  std::uint64_t exchange_seq_ = 0;
  std::uint64_t p2p_seq_ = 0;
  std::uint64_t split_seq_ = 0;
  std::string me_;
};

}  // namespace

std::shared_ptr<Communicator> Communicator::create(const ProcessState& state, torch::Device device,
                                                   CommunicatorOptions options) {
  if (state.world_size == 1) return std::make_shared<SingleProcessCommunicator>(state, options);
  // Process-wide, never destroyed: tearing a TCPStore server down while a peer may already be reconnecting
  // for the next Accelerator would race, and the OS reclaims sockets and threads at exit anyway.
  static std::mutex mutex;
  static auto* live = new std::map<std::string, std::shared_ptr<Communicator>>();
  const auto key = fmt::format("{}:{}/{}/{}/{}", state.master_addr, state.master_port, state.rank,
                               state.world_size, device.str());
  std::lock_guard<std::mutex> lock(mutex);
  auto& slot = (*live)[key];
  if (!slot) slot = std::make_shared<C10dCommunicator>(state, device, options);
  // The process group of CUDA tensors was chosen when the connection was made (an NCCL group exists or not):
  // options() keeps saying which.
  auto kept = options;
  kept.cuda_collectives = slot->options().cuda_collectives;
  slot->set_options(kept);
  return slot;
}

std::shared_ptr<Communicator> open_communicator(const ProcessState& state, torch::Device device,
                                                CommunicatorOptions options) {
  if (state.world_size > 1) return Communicator::create(state, device, options);
  return std::make_shared<C10dCommunicator>(state, device, options);
}

}  // namespace accel
