#!/usr/bin/env bash
# Sets everything up (scripts/setup.sh), then trains the Fashion-MNIST example on 2 CPU ranks with DDP through
# accel-launch: a progress line with samples/s from the main rank, then the test accuracy. Extra arguments go to
# the example (e.g. --epochs 1).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$root/scripts/setup.sh"
build="$root/${ACCEL_BUILD_DIR:-build}"
exec "$build/launcher/accel-launch" launch --config_file "$root/config_templates/ddp_cpu.yaml" \
  "$build/examples/fashion_mnist/fashion_mnist" --epochs 3 "$@"
