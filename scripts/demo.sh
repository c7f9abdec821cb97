#!/usr/bin/env bash
# Sets everything up (scripts/setup.sh) and trains the Fashion-MNIST example, printing throughput and the
# final test accuracy. Extra arguments go to the example (e.g. --epochs 1).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$root/scripts/setup.sh"
exec "$root/${ACCEL_BUILD_DIR:-build}/examples/fashion_mnist/fashion_mnist" --epochs 3 "$@"
