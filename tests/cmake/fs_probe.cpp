// accel_fs_probe_static DIR: creates DIR/a/b/file and removes DIR with std::filesystem::remove_all, as
// save_state does with a temporary directory. Linked against LibTorch through accel_torch with a static
// libstdc++ (tests/CMakeLists.txt); bound to the copy in the torch wheel's libtorch.so, remove_all crashes.
#include <cstdio>
#include <filesystem>
#include <fstream>

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: accel_fs_probe_static DIR\n");
    return 2;
  }
  namespace fs = std::filesystem;
  const fs::path dir = argv[1];
  fs::remove_all(dir);
  fs::create_directories(dir / "a" / "b");
  std::ofstream(dir / "a" / "b" / "file") << "x";
  const auto removed = fs::remove_all(dir);
  std::printf("fs_probe: removed %ju entries\n", static_cast<std::uintmax_t>(removed));
  return removed == 4 && !fs::exists(dir) ? 0 : 1;
}
