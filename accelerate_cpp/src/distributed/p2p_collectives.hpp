#pragma once
// Private: reduce-scatter, all-gather and reduce written over c10d's own point-to-point operations (send/recv
// on the same process group), for process groups whose built-in versions are slower. On this machine's Gloo,
// `_reduce_scatter_base` and `_allgather_base` of 21M floats on 2 ranks took 151 ms and 116 ms, an all-reduce
// of the whole buffer 86 ms; the pairwise exchange below moves the same bytes in about a third of the time
// (figures in BENCHMARKS.md, `bench_collectives`).
//
// Algorithm (pairwise, direct): each rank sends every peer that peer's part of its input and receives its own
// part from every peer, the same (N-1)/N bytes a ring moves. Every send and receive is posted when the
// collective is issued, so the transfer runs in the background like the built-in asynchronous collectives and
// no wait can hold up a peer's progress (a rank that waited on a send before posting its receives could
// deadlock). The reduce-scatter's additions run in `wait()`, chunk by chunk, while later chunks still arrive;
// its sums are taken in rank order on every rank.

#include <accel/distributed/communicator.hpp>

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <cstdint>
#include <exception>
#include <memory>
#include <string>

namespace accel::detail {

/// The first line of a c10d failure, for a DistributedError. When it means that a peer went away (Gloo's
/// "Connection reset by peer" or "Connection closed by peer", a broken pipe), it says so: that rank stopped
/// first, and its own error, printed before this one, is the cause; this one is only its consequence.
std::string c10d_failure(const std::exception& e);

/// Tags of point-to-point collectives: `tag_base` distinguishes concurrent collectives (all ranks must pass
/// the same value for the same call) and leaves room for chunk numbers below it.
struct P2PTags {
  static constexpr std::int64_t kChunks = 1024;  ///< at most this many chunks per collective
  std::int64_t base = 0;                         ///< multiple of kChunks
};

/// Sum of every rank's contiguous `input` (world_size x output numel elements), this rank's part written to
/// the contiguous `output`; split into chunks of about `chunk_elements`.
std::unique_ptr<CollectiveHandle> p2p_reduce_scatter(c10d::Backend& group, torch::Tensor output,
                                                     torch::Tensor input, P2PTags tags,
                                                     std::int64_t chunk_elements,
                                                     std::chrono::milliseconds timeout, std::string what);

/// Every rank's contiguous `input` written, in rank order, into the contiguous `output` (world_size x input
/// numel elements), in chunks of about `chunk_elements`.
std::unique_ptr<CollectiveHandle> p2p_all_gather(c10d::Backend& group, torch::Tensor output,
                                                 torch::Tensor input, P2PTags tags,
                                                 std::int64_t chunk_elements,
                                                 std::chrono::milliseconds timeout, std::string what);

/// Sum of every rank's contiguous `tensor` into `root`'s `tensor` (the others' stay as they are): every other
/// rank sends its tensor to the root, which adds them in rank order to its own, chunk by chunk.
std::unique_ptr<CollectiveHandle> p2p_reduce(c10d::Backend& group, torch::Tensor tensor, int root,
                                             P2PTags tags, std::int64_t chunk_elements,
                                             std::chrono::milliseconds timeout, std::string what);

}  // namespace accel::detail
