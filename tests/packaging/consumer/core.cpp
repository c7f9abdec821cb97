// A torch-free translation unit of the consumer: the add_subdirectory check compiles it for real (seconds),
// where main.cpp's LibTorch headers would cost ~35 s a second time; it also links into the package build.
#include <accel/config/config.hpp>

int consumer_default_processes() {
  return accel::Config{}.num_processes;
}
