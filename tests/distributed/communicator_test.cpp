// The Communicator in one process over real c10d groups (open_communicator): every collective of a
// one-process Gloo group is the identity, with either CPU algorithm (point-to-point and Gloo's own). The same
// checks run on NCCL in tests/gpu/gpu_test.cpp where a GPU is lent.
#include <catch2/catch.hpp>

#include "distributed/one_process_collectives.hpp"
#include "free_port.hpp"

#include <accel/distributed/open_communicator.hpp>

TEST_CASE("communicator: every collective of a one-process c10d group is the identity (Gloo)") {
  for (const auto algorithm : {accel::CpuCollectives::PointToPoint, accel::CpuCollectives::Builtin}) {
    INFO("cpu_collectives " << static_cast<int>(algorithm));
    accel::ProcessState state;
    state.master_port = accel::test::free_port();
    accel::CommunicatorOptions options;
    options.cpu_collectives = algorithm;
    auto comm = accel::open_communicator(state, torch::kCPU, options);
    accel::test::check_one_process_collectives(*comm, torch::kCPU);
    // The bytes were counted as the collectives ran.
    CHECK(comm->bytes(accel::Collective::ReduceScatter).calls == 2);
  }
}
