# accel_check_torch_version(<found> <required> <where> [FIX <text>] [RESULT_VARIABLE <var>])
#
# Refuses a LibTorch of another version than the one accelerate-cpp is built for: a wrong LibTorch earlier on
# the search path (Debian's libtorch-dev 1.13, another venv) otherwise links the wrong libc10 and crashes at
# start-up. <found> is the Torch_VERSION that find_package(Torch) set, <where> the Torch_DIR it came from.
# <required> is a version prefix: "2.11" accepts any 2.11.x, "2.11.0" only 2.11.0; an empty <required>
# disables the check. On a mismatch, FATAL_ERROR with both versions, <where> and the FIX text, or, with
# RESULT_VARIABLE, set <var> to that message (and to "" when the versions match) and return.
# Used by the project's configure (cmake/AccelDependencies.cmake) and the installed accelerate_cppConfig.cmake;
# unit-tested by tests/cmake/torch_version_unit.cmake.
function(accel_check_torch_version found required where)
  cmake_parse_arguments(PARSE_ARGV 3 arg "" "FIX;RESULT_VARIABLE" "")
  if(arg_UNPARSED_ARGUMENTS)
    message(FATAL_ERROR "accel_check_torch_version: unexpected arguments: ${arg_UNPARSED_ARGUMENTS}")
  endif()
  set(problem "")
  if(NOT required STREQUAL "")
    if(NOT required MATCHES "^[0-9]+(\\.[0-9]+)*$")
      message(FATAL_ERROR "accel_check_torch_version: the required LibTorch version \"${required}\" is not a "
        "version like 2.11 or 2.11.0")
    endif()
    # Compare as many components as <required> has; a suffix such as "a0+git1234" is ignored.
    string(REGEX MATCHALL "[0-9]+" req_parts "${required}")
    list(LENGTH req_parts n)
    set(found_cmp "")
    if(found MATCHES "^[0-9]+(\\.[0-9]+)*")
      string(REGEX MATCHALL "[0-9]+" found_parts "${CMAKE_MATCH_0}")
      list(LENGTH found_parts found_n)
      if(found_n GREATER n)
        list(SUBLIST found_parts 0 ${n} found_parts)
      endif()
      list(JOIN found_parts "." found_cmp)
    endif()
    if(found_cmp STREQUAL "" OR NOT found_cmp VERSION_EQUAL required)
      if(n LESS 3)
        set(wanted "LibTorch ${required}.x")
      else()
        set(wanted "exactly LibTorch ${required}")
      endif()
      if(found STREQUAL "")
        set(found "of unknown version (Torch_VERSION is empty: no TorchConfigVersion.cmake)")
      endif()
      if(where STREQUAL "")
        set(where "<Torch_DIR not set>")
      endif()
      string(CONCAT problem "Wrong LibTorch: found LibTorch ${found} in ${where} (Torch_DIR), but accelerate-cpp needs "
        "${wanted}.")
      if(NOT arg_FIX STREQUAL "")
        string(APPEND problem "\n${arg_FIX}")
      endif()
    endif()
  endif()
  if(DEFINED arg_RESULT_VARIABLE)
    set(${arg_RESULT_VARIABLE} "${problem}" PARENT_SCOPE)
  elseif(NOT problem STREQUAL "")
    message(FATAL_ERROR "${problem}")
  endif()
endfunction()
