#!/usr/bin/env bash
# libstdcxx_binding.sh EXE...: each executable's calls into std:: must bind to the system libstdc++, not to the
# copies the torch wheel's libtorch.so exports (its own std::filesystem, from the toolchain it was built with,
# whose remove_all jumps to address 0: seen in a g++ 13 build on Ubuntu 24.04). That holds when every
# std::filesystem reference carries a libstdc++ symbol version (GLIBCXX_*) and libstdc++ comes before
# libtorch.so among the needed libraries; accelerate_cpp/CMakeLists.txt links it that way.
set -euo pipefail
status=0
for exe in "$@"; do
  needed=$(readelf -d "$exe" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p')
  stdcxx=$(grep -n -x 'libstdc++\.so\.6' <<<"$needed" | cut -d: -f1 || true)
  torch=$(grep -n -x 'libtorch\.so' <<<"$needed" | cut -d: -f1 || true)
  if [[ -z $stdcxx ]]; then
    echo "error: $exe does not list libstdc++.so.6 among its needed libraries, so its std:: calls bind to" \
      "whichever library exports them first (the torch wheel's libtorch.so exports std::filesystem): link" \
      "with -Wl,--push-state,--no-as-needed,-lstdc++,--pop-state before the objects"
    status=1
  elif [[ -n $torch && $torch -lt $stdcxx ]]; then
    echo "error: $exe lists libtorch.so (position $torch) before libstdc++.so.6 (position $stdcxx) among its" \
      "needed libraries: its std::filesystem calls would bind to libtorch.so's copy"
    status=1
  fi
  unversioned=$(nm -D --undefined-only "$exe" | grep '_ZNSt10filesystem' | grep -v '@GLIBCXX_' || true)
  if [[ -n $unversioned ]]; then
    echo "error: $exe references std::filesystem without libstdc++'s symbol versions (bound at link time to" \
      "another library's copy):"
    sed 's/^/  /' <<<"$unversioned"
    status=1
  fi
  [[ $status -eq 0 ]] && echo "$exe: std:: calls bind to libstdc++ ($(nm -D --undefined-only "$exe" |
    grep -c '_ZNSt10filesystem') std::filesystem references, all versioned)"
done
exit $status
