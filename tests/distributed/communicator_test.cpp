// The Communicator in one process over real c10d groups (open_communicator): every collective of a
// one-process Gloo group is the identity, with either CPU algorithm (point-to-point and Gloo's own). The same
// checks run on NCCL in tests/gpu/gpu_test.cpp where a GPU is lent.
#include <catch2/catch.hpp>

#include "distributed/one_process_collectives.hpp"
#include "free_port.hpp"

#include <accel/distributed/open_communicator.hpp>
#include <accel/errors.hpp>

#include <chrono>
#include <string>

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

TEST_CASE("communicator: a failed rendezvous says whether the port or a missing rank is to blame") {
  accel::ProcessState state;  // rank 0 of 2: its store waits for rank 1
  state.world_size = 2;
  state.local_world_size = 2;
  accel::CommunicatorOptions options;
  options.timeout = std::chrono::milliseconds(1500);
  SECTION("rank 1 never connects: no word about the port") {
    state.master_port = accel::test::free_port();
    try {
      accel::open_communicator(state, torch::kCPU, options);
      FAIL("the rendezvous succeeded without rank 1");
    } catch (const accel::DistributedError& e) {
      const std::string what = e.what();
      INFO(what);
      CHECK(what.find("not every one of the 2 ranks connected") != std::string::npos);
      CHECK(what.find("port is already in use") == std::string::npos);
    }
  }
  SECTION("the port is taken: said at once") {
    const auto [fd, port] = accel::test::bound_loopback_socket(/*listen=*/true);
    state.master_port = port;
    try {
      accel::open_communicator(state, torch::kCPU, options);
      FAIL("the rendezvous succeeded on a taken port");
    } catch (const accel::DistributedError& e) {
      const std::string what = e.what();
      INFO(what);
      CHECK(what.find("the port is already in use: choose another with --main_process_port") !=
            std::string::npos);
    }
    ::close(fd);
  }
}

TEST_CASE("communicator: ACCEL_CUDA_COLLECTIVES names nccl or gloo") {
  CHECK(accel::parse_cuda_collectives("nccl", "ACCEL_CUDA_COLLECTIVES") == accel::CudaCollectives::Nccl);
  CHECK(accel::parse_cuda_collectives("gloo", "ACCEL_CUDA_COLLECTIVES") == accel::CudaCollectives::Gloo);
  CHECK_THROWS_WITH(accel::parse_cuda_collectives("mpi", "ACCEL_CUDA_COLLECTIVES"),
                    Catch::Contains("ACCEL_CUDA_COLLECTIVES: unknown process group 'mpi' for CUDA tensors"));
}
