#pragma once
// One rank's failure becomes every rank's error: each rank reports what went wrong ("" for nothing) and all
// throw the same CheckpointError for the first rank that failed, so no rank waits in a later collective.

#include <accel/distributed/communicator.hpp>
#include <accel/errors.hpp>

#include <functional>
#include <string>
#include <vector>

namespace accel::detail {

/// Collective: exchanges `mine` (empty when this rank succeeded) and throws
/// `CheckpointError(message(rank, what))` for the lowest rank that reported a failure.
inline void throw_first_failure(
    Communicator& comm, const std::string& mine,
    const std::function<std::string(std::size_t rank, const std::string& what)>& message) {
  const std::vector<std::string> reports = comm.exchange(mine);
  for (std::size_t r = 0; r < reports.size(); ++r) {
    if (!reports[r].empty()) throw CheckpointError(message(r, reports[r]));
  }
}

}  // namespace accel::detail
