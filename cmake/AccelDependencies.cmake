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

# Refuse a LibTorch of another release series before anything links it (a system libtorch-dev 1.13 found
# first would link the wrong libc10 and crash at start-up). ACCEL_TORCH_VERSION_SUPPORTED is major.minor of the
# torch wheel scripts/setup.sh pins (tests/cmake/torch_version_unit.cmake checks that they agree).
include(AccelTorchVersion)
set(ACCEL_TORCH_VERSION_SUPPORTED 2.11)
set(ACCEL_TORCH_VERSION_REQUIRED "${ACCEL_TORCH_VERSION_SUPPORTED}" CACHE STRING
  "LibTorch version the configure insists on (2.11: any 2.11.x; 2.11.0: exactly); empty: no check")
accel_check_torch_version("${Torch_VERSION}" "${ACCEL_TORCH_VERSION_REQUIRED}" "${Torch_DIR}" FIX
  "Fix: point CMAKE_PREFIX_PATH at LibTorch ${ACCEL_TORCH_VERSION_REQUIRED} and re-configure from scratch (cmake \
--fresh or a new build directory: Torch_DIR and the LibTorch library paths are cached). For the venv wheel:\n\
  cmake --fresh -S . -B build -DCMAKE_PREFIX_PATH=$(.venv/bin/python -c 'import torch.utils; \
print(torch.utils.cmake_prefix_path)')\n\
or, for scripts/setup.sh, ACCEL_TORCH_PREFIX=/path/to/libtorch (an unzipped official LibTorch \
${ACCEL_TORCH_VERSION_REQUIRED}). To build against this LibTorch anyway (unsupported): \
-DACCEL_TORCH_VERSION_REQUIRED=")

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
