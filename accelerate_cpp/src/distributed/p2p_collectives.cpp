#include "distributed/p2p_collectives.hpp"

#include <accel/errors.hpp>

#include <fmt/format.h>

#include <algorithm>
#include <functional>
#include <utility>
#include <vector>

namespace accel::detail {

std::string c10d_failure(const std::exception& e) {
  const std::string message = e.what();
  const std::string first = message.substr(0, message.find('\n'));
  for (const char* gone : {"Connection reset by peer", "Connection closed by peer", "Broken pipe"}) {
    if (message.find(gone) == std::string::npos) continue;
    return fmt::format(
        "another rank of the group closed its connection ({}): that rank stopped first (an error, a crash or "
        "a "
        "kill), and its own message, printed before this one, is the cause; this failure is only its "
        "consequence",
        gone);
  }
  return first;
}

namespace {

using WorkPtr = c10::intrusive_ptr<c10d::Work>;

/// A chunk [at, at + len) of the flat range a collective moves.
struct Chunk {
  std::int64_t at, len;
};

/// Posted sends and receives; `finish(chunk)` runs once that chunk's receives completed.
class P2PHandle final : public CollectiveHandle {
 public:
  P2PHandle(std::chrono::milliseconds timeout, std::string what)
      : timeout_(timeout), what_(std::move(what)) {}

  void wait() override {
    for (std::size_t c = 0; c < recvs.size(); ++c) {
      for (auto& w : recvs[c])
        wait_one(w);
      if (finish) finish(chunks[c]);
      if (after_chunk) after_chunk(c);
    }
    for (auto& w : sends)
      wait_one(w);
    recvs.clear();
    sends.clear();
    finish = nullptr;
    after_chunk = nullptr;
  }

  std::vector<WorkPtr> sends;
  std::vector<Chunk> chunks;
  std::vector<std::vector<WorkPtr>> recvs;  // per chunk
  std::function<void(Chunk)> finish;
  /// Runs after chunk c's receives (and `finish`), with its index: p2p_reduce adds it and posts a later
  /// chunk's receives into the slots it freed.
  std::function<void(std::size_t)> after_chunk;

 private:
  void wait_one(const WorkPtr& work) const {
    try {
      work->wait(timeout_);
    } catch (const std::exception& e) {
      throw DistributedError(fmt::format("{} failed: {}", what_, c10d_failure(e)));
    }
  }

  std::chrono::milliseconds timeout_;
  std::string what_;
};

WorkPtr post(c10d::Backend& group, bool send, torch::Tensor tensor, int peer, std::int64_t tag) {
  std::vector<torch::Tensor> ts{std::move(tensor)};
  return send ? group.send(ts, peer, static_cast<int>(tag)) : group.recv(ts, peer, static_cast<int>(tag));
}

/// The chunks of [0, total): about `wanted` elements each, at least one, and few enough for the tag space.
std::vector<Chunk> chunks_of(std::int64_t total, std::int64_t wanted) {
  const auto chunk = std::max({wanted, (total + P2PTags::kChunks - 1) / P2PTags::kChunks, std::int64_t{1}});
  std::vector<Chunk> out;
  for (std::int64_t at = 0; at < total; at += chunk)
    out.push_back({at, std::min(chunk, total - at)});
  return out;
}

/// Chunks a reduce's root receives at once (p2p_reduce): its receive memory is this many chunks per peer.
constexpr std::size_t kReduceWindow = 8;

/// Index of `peer`'s part among the n - 1 parts rank r receives (the other ranks, in rank order).
int peer_slot(int r, int peer) {
  return peer < r ? peer : peer - 1;
}

/// Posts chunk c's exchange with every peer, in rotated order (r+1, r+2, ...: no rank is everyone's first
/// partner): the send of `to_peer(to)` (when given) and the receive into `from_peer(from)` (when given).
void post_exchange(P2PHandle& handle, c10d::Backend& group, std::int64_t tag,
                   const std::function<torch::Tensor(int)>& to_peer,
                   const std::function<torch::Tensor(int)>& from_peer) {
  const int n = group.getSize(), r = group.getRank();
  handle.recvs.emplace_back();
  for (int k = 1; k < n; ++k) {
    const int to = (r + k) % n, from = (r - k + n) % n;
    if (to_peer) handle.sends.push_back(post(group, true, to_peer(to), to, tag));
    if (from_peer) handle.recvs.back().push_back(post(group, false, from_peer(from), from, tag));
  }
}

}  // namespace

std::unique_ptr<CollectiveHandle> p2p_reduce_scatter(c10d::Backend& group, torch::Tensor output,
                                                     torch::Tensor input, P2PTags tags,
                                                     std::int64_t chunk_elements,
                                                     std::chrono::milliseconds timeout, std::string what) {
  const int n = group.getSize(), r = group.getRank();
  auto out = output.view({-1}), in = input.view({-1});
  const auto shard = out.numel();
  auto handle = std::make_unique<P2PHandle>(timeout, std::move(what));
  handle->chunks = chunks_of(shard, chunk_elements);
  // Two ranks: the peer's part lands in `output` itself; more: in one slot per peer.
  const auto slots = n == 2 ? out.view({1, shard}) : torch::empty({n - 1, shard}, out.options());
  for (std::size_t c = 0; c < handle->chunks.size(); ++c) {
    const auto at = handle->chunks[c].at, len = handle->chunks[c].len;
    post_exchange(
        *handle, group, tags.base + static_cast<std::int64_t>(c),
        [&](int to) { return in.narrow(0, to * shard + at, len); },
        [&](int from) { return slots[peer_slot(r, from)].narrow(0, at, len); });
  }
  handle->finish = [n, r, shard, out, in, slots](Chunk chunk) {
    const auto at = chunk.at, len = chunk.len;
    auto part = [&](int k) {
      return k == r ? in.narrow(0, r * shard + at, len) : slots[peer_slot(r, k)].narrow(0, at, len);
    };
    auto o = out.narrow(0, at, len);
    if (n == 1) {
      o.copy_(part(r));  // a one-process group: nothing arrives
      return;
    }
    if (n == 2) {
      o.add_(part(r));  // o holds the peer's part
      return;
    }
    at::add_out(o, part(0), part(1));  // in rank order, the same on every rank
    for (int k = 2; k < n; ++k)
      o.add_(part(k));
  };
  return handle;
}

std::unique_ptr<CollectiveHandle> p2p_all_gather(c10d::Backend& group, torch::Tensor output,
                                                 torch::Tensor input, P2PTags tags,
                                                 std::int64_t chunk_elements,
                                                 std::chrono::milliseconds timeout, std::string what) {
  const int r = group.getRank();
  auto out = output.view({-1}), in = input.view({-1});
  const auto part = in.numel();
  auto handle = std::make_unique<P2PHandle>(timeout, std::move(what));
  const auto chunks = chunks_of(part, chunk_elements);
  for (std::size_t c = 0; c < chunks.size(); ++c) {
    const auto at = chunks[c].at, len = chunks[c].len;
    post_exchange(
        *handle, group, tags.base + static_cast<std::int64_t>(c), [&](int) { return in.narrow(0, at, len); },
        [&](int from) { return out.narrow(0, from * part + at, len); });
  }
  if (part > 0) out.narrow(0, r * part, part).copy_(in);  // while the peers' parts arrive
  return handle;
}

std::unique_ptr<CollectiveHandle> p2p_reduce(c10d::Backend& group, torch::Tensor tensor, int root,
                                             P2PTags tags, std::int64_t chunk_elements,
                                             std::chrono::milliseconds timeout, std::string what) {
  const int n = group.getSize(), r = group.getRank();
  auto t = tensor.view({-1});
  auto handle = std::make_unique<P2PHandle>(timeout, std::move(what));
  const auto chunks = chunks_of(t.numel(), chunk_elements);
  if (r != root) {
    for (std::size_t c = 0; c < chunks.size(); ++c) {
      handle->sends.push_back(post(group, true, t.narrow(0, chunks[c].at, chunks[c].len), root,
                                   tags.base + static_cast<std::int64_t>(c)));
    }
    return handle;
  }
  if (chunks.empty() || n == 1) return handle;
  handle->chunks = chunks;
  // The root receives a window of chunks at a time into chunk-sized slots and posts chunk c + window's
  // receives once chunk c is added: (n - 1) x window chunks of memory, not (n - 1) copies of the tensor
  // (under ZeRO-2 the owner of a one-parameter bucket, Qwen2.5-0.5B's LM head, held 545 MB more). The
  // senders post every chunk at once, as before.
  const auto window = std::min<std::size_t>(kReduceWindow, chunks.size());
  const auto slots =
      torch::empty({n - 1, static_cast<std::int64_t>(window), chunks.front().len}, t.options());
  auto slot = [slots, window, chunks, r](int from, std::size_t c) {
    return slots[peer_slot(r, from)][static_cast<std::int64_t>(c % window)].narrow(0, 0, chunks[c].len);
  };
  handle->recvs.resize(chunks.size());
  P2PHandle* h = handle.get();
  c10d::Backend* g = &group;
  auto post_chunk = [h, g, n, r, tags, slot](std::size_t c) {
    for (int k = 1; k < n; ++k) {  // rotated, as post_exchange
      const int from = (r - k + n) % n;
      h->recvs[c].push_back(post(*g, false, slot(from, c), from, tags.base + static_cast<std::int64_t>(c)));
    }
  };
  for (std::size_t c = 0; c < window; ++c)
    post_chunk(c);
  // Chunk c arrived: the root's own values, then the others' in rank order; then its slot takes a later
  // chunk.
  handle->after_chunk = [post_chunk, slot, chunks, t, n, r, window](std::size_t c) {
    auto o = t.narrow(0, chunks[c].at, chunks[c].len);
    for (int k = 0; k < n; ++k) {
      if (k != r) o.add_(slot(k, c));
    }
    if (c + window < chunks.size()) post_chunk(c + window);
  };
  return handle;
}

}  // namespace accel::detail
