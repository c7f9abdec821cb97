// Main of accel_gpu_tests: the CUDA path on one GPU (issue 27). Where LibTorch sees no CUDA device it runs
// nothing and exits 77, which CTest reports as skipped (SKIP_RETURN_CODE), so a machine without a GPU counts
// these tests as skipped, never as passed.
#define CATCH_CONFIG_RUNNER
#include <torch/cuda.h>
#include <catch2/catch.hpp>

#include <cstring>
#include <iostream>

#include <cstdlib>
#include <string>

namespace accel::test {
void run_gpu_tests_on_cpu();
int gloo_rank_main(int rank, int port, const std::string& device);
}  // namespace accel::test

int main(int argc, char** argv) {
  // --on-cpu (first argument): a dry run of the same cases on the CPU, to check the tests themselves on a
  // machine without a GPU. It says nothing about the CUDA path and is never registered with CTest.
  if (argc > 1 && std::strcmp(argv[1], "--on-cpu") == 0) {
    accel::test::run_gpu_tests_on_cpu();
    argv[1] = argv[0];
    std::cout << "accel_gpu_tests: dry run on the CPU (not a GPU test)\n";
    return Catch::Session().run(argc - 1, argv + 1);
  }
  // --gloo-rank RANK PORT DEVICE: one rank of gpu_ranks_test.cpp's two-process test.
  if (argc == 5 && std::strcmp(argv[1], "--gloo-rank") == 0)
    return accel::test::gloo_rank_main(std::atoi(argv[2]), std::atoi(argv[3]), argv[4]);
  // --cuda-devices: prints how many CUDA devices LibTorch sees; exits 77 where none (the scripts' probe).
  if (argc > 1 && std::strcmp(argv[1], "--cuda-devices") == 0) {
    const int n = torch::cuda::is_available() ? static_cast<int>(torch::cuda::device_count()) : 0;
    std::cout << n << "\n";
    return n > 0 ? 0 : 77;
  }
  if (!torch::cuda::is_available()) {
    std::cout << "accel_gpu_tests: SKIPPED: LibTorch sees no CUDA device on this machine (torch::cuda::"
                 "is_available() is false); run it on a machine with an NVIDIA GPU\n";
    return 77;
  }
  std::cout << "accel_gpu_tests: " << static_cast<int>(torch::cuda::device_count()) << " CUDA device(s)\n";
  return Catch::Session().run(argc, argv);
}
