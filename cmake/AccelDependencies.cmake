# Third-party dependencies. LibTorch comes from CMAKE_PREFIX_PATH (the venv wheel's
# torch.utils.cmake_prefix_path, or an official libtorch zip); the rest from Debian packages.

if(NOT TARGET torch)
  # The CUDA wheel probes for GPUs at configure time; on machines without one it builds for common archs.
  find_package(Torch REQUIRED)
  if(NOT ACCEL_TOP_LEVEL)
    # Imported targets are directory-scoped; a parent project that add_subdirectory()s us links `torch`
    # through our targets and needs to see torch_cpu, torch_cuda, ... too.
    get_directory_property(_accel_imported IMPORTED_TARGETS)
    foreach(_t IN LISTS _accel_imported)
      get_target_property(_global ${_t} IMPORTED_GLOBAL)
      if(NOT _global)
        set_target_properties(${_t} PROPERTIES IMPORTED_GLOBAL TRUE)
      endif()
    endforeach()
  endif()
endif()
find_package(yaml-cpp REQUIRED)
find_package(CLI11 CONFIG REQUIRED)  # Debian: /usr/share/cmake/CLI11/CLI11Config.cmake
find_package(Threads REQUIRED)

# fmt: LibTorch ships fmt headers in its include directory, which comes first on every LibTorch target's
# include path. We use exactly that fmt, header-only, and never link a system libfmt, so headers and
# library can never come from different fmt versions.
if(NOT TARGET accel_fmt)
  get_filename_component(_accel_torch_root "${TORCH_INCLUDE_DIRS}" DIRECTORY)
  list(GET TORCH_INCLUDE_DIRS 0 _accel_torch_inc)
  if(NOT EXISTS "${_accel_torch_inc}/fmt/format.h")
    message(FATAL_ERROR "LibTorch at ${_accel_torch_inc} ships no fmt/format.h; accelerate-cpp uses LibTorch's fmt")
  endif()
  add_library(accel_fmt INTERFACE)
  target_include_directories(accel_fmt SYSTEM INTERFACE $<BUILD_INTERFACE:${_accel_torch_inc}>)
  target_compile_definitions(accel_fmt INTERFACE FMT_HEADER_ONLY=1)
endif()

# nlohmann/json: used by our safetensors reader, and some c10d headers include it.
find_path(ACCEL_NLOHMANN_INCLUDE nlohmann/json.hpp REQUIRED)
