#include <catch2/catch.hpp>
#include "build_paths.hpp"

#include <accel/config/config.hpp>
#include <accel/distributed/cuda_device.hpp>
#include <accel/distributed/process_state.hpp>
#include <accel/errors.hpp>

#include <filesystem>
#include <map>
#include <string>

using accel::ProcessState;

namespace {

ProcessState from(const std::map<std::string, std::string>& env) {
  return ProcessState::from_environment([&](const char* name) -> const char* {
    auto it = env.find(name);
    return it == env.end() ? nullptr : it->second.c_str();
  });
}

}  // namespace

TEST_CASE("process: no launcher variables means one process") {
  const auto s = from({});
  REQUIRE(s.world_size == 1);
  REQUIRE(s.rank == 0);
  REQUIRE(s.launcher == "none");
}

TEST_CASE("process: torchrun variables") {
  const auto s = from({{"RANK", "3"},
                       {"WORLD_SIZE", "4"},
                       {"LOCAL_RANK", "1"},
                       {"LOCAL_WORLD_SIZE", "2"},
                       {"GROUP_RANK", "1"},
                       {"MASTER_ADDR", "10.1.2.3"},
                       {"MASTER_PORT", "1234"}});
  REQUIRE(s.launcher == "torchrun");
  REQUIRE(s.rank == 3);
  REQUIRE(s.local_rank == 1);
  REQUIRE(s.node_rank == 1);
  REQUIRE(s.master_addr == "10.1.2.3");
  REQUIRE(s.master_port == 1234);
  REQUIRE(from({{"RANK", "0"},
                {"WORLD_SIZE", "2"},
                {"MASTER_ADDR", "h"},
                {"MASTER_PORT", "1"},
                {"ACCEL_LAUNCHED", "1"}})
              .launcher == "accel-launch");
}

TEST_CASE("process: partial or inconsistent torchrun variables name what was found") {
  REQUIRE_THROWS_WITH(
      from({{"RANK", "1"}, {"WORLD_SIZE", "2"}}),
      "torchrun environment is incomplete or inconsistent: missing MASTER_ADDR, MASTER_PORT; set all "
      "of RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (torchrun and accel-launch do) (found: RANK=1, "
      "WORLD_SIZE=2)");
  REQUIRE_THROWS_WITH(
      from({{"RANK", "2"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "5"}}),
      "torchrun environment is incomplete or inconsistent: rank 2 is not below the world size 2 "
      "(found: RANK=2, WORLD_SIZE=2, MASTER_ADDR=h, MASTER_PORT=5)");
  REQUIRE_THROWS_WITH(from({{"RANK", "x"}}), "environment variable RANK='x' is not a non-negative integer");
}

TEST_CASE("process: Slurm variables and node lists") {
  const auto s = from({{"SLURM_PROCID", "5"},
                       {"SLURM_NTASKS", "8"},
                       {"SLURM_LOCALID", "1"},
                       {"SLURM_TASKS_PER_NODE", "4(x2)"},
                       {"SLURM_NODEID", "1"},
                       {"SLURM_JOB_NODELIST", "gpu[07-09,12],cpu3"}});
  REQUIRE(s.launcher == "slurm");
  REQUIRE(s.rank == 5);
  REQUIRE(s.world_size == 8);
  REQUIRE(s.local_rank == 1);
  REQUIRE(s.local_world_size == 4);
  REQUIRE(s.master_addr == "gpu07");
  REQUIRE(accel::slurm_first_host("node1,node2") == "node1");
  REQUIRE(accel::slurm_first_host("a[3]") == "a3");
  REQUIRE_THROWS_WITH(
      from({{"SLURM_PROCID", "0"}}),
      "Slurm environment is incomplete or inconsistent: both SLURM_PROCID and SLURM_NTASKS are "
      "needed (run under srun) (found: SLURM_PROCID=0)");
}

TEST_CASE("process: Open MPI variables") {
  const auto s = from({{"OMPI_COMM_WORLD_RANK", "1"},
                       {"OMPI_COMM_WORLD_SIZE", "2"},
                       {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                       {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}});
  REQUIRE(s.launcher == "openmpi");
  REQUIRE(s.rank == 1);
  REQUIRE(s.master_addr == "127.0.0.1");
  REQUIRE_THROWS_WITH(from({{"OMPI_COMM_WORLD_RANK", "1"},
                            {"OMPI_COMM_WORLD_SIZE", "4"},
                            {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}}),
                      Catch::Contains("ranks span several machines, so MASTER_ADDR must name rank 0's host"));
}

TEST_CASE("config: every file in config_templates/ loads") {
  int count = 0;
  for (const auto& entry : std::filesystem::directory_iterator(accel::test::config_template_dir())) {
    if (entry.path().extension() != ".yaml") continue;
    INFO(entry.path().string());
    REQUIRE_NOTHROW(accel::Config::load_file(entry.path().string()));
    ++count;
  }
  REQUIRE(count >= 3);
}

TEST_CASE("process: each rank's CUDA device, and ranks that would share a GPU") {
  ProcessState s;
  s.launcher = "accel-launch";
  s.world_size = s.local_world_size = 4;
  for (int r = 0; r < 4; ++r) {
    s.rank = s.local_rank = r;
    CHECK(accel::cuda_device_for(s, 4) == r);  // cuda:<local rank>, as torchrun and Accelerate
  }
  // accel-launch and torchrun give every rank the same devices: 2 processes on a 1-GPU machine would share
  // cuda:0, which NCCL refuses; the error names the counts and the fix.
  // Every rank refuses, local rank 0 too: a rank left running would wait for the others at the first
  // collective until the timeout (seen on the H200 machine with torchrun-style variables set by hand).
  s.world_size = s.local_world_size = 2;
  for (const char* launcher : {"accel-launch", "torchrun"}) {
    for (int r = 0; r < 2; ++r) {
      s.launcher = launcher;
      s.rank = s.local_rank = r;
      CHECK_THROWS_WITH(
          accel::cuda_device_for(s, 1),
          "rank " + std::to_string(r) + ": " + launcher +
              " starts 2 processes on this machine, but it has 1 CUDA device(s), so local ranks 0 "
              "and 1 would share cuda:0 (NCCL refuses that); set num_processes to at most 1 "
              "(--num_processes 1), or use_cpu: true (--cpu) to train on CPU ranks, or "
              "ACCEL_CUDA_COLLECTIVES=gloo to let the ranks share the GPU (collectives through Gloo on host "
              "copies: slower, for running multi-rank code on one GPU)");
      // With the CUDA collectives through Gloo (host copies) the ranks may share it: both on cuda:0.
      CHECK(accel::cuda_device_for(s, 1, /*ranks_may_share=*/true) == 0);
    }
  }
  s.world_size = s.local_world_size = 4;
  for (int r = 0; r < 4; ++r) {
    s.rank = s.local_rank = r;
    CHECK(accel::cuda_device_for(s, 2, /*ranks_may_share=*/true) == r % 2);
  }
  s.rank = s.local_rank = 1;
  // Two machines of 4 processes each with 2 GPUs apiece: the limit is per machine.
  s.launcher = "accel-launch";
  s.world_size = 8;
  s.local_world_size = 4;
  s.rank = 6;
  s.local_rank = 2;
  CHECK_THROWS_WITH(accel::cuda_device_for(s, 2), Catch::Contains("--num_processes 4, 2 per machine"));
  // Slurm (--gpus-per-task) and MPI wrappers can give each rank its own GPU as cuda:0: the index wraps.
  for (const char* launcher : {"slurm", "openmpi", "none"}) {
    s.launcher = launcher;
    CHECK(accel::cuda_device_for(s, 1) == 0);
  }
}
