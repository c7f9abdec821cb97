#pragma once
// The chunked, pipelined collective written once (ZeRO stage 1's reduce-scatter of a whole gradient; the
// parameter all-gather writes the flat parameter buffers directly, unchunked): the flat range [0, total) goes
// in chunks of `chunk` elements with at most `depth` chunks in flight, so copying one chunk in or out
// overlaps the transfer of the next and no whole-model buffer is ever allocated. Rank-free: `start` launches
// a chunk and returns what completes it.

#include <algorithm>
#include <cstdint>
#include <deque>
#include <functional>

namespace accel::backends::detail {

/// Calls `start(at, len)` for consecutive chunks of [0, total); each returns its completion (wait, then
/// consume), called in order once `depth` chunks are in flight, and for the rest at the end.
inline void pipelined_chunks(std::int64_t total, std::int64_t chunk, std::size_t depth,
                             const std::function<std::function<void()>(std::int64_t, std::int64_t)>& start) {
  chunk = std::max<std::int64_t>(chunk, 1);
  depth = std::max<std::size_t>(depth, 1);
  std::deque<std::function<void()>> in_flight;
  for (std::int64_t at = 0; at < total; at += chunk) {
    if (in_flight.size() == depth) {
      in_flight.front()();
      in_flight.pop_front();
    }
    in_flight.push_back(start(at, std::min(chunk, total - at)));
  }
  while (!in_flight.empty()) {
    in_flight.front()();
    in_flight.pop_front();
  }
}

}  // namespace accel::backends::detail
