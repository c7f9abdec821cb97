// accel::Communicator::all_to_all (torch.distributed.all_to_all_single with equal blocks) over real c10d Gloo
// groups: 2 and 3 ranks (this executable again, one process per rank, as accel-launch starts them) with both
// CPU algorithms, every received block checked against what its sender put in the block for this rank, in
// float64 and int64 and from a non-contiguous input; the byte counter (calls, payload, wire = (N-1)/N of the
// input); the UsageError on a dim 0 that is not a multiple of the group; and a one-process group (c10d and
// Communicator::create's single-process one) giving its input back.
#include <catch2/catch.hpp>

#include "free_port.hpp"
#include "temp_dir.hpp"

#include <accel/distributed/open_communicator.hpp>
#include <accel/errors.hpp>

#include <torch/torch.h>

#include <sys/wait.h>
#include <unistd.h>

#include <fcntl.h>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

extern char** environ;

namespace {

// The block rank `from` sends to rank `to` (rows 2 x to .. 2 x to + 1 of its input): every element tells
// sender, receiver, row and column apart.
torch::Tensor block(int from, int to, torch::Dtype dtype) {
  const auto rows = torch::arange(2, torch::kInt64).unsqueeze(1) * 10;
  const auto cols = torch::arange(3, torch::kInt64).unsqueeze(0);
  return (rows + cols + 1000 * (from + 1) + 100 * to).to(dtype);
}

// Rank `rank`'s input: its blocks for ranks 0..world-1 stacked along dim 0.
torch::Tensor input_of(int rank, int world, torch::Dtype dtype) {
  std::vector<torch::Tensor> blocks;
  for (int to = 0; to < world; ++to)
    blocks.push_back(block(rank, to, dtype));
  return torch::cat(blocks, 0);
}

// What rank `rank` must receive: in rank order, the block each rank made for it.
torch::Tensor expected_at(int rank, int world, torch::Dtype dtype) {
  std::vector<torch::Tensor> blocks;
  for (int from = 0; from < world; ++from)
    blocks.push_back(block(from, rank, dtype));
  return torch::cat(blocks, 0);
}

int env_int(const char* name) {
  const char* v = std::getenv(name);
  REQUIRE(v != nullptr);
  return std::stoi(v);
}

}  // namespace

// One rank of the test below (ACCEL_A2A_RANK / _WORLD / _PORT / _BUILTIN set by it); hidden from the suite.
TEST_CASE("all_to_all: one rank of the multi-rank test", "[.a2a_rank]") {
  accel::ProcessState state;
  state.rank = state.local_rank = env_int("ACCEL_A2A_RANK");
  state.world_size = state.local_world_size = env_int("ACCEL_A2A_WORLD");
  state.master_port = env_int("ACCEL_A2A_PORT");
  accel::CommunicatorOptions options;
  options.cpu_collectives = env_int("ACCEL_A2A_BUILTIN") != 0 ? accel::CpuCollectives::Builtin
                                                              : accel::CpuCollectives::PointToPoint;
  options.timeout = std::chrono::seconds(30);
  auto comm = accel::open_communicator(state, torch::kCPU, options);
  const int rank = comm->rank(), world = comm->world_size();
  REQUIRE(rank == state.rank);
  REQUIRE(world == state.world_size);

  const auto in = input_of(rank, world, torch::kFloat64);
  const auto out = comm->all_to_all(in);
  REQUIRE(out.sizes() == in.sizes());
  for (int from = 0; from < world; ++from) {
    INFO("rank " << rank << ": the block from rank " << from << ": " << out.narrow(0, 2 * from, 2));
    CHECK(torch::equal(out.narrow(0, 2 * from, 2), block(from, rank, torch::kFloat64)));
  }
  CHECK(torch::equal(in, input_of(rank, world, torch::kFloat64)));  // the input is left as it was

  // int64, from a non-contiguous view, 3 dimensions: blocks along dim 0 whatever the layout.
  const auto ints = expected_at(rank, world, torch::kInt64).view({world, 2, 3});  // any content
  const auto source = input_of(rank, world, torch::kInt64).view({world, 2, 3}).transpose(1, 2).contiguous();
  const auto strided = source.transpose(1, 2);  // [world, 2, 3], not contiguous
  REQUIRE_FALSE(strided.is_contiguous());
  const auto got = comm->all_to_all(strided);
  CHECK(got.scalar_type() == torch::kInt64);
  CHECK(torch::equal(got, ints));

  const auto bytes = comm->bytes(accel::Collective::AllToAll);
  const std::uint64_t payload = static_cast<std::uint64_t>(in.nbytes() + strided.nbytes());
  CHECK(bytes.calls == 2);
  CHECK(bytes.payload == payload);
  CHECK(bytes.wire == static_cast<std::uint64_t>(in.nbytes() / world * (world - 1) +
                                                 strided.nbytes() / world * (world - 1)));

  // Refused before anything is sent (every rank refuses alike, so the group stays in step).
  CHECK_THROWS_WITH(comm->all_to_all(torch::zeros({2 * world + 1, 3})),
                    Catch::Contains("dim 0 must be a multiple of the group size " + std::to_string(world)));
  CHECK(comm->bytes(accel::Collective::AllToAll).calls == 2);
  comm->barrier();
}

TEST_CASE("all_to_all: 2 and 3 ranks exchange every block, both CPU algorithms, bytes counted") {
  struct Run {
    int world;
    bool builtin;
  };
  for (const auto run : {Run{2, false}, Run{2, true}, Run{3, false}}) {
    INFO(run.world << " ranks, " << (run.builtin ? "Gloo's built-in" : "point-to-point") << " collectives");
    accel::test::TempDir dir;
    const auto port = std::to_string(accel::test::free_port());
    std::vector<pid_t> pids;
    for (int r = 0; r < run.world; ++r) {
      // Prepared before fork: the child only opens its log and execs (this executable, the hidden case).
      std::vector<std::string> env_strings;
      for (char** e = environ; *e != nullptr; ++e)
        env_strings.emplace_back(*e);
      env_strings.push_back("ACCEL_A2A_RANK=" + std::to_string(r));
      env_strings.push_back("ACCEL_A2A_WORLD=" + std::to_string(run.world));
      env_strings.push_back("ACCEL_A2A_PORT=" + port);
      env_strings.push_back(std::string("ACCEL_A2A_BUILTIN=") + (run.builtin ? "1" : "0"));
      env_strings.push_back("OMP_NUM_THREADS=1");
      std::vector<char*> envp;
      for (auto& s : env_strings)
        envp.push_back(s.data());
      envp.push_back(nullptr);
      const auto log = dir.file("rank" + std::to_string(r) + ".log");
      const pid_t pid = ::fork();
      REQUIRE(pid >= 0);
      if (pid == 0) {
        const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
        ::dup2(fd, 1);
        ::dup2(fd, 2);
        char* argv[] = {const_cast<char*>("accel_all_to_all_tests"),
                        const_cast<char*>("all_to_all: one rank of the multi-rank test"),
                        const_cast<char*>("--use-colour"), const_cast<char*>("no"), nullptr};
        ::execve("/proc/self/exe", argv, envp.data());
        ::_exit(127);
      }
      pids.push_back(pid);
    }
    for (int r = 0; r < run.world; ++r) {
      int status = 0;
      // A hung rank ends at the collective timeout (30 s).
      REQUIRE(::waitpid(pids[static_cast<std::size_t>(r)], &status, 0) == pids[static_cast<std::size_t>(r)]);
      std::ifstream in(dir.file("rank" + std::to_string(r) + ".log"));
      const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      INFO("rank " << r << " printed:\n" << text);
      CHECK(WIFEXITED(status));
      CHECK(WEXITSTATUS(status) == 0);
      CHECK(text.find("All tests passed") != std::string::npos);
    }
  }
}

TEST_CASE("all_to_all: a group of one gives its input back (c10d Gloo and the single-process communicator)") {
  accel::ProcessState state;
  state.master_port = accel::test::free_port();
  const auto x = input_of(0, 2, torch::kFloat32);  // two blocks, both to rank 0
  auto c10d = accel::open_communicator(state, torch::kCPU, {});
  CHECK(torch::equal(c10d->all_to_all(x), x));
  const auto bytes = c10d->bytes(accel::Collective::AllToAll);
  CHECK(bytes.calls == 1);
  CHECK(bytes.payload == static_cast<std::uint64_t>(x.nbytes()));
  CHECK(bytes.wire == 0);                                                    // nothing leaves a group of one
  CHECK_THROWS_AS(c10d->all_to_all(torch::tensor(1.0)), accel::UsageError);  // no dim 0 to cut
  auto single = accel::Communicator::create(state, torch::kCPU, {});
  CHECK(torch::equal(single->all_to_all(x), x));
}
