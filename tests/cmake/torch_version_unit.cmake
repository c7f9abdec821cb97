# cmake -DSOURCE_DIR=<repo> -P torch_version_unit.cmake
# Unit test of accel_check_torch_version (cmake/AccelTorchVersion.cmake): which versions match, the message on a
# mismatch, and the FATAL_ERROR without RESULT_VARIABLE. Also checks that the LibTorch series the configure
# requires by default (cmake/AccelDependencies.cmake) is the one scripts/setup.sh installs.
if(NOT DEFINED SOURCE_DIR)
  message(FATAL_ERROR "torch_version_unit.cmake: -DSOURCE_DIR= is required")
endif()
include("${SOURCE_DIR}/cmake/AccelTorchVersion.cmake")

if(FATAL_CASE)  # run as a child below: the function must stop CMake on its own
  accel_check_torch_version(1.13.1 2.11 /usr/lib/x86_64-linux-gnu/cmake/Torch FIX "Fix: the fix text")
  message(STATUS "not reached")
  return()
endif()

function(expect_match found required)
  accel_check_torch_version("${found}" "${required}" /some/Torch RESULT_VARIABLE problem)
  if(NOT problem STREQUAL "")
    message(SEND_ERROR "LibTorch ${found} should satisfy '${required}', got: ${problem}")
  endif()
endfunction()
function(expect_mismatch found required)
  accel_check_torch_version("${found}" "${required}" /some/Torch RESULT_VARIABLE problem FIX "Fix: do X")
  if(problem STREQUAL "")
    message(SEND_ERROR "LibTorch '${found}' should not satisfy '${required}'")
  endif()
  foreach(text IN LISTS ARGN)
    string(FIND "${problem}" "${text}" at)
    if(at EQUAL -1)
      message(SEND_ERROR "the message for '${found}' vs '${required}' lacks \"${text}\": ${problem}")
    endif()
  endforeach()
endfunction()

# major.minor: any patch release of that series.
expect_match(2.11.0 2.11)
expect_match(2.11.3 2.11)
expect_match(2.11 2.11)
expect_match(2.11.0a0+git1234 2.11)
expect_mismatch(1.13.1 2.11
  "Wrong LibTorch: found LibTorch 1.13.1 in /some/Torch (Torch_DIR), but accelerate-cpp needs LibTorch 2.11.x."
  "\nFix: do X")
expect_mismatch(2.1.0 2.11 "found LibTorch 2.1.0")       # not a string prefix match
expect_mismatch(2.110.0 2.11 "found LibTorch 2.110.0")
expect_mismatch(2.12.0 2.11 "needs LibTorch 2.11.x")
expect_mismatch(3.11.0 2.11)
# major.minor.patch (the installed package config): exactly that release.
expect_match(2.11.0 2.11.0)
expect_match(2.11.0+cu130 2.11.0)
expect_mismatch(2.11.1 2.11.0 "found LibTorch 2.11.1" "needs exactly LibTorch 2.11.0.")
expect_mismatch(2.10.0 2.11.0)
# Unknown version (no TorchConfigVersion.cmake): refused; an empty requirement disables the check.
expect_mismatch("" 2.11 "of unknown version")
expect_match(1.13.1 "")
expect_match("" "")

# The result variable is cleared on a match.
set(problem "stale")
accel_check_torch_version(2.11.0 2.11 /some/Torch RESULT_VARIABLE problem)
if(NOT problem STREQUAL "")
  message(SEND_ERROR "RESULT_VARIABLE is not cleared on a match: ${problem}")
endif()

# Without RESULT_VARIABLE a mismatch is a FATAL_ERROR with the same message.
execute_process(COMMAND ${CMAKE_COMMAND} -DSOURCE_DIR=${SOURCE_DIR} -DFATAL_CASE=ON -P ${CMAKE_CURRENT_LIST_FILE}
  OUTPUT_VARIABLE out ERROR_VARIABLE out RESULT_VARIABLE rc)
string(REGEX REPLACE "[ \t\r\n]+" " " flat "${out}")
message(STATUS "FATAL_ERROR case (exit ${rc}):\n${out}")
if(rc EQUAL 0 OR flat MATCHES "not reached")
  message(SEND_ERROR "a mismatch without RESULT_VARIABLE did not stop CMake")
endif()
foreach(text "CMake Error" "Wrong LibTorch: found LibTorch 1.13.1 in /usr/lib/x86_64-linux-gnu/cmake/Torch (Torch_DIR), but accelerate-cpp needs LibTorch 2.11.x." "Fix: the fix text")
  string(FIND "${flat}" "${text}" at)
  if(at EQUAL -1)
    message(SEND_ERROR "the FATAL_ERROR output lacks \"${text}\"")
  endif()
endforeach()

# The default requirement is the series of the wheel scripts/setup.sh pins.
file(STRINGS "${SOURCE_DIR}/scripts/setup.sh" pin REGEX "^torch_version=")
file(STRINGS "${SOURCE_DIR}/cmake/AccelDependencies.cmake" supported REGEX "^set\\(ACCEL_TORCH_VERSION_SUPPORTED ")
string(REGEX MATCH "^torch_version=([0-9]+\\.[0-9]+)" _ "${pin}")
set(pinned "${CMAKE_MATCH_1}")
string(REGEX MATCH "ACCEL_TORCH_VERSION_SUPPORTED ([0-9.]+)\\)" _ "${supported}")
if(pinned STREQUAL "" OR NOT pinned STREQUAL CMAKE_MATCH_1)
  message(SEND_ERROR "scripts/setup.sh pins torch ${pin} but cmake/AccelDependencies.cmake has '${supported}'")
endif()
