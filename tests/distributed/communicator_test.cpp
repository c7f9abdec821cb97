// The Communicator in one process over real c10d groups (open_communicator): every collective of a
// one-process Gloo group is the identity, with either CPU algorithm (point-to-point and Gloo's own). The same
// checks run on NCCL in tests/gpu/gpu_test.cpp where a GPU is lent.
#include <catch2/catch.hpp>

#include <accel/distributed/open_communicator.hpp>

#include <torch/torch.h>

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <string>
#include <vector>

namespace {

int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  REQUIRE(fd >= 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0);
  socklen_t len = sizeof addr;
  REQUIRE(::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0);
  ::close(fd);
  return ntohs(addr.sin_port);
}

}  // namespace

TEST_CASE("communicator: every collective of a one-process c10d group is the identity (Gloo)") {
  for (const auto algorithm : {accel::CpuCollectives::PointToPoint, accel::CpuCollectives::Builtin}) {
    INFO("cpu_collectives " << static_cast<int>(algorithm));
    accel::ProcessState state;
    state.master_port = free_port();
    accel::CommunicatorOptions options;
    options.cpu_collectives = algorithm;
    auto comm = accel::open_communicator(state, torch::kCPU, options);
    REQUIRE(comm->world_size() == 1);
    const auto expected = torch::arange(6, torch::kFloat32);
    auto t = expected.clone();
    comm->all_reduce(t, accel::ReduceOp::Sum);
    CHECK(torch::equal(t, expected));
    comm->broadcast(t, 0);
    CHECK(torch::equal(t, expected));
    CHECK(torch::equal(comm->all_gather(t), expected));
    CHECK(torch::equal(comm->reduce_scatter(t, accel::ReduceOp::Sum), expected));
    auto out = torch::zeros_like(t);
    comm->all_gather_async(out, t)->wait();
    CHECK(torch::equal(out, expected));
    out.zero_();
    comm->reduce_scatter_async(out, t)->wait();
    CHECK(torch::equal(out, expected));
    auto r = expected.clone();
    comm->reduce_async(r, 0)->wait();
    CHECK(torch::equal(r, expected));
    comm->barrier();
    CHECK(comm->exchange("one") == std::vector<std::string>{"one"});
    // The bytes were counted as the collectives ran.
    CHECK(comm->bytes(accel::Collective::ReduceScatter).calls == 2);
  }
}
