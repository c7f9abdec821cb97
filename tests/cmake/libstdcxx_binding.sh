#!/usr/bin/env bash
# libstdcxx_binding.sh EXE...: each executable's calls into std::filesystem must bind to libstdc++, not to the
# copy the torch wheel's libtorch.so exports (from the toolchain it was built with, unversioned; its
# remove_all jumps to address 0). That holds when either
#  - the executable has no undefined std::filesystem reference (a static libstdc++ was linked in), or
#  - every such reference carries a libstdc++ symbol version (GLIBCXX_*) and libstdc++ comes before
#    libtorch.so among the needed libraries.
# accelerate_cpp/CMakeLists.txt links it that way (target accel_torch: -lstdc++ after our archives, before
# libtorch.so). Seen broken: a g++ 13 build on Ubuntu 24.04 whose libstdc++ is static, when the flag stood
# before the objects.
set -euo pipefail
fix="link accelerate_cpp::torch where you link torch (it puts -Wl,--push-state,--no-as-needed,-lstdc++,--pop-state
  after your objects and archives and before libtorch.so)"
status=0
for exe in "$@"; do
  refs=$(nm -D --undefined-only "$exe" | grep '_ZNSt10filesystem' || true)
  if [[ -z $refs ]]; then
    echo "$exe: no undefined std::filesystem references (libstdc++ linked in, or none used)"
    continue
  fi
  bad=0
  needed=$(readelf -d "$exe" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p')
  stdcxx=$(grep -n -x 'libstdc++\.so\.6' <<<"$needed" | cut -d: -f1 || true)
  torch=$(grep -n -x 'libtorch\.so' <<<"$needed" | cut -d: -f1 || true)
  if [[ -z $stdcxx ]]; then
    echo "error: $exe references std::filesystem but does not list libstdc++.so.6 among its needed libraries, so" \
      "the references bind to whichever library exports them first (the torch wheel's libtorch.so does): $fix"
    bad=1
  elif [[ -n $torch && $torch -lt $stdcxx ]]; then
    echo "error: $exe lists libtorch.so (position $torch) before libstdc++.so.6 (position $stdcxx) among its" \
      "needed libraries: its std::filesystem calls would bind to libtorch.so's copy; $fix"
    bad=1
  fi
  unversioned=$(grep -v '@GLIBCXX_' <<<"$refs" || true)
  if [[ -n $unversioned ]]; then
    echo "error: $exe references std::filesystem without libstdc++'s symbol versions (bound at link time to" \
      "another library's copy); $fix:"
    sed 's/^/  /' <<<"$unversioned"
    bad=1
  fi
  [[ $bad -eq 0 ]] && echo "$exe: std::filesystem calls bind to libstdc++ ($(wc -l <<<"$refs") references, all" \
    "versioned, libstdc++ before libtorch.so)"
  [[ $bad -eq 0 ]] || status=1
done
exit $status
