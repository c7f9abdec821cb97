#include "p2p_collectives.hpp"

#include <accel/errors.hpp>

#include <fmt/format.h>

#include <algorithm>
#include <functional>
#include <utility>
#include <vector>

namespace accel::detail {
namespace {

using WorkPtr = c10::intrusive_ptr<c10d::Work>;

/// Posted sends and receives; `finish(c)` runs once chunk c's receives completed.
class P2PHandle final : public CollectiveHandle {
 public:
  P2PHandle(std::chrono::milliseconds timeout, std::string what)
      : timeout_(timeout), what_(std::move(what)) {}

  void wait() override {
    for (std::size_t c = 0; c < recvs.size(); ++c) {
      for (auto& w : recvs[c])
        wait_one(w);
      if (finish) finish(c);
    }
    for (auto& w : sends)
      wait_one(w);
    recvs.clear();
    sends.clear();
    finish = nullptr;
  }

  std::vector<WorkPtr> sends;
  std::vector<std::vector<WorkPtr>> recvs;  // per chunk
  std::function<void(std::size_t)> finish;

 private:
  void wait_one(const WorkPtr& work) const {
    try {
      work->wait(timeout_);
    } catch (const std::exception& e) {
      const std::string message = e.what();
      throw DistributedError(fmt::format("{} failed: {}", what_, message.substr(0, message.find('\n'))));
    }
  }

  std::chrono::milliseconds timeout_;
  std::string what_;
};

WorkPtr post(c10d::Backend& group, bool send, torch::Tensor tensor, int peer, std::int64_t tag) {
  std::vector<torch::Tensor> ts{std::move(tensor)};
  return send ? group.send(ts, peer, static_cast<int>(tag)) : group.recv(ts, peer, static_cast<int>(tag));
}

// Elements per chunk: about `wanted`, at least one, and few enough chunks for the tag space.
std::int64_t chunk_size(std::int64_t wanted, std::int64_t total) {
  return std::max({wanted, (total + P2PTags::kChunks - 1) / P2PTags::kChunks, std::int64_t{1}});
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
  if (shard == 0) return handle;
  const auto chunk = chunk_size(chunk_elements, shard);
  // Two ranks: the peer's part lands in `output` itself; more: in one slot per peer.
  const auto slots = n == 2 ? out.view({1, shard}) : torch::empty({n - 1, shard}, out.options());
  auto slot = [r](int peer) { return peer < r ? peer : peer - 1; };
  for (std::int64_t at = 0, c = 0; at < shard; at += chunk, ++c) {
    const auto len = std::min(chunk, shard - at);
    handle->recvs.emplace_back();
    // Peers in rotated order (r+1, r+2, ...), so that no rank is everyone's first partner.
    for (int k = 1; k < n; ++k) {
      const int to = (r + k) % n, from = (r - k + n) % n;
      handle->sends.push_back(post(group, true, in.narrow(0, to * shard + at, len), to, tags.base + c));
      handle->recvs.back().push_back(
          post(group, false, slots[slot(from)].narrow(0, at, len), from, tags.base + c));
    }
  }
  handle->finish = [n, r, chunk, shard, out, in, slots, slot](std::size_t c) {
    const auto at = static_cast<std::int64_t>(c) * chunk, len = std::min(chunk, shard - at);
    auto part = [&](int k) {
      return k == r ? in.narrow(0, r * shard + at, len) : slots[slot(k)].narrow(0, at, len);
    };
    auto o = out.narrow(0, at, len);
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
  const int n = group.getSize(), r = group.getRank();
  auto out = output.view({-1}), in = input.view({-1});
  const auto part = in.numel();
  auto handle = std::make_unique<P2PHandle>(timeout, std::move(what));
  if (part == 0) return handle;
  const auto chunk = chunk_size(chunk_elements, part);
  handle->recvs.emplace_back();
  for (std::int64_t at = 0, c = 0; at < part; at += chunk, ++c) {
    const auto len = std::min(chunk, part - at);
    for (int k = 1; k < n; ++k) {
      const int to = (r + k) % n, from = (r - k + n) % n;
      handle->sends.push_back(post(group, true, in.narrow(0, at, len), to, tags.base + c));
      handle->recvs.back().push_back(
          post(group, false, out.narrow(0, from * part + at, len), from, tags.base + c));
    }
  }
  out.narrow(0, r * part, part).copy_(in);  // while the peers' parts arrive
  return handle;
}

std::unique_ptr<CollectiveHandle> p2p_reduce(c10d::Backend& group, torch::Tensor tensor, int root,
                                             P2PTags tags, std::int64_t chunk_elements,
                                             std::chrono::milliseconds timeout, std::string what) {
  const int n = group.getSize(), r = group.getRank();
  auto t = tensor.view({-1});
  const auto total = t.numel();
  auto handle = std::make_unique<P2PHandle>(timeout, std::move(what));
  if (total == 0) return handle;
  const auto chunk = chunk_size(chunk_elements, total);
  if (r != root) {
    for (std::int64_t at = 0, c = 0; at < total; at += chunk, ++c)
      handle->sends.push_back(
          post(group, true, t.narrow(0, at, std::min(chunk, total - at)), root, tags.base + c));
    return handle;
  }
  const auto slots = torch::empty({n - 1, total}, t.options());
  auto slot = [r](int peer) { return peer < r ? peer : peer - 1; };
  for (std::int64_t at = 0, c = 0; at < total; at += chunk, ++c) {
    const auto len = std::min(chunk, total - at);
    handle->recvs.emplace_back();
    for (int k = 1; k < n; ++k) {
      const int from = (r - k + n) % n;
      handle->recvs.back().push_back(
          post(group, false, slots[slot(from)].narrow(0, at, len), from, tags.base + c));
    }
  }
  handle->finish = [n, r, chunk, total, t, slots, slot](std::size_t c) {
    const auto at = static_cast<std::int64_t>(c) * chunk, len = std::min(chunk, total - at);
    auto o = t.narrow(0, at, len);
    for (int k = 0; k < n; ++k) {  // the root's own values, then the others' in rank order
      if (k != r) o.add_(slots[slot(k)].narrow(0, at, len));
    }
  };
  return handle;
}

}  // namespace accel::detail
