// The main of each benchmark program on LibTorch (bench/CMakeLists.txt): ACCEL_BENCH names the program and
// the namespace of its run(), e.g. bench_overhead::run in overhead.cpp, compiled into the library
// accel_benchmarks. An exception run() lets out (a flag's value that is not a number, say) is reported, not
// left to std::terminate.
#include <cstdio>
#include <exception>

namespace ACCEL_BENCH {
int run(int argc, char** argv);
}  // namespace ACCEL_BENCH

int main(int argc, char** argv) try { return ACCEL_BENCH::run(argc, argv); } catch (const std::exception& e) {
  std::fprintf(stderr, "%s: %s\n", argv[0], e.what());
  return 1;
}
