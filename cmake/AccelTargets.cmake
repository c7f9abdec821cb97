# Helpers that give every accelerate-cpp target the same warnings and settings.

# accel_target_defaults(<target>): warnings (errors with ACCEL_WERROR), C++17.
function(accel_target_defaults target)
  target_compile_features(${target} PUBLIC cxx_std_17)
  if(CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
    target_compile_options(${target} PRIVATE -Wall -Wextra -Wpedantic -Wno-unused-parameter)
    if(ACCEL_WERROR)
      target_compile_options(${target} PRIVATE -Werror)
    endif()
  endif()
endfunction()

# accel_torch_pch(<target>): precompile LibTorch's umbrella header once per target; each further
# translation unit then compiles in seconds instead of ~20 s.
function(accel_torch_pch target)
  # A unity target parses LibTorch's headers once per unit of 8 sources; a precompiled header (~55 s to
  # build here) pays only for targets compiled one source at a time.
  get_target_property(_unity ${target} UNITY_BUILD)
  if(NOT ACCEL_NO_PCH AND NOT _unity)
    target_precompile_headers(${target} PRIVATE <torch/torch.h>)
  endif()
endfunction()
