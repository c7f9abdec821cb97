// The main of each benchmark program on LibTorch (bench/CMakeLists.txt): ACCEL_BENCH names the program and
// the namespace of its run(), e.g. bench_overhead::run in overhead.cpp, compiled into the library
// accel_benchmarks.
namespace ACCEL_BENCH {
int run(int argc, char** argv);
}  // namespace ACCEL_BENCH

int main(int argc, char** argv) {
  return ACCEL_BENCH::run(argc, argv);
}
