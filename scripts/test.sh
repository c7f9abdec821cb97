#!/usr/bin/env bash
# Sets everything up (scripts/setup.sh) and runs the whole test suite through CTest.
# Extra arguments go to ctest, e.g. `./scripts/test.sh -R config` or `./scripts/test.sh -LE packaging`.
# The suite needs everything but the benchmarks (the target accel_suite_programs): those compile beside the
# running suite at idle priority (SCHED_IDLE, or nice 19 where that is refused), on the CPU time the suite's
# processes leave unused while they wait for each other, and the script waits for them at the end: a benchmark
# that does not compile fails the run as a failing test does.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
ACCEL_BUILD_TARGET=accel_suite_programs "$root/scripts/setup.sh"
cd "$root/${ACCEL_BUILD_DIR:-build}"

idle=(nice -n 19)
chrt --idle 0 true 2>/dev/null && idle=(chrt --idle 0 nice -n 19)
rest_log=$(mktemp "${TMPDIR:-/tmp}/accel-test-build.XXXXXX")
rest_start=$SECONDS
"${idle[@]}" cmake --build . -j "${ACCEL_JOBS:-2}" > "$rest_log" 2>&1 &
rest=$!
# Interrupted: the build beside the suite stops too (cmake's ninja, then cmake).
trap 'pkill -TERM -P "$rest" 2>/dev/null; kill "$rest" 2>/dev/null; rm -f "$rest_log"' EXIT

status=0
ctest -j "${ACCEL_JOBS:-2}" --output-on-failure "$@" || status=$?
if wait "$rest"; then
  echo "test.sh: the benchmarks, built beside the suite, are done ($((SECONDS - rest_start)) s after it started)"
else
  echo "test.sh: the rest of the build (the benchmarks) failed:" >&2
  grep -v -x 'ninja: no work to do.' "$rest_log" >&2 || true
  status=1
fi
exit "$status"
