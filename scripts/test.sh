#!/usr/bin/env bash
# Sets everything up (scripts/setup.sh) and runs the whole test suite through CTest.
# Extra arguments go to ctest, e.g. `./scripts/test.sh -R config` or `./scripts/test.sh -LE packaging`.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$root/scripts/setup.sh"
cd "$root/${ACCEL_BUILD_DIR:-build}"
ctest -j "${ACCEL_JOBS:-2}" --output-on-failure "$@"
