// Several ranks on one GPU (issue 27): with ACCEL_CUDA_COLLECTIVES=gloo (CudaCollectives::Gloo) the
// Communicator runs the collectives of CUDA tensors through Gloo on host copies, so ranks may share cuda:0
// (NCCL refuses two ranks on one device). Here two ranks are two processes (this executable again) with real
// c10d groups (a TCPStore and ProcessGroupGloo); every collective, its asynchronous form and point-to-point
// are checked against exact values, and each result must be back on the GPU. The backends on such ranks
// run through accel-launch in tests/gpu/ranks_share_gpu.sh.
#include <catch2/catch.hpp>

#include "distributed/one_process_collectives.hpp"
#include "free_port.hpp"
#include "gpu_device.hpp"

#include <accel/distributed/open_communicator.hpp>

#include <torch/torch.h>

#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <exception>
#include <fstream>
#include <iostream>
#include <iterator>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace {

// The checks of one rank: it records what failed; the test reports it.
struct RankChecks {
  torch::Device device;
  std::vector<std::string> failures;

  void expect(bool ok, const std::string& what) {
    if (!ok) failures.push_back(what);
  }
  // `got` equals `want` and lies on the rank's device.
  void equal(const torch::Tensor& got, const torch::Tensor& want, const std::string& what) {
    std::ostringstream os;
    os << what << ": got " << got.to(torch::kCPU) << " on " << got.device() << ", want " << want;
    expect(got.device() == device && torch::equal(got.to(torch::kCPU), want), os.str());
  }

  void run(accel::Communicator& comm) {
    const int r = comm.rank();
    const auto on = torch::TensorOptions().dtype(torch::kFloat32).device(device);
    auto t = torch::full({4}, r + 1.0, on);
    comm.all_reduce(t, accel::ReduceOp::Sum);
    equal(t, torch::full({4}, 3.0), "all_reduce sum");
    t.fill_(r + 1.0);
    comm.all_reduce(t, accel::ReduceOp::Mean);
    equal(t, torch::full({4}, 1.5), "all_reduce mean");
    t.fill_(r + 1.0);
    comm.all_reduce(t, accel::ReduceOp::Max);
    equal(t, torch::full({4}, 2.0), "all_reduce max");

    t.fill_(r == 1 ? 7.0 : -1.0);
    comm.broadcast(t, 1);
    equal(t, torch::full({4}, 7.0), "broadcast from rank 1");

    const auto mine = torch::arange(3, on) + 10.0 * r;
    equal(comm.all_gather(mine), torch::tensor({0.f, 1.f, 2.f, 10.f, 11.f, 12.f}), "all_gather");
    auto gathered = torch::zeros({6}, on);
    comm.all_gather_async(gathered, mine)->wait();
    equal(gathered, torch::tensor({0.f, 1.f, 2.f, 10.f, 11.f, 12.f}), "all_gather_async");

    const auto whole = torch::arange(4, on) * (r + 1.0);  // the sum over ranks: arange(4) x 3
    const auto shard = (torch::arange(4) * 3.0).narrow(0, 2 * r, 2).to(torch::kFloat32);
    equal(comm.reduce_scatter(whole, accel::ReduceOp::Sum), shard, "reduce_scatter");
    auto out = torch::zeros({2}, on);
    comm.reduce_scatter_async(out, whole)->wait();
    equal(out, shard, "reduce_scatter_async");

    auto reduced = torch::full({3}, r + 1.0, on);
    comm.reduce_async(reduced, 0)->wait();
    if (r == 0) equal(reduced, torch::full({3}, 3.0), "reduce_async to rank 0");

    // Two views of one flat buffer (as DDP's buckets hand them): both halves summed in place.
    auto flat = torch::zeros({6}, on);
    flat.narrow(0, 0, 3).fill_(r + 1.0);
    flat.narrow(0, 3, 3).fill_(2.0 * (r + 1));
    comm.all_reduce_async({flat.narrow(0, 0, 3), flat.narrow(0, 3, 3)})->wait();
    equal(flat, torch::tensor({3.f, 3.f, 3.f, 6.f, 6.f, 6.f}), "all_reduce_async of two views");

    // Point to point both ways, as pipeline stages pass activations and gradients.
    auto message = torch::empty({5}, on);
    if (r == 0) {
      comm.send_async(torch::arange(5, on), 1, 7)->wait();
      comm.recv_async(message, 1, 8)->wait();
      equal(message, torch::arange(5).to(torch::kFloat32) * 2, "recv from rank 1");
    } else {
      comm.recv_async(message, 0, 7)->wait();
      equal(message, torch::arange(5).to(torch::kFloat32), "recv from rank 0");
      comm.send_async(message * 2, 0, 8)->wait();
    }

    // A group split off the job (hybrid sharding's shard groups): the same staging.
    auto both = comm.split({{0, 1}});
    auto g = torch::full({2}, r + 1.0, on);
    both->all_reduce(g, accel::ReduceOp::Sum);
    equal(g, torch::full({2}, 3.0), "all_reduce on a split group");
    comm.barrier();
  }
};

}  // namespace

TEST_CASE("gpu: Gloo on host copies (ACCEL_CUDA_COLLECTIVES=gloo) at world size 1 through the Communicator") {
  const auto device = accel::test::gpu_device();
  accel::ProcessState state;
  state.master_port = accel::test::free_port();
  accel::CommunicatorOptions options;
  options.cuda_collectives = accel::CudaCollectives::Gloo;
  auto comm = accel::open_communicator(state, device, options);
  accel::test::check_one_process_collectives(*comm, device);
}

namespace accel::test {

// One rank of the test below, in a process of its own (accel_gpu_tests --gloo-rank RANK PORT DEVICE): prints
// each failed check and returns 1 if any.
int gloo_rank_main(int rank, int port, const std::string& device_name) {
  RankChecks checks{torch::Device(device_name), {}};
  try {
    accel::ProcessState state;
    state.rank = state.local_rank = rank;
    state.world_size = state.local_world_size = 2;
    state.master_port = port;
    state.launcher = "accel-launch";
    accel::CommunicatorOptions options;
    options.cuda_collectives = accel::CudaCollectives::Gloo;
    options.timeout = std::chrono::seconds(60);
    auto comm = accel::open_communicator(state, checks.device, options);
    checks.run(*comm);
  } catch (const std::exception& e) {
    checks.failures.push_back(std::string("threw: ") + e.what());
  }
  for (const auto& f : checks.failures)
    std::cout << "rank " << rank << ": FAILED: " << f << std::endl;
  std::cout << "rank " << rank << ": " << (checks.failures.empty() ? "all checks passed" : "failed")
            << std::endl;
  return checks.failures.empty() ? 0 : 1;
}

}  // namespace accel::test

// Two processes (this executable again, as ranks 0 and 1), as accel-launch starts ranks.
TEST_CASE("gpu: two ranks sharing cuda:0 run every collective through Gloo on host copies") {
  accel::test::TempDir dir;
  const auto port = std::to_string(accel::test::free_port());
  const auto device = accel::test::gpu_device().str();
  std::vector<pid_t> pids;
  for (int r = 0; r < 2; ++r) {
    const auto log = (dir.path / ("rank" + std::to_string(r) + ".log")).string();
    const auto rank = std::to_string(r);
    const pid_t pid = ::fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
      const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      ::dup2(fd, 1);
      ::dup2(fd, 2);
      ::execl("/proc/self/exe", "accel_gpu_tests", "--gloo-rank", rank.c_str(), port.c_str(), device.c_str(),
              static_cast<char*>(nullptr));
      ::_exit(127);
    }
    pids.push_back(pid);
  }
  for (int r = 0; r < 2; ++r) {
    int status = 0;
    // A hung rank is ended by the rendezvous / collective timeout (60 s), then by CTest's.
    REQUIRE(::waitpid(pids[static_cast<std::size_t>(r)], &status, 0) == pids[static_cast<std::size_t>(r)]);
    std::ifstream in(dir.path / ("rank" + std::to_string(r) + ".log"));
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    INFO("rank " << r << " printed:\n" << text);
    CHECK(WIFEXITED(status));
    CHECK(WEXITSTATUS(status) == 0);
    CHECK(text.find("rank " + std::to_string(r) + ": all checks passed") != std::string::npos);
  }
}
