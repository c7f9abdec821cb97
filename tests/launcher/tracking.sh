#!/usr/bin/env bash
# dist_worker tracking on 2 ranks with every built-in tracker, in a fresh directory (trackers append).
#   tracking.sh <accel-launch> <dist_worker> <variant>
set -uo pipefail
launch=$1 worker=$2 variant=$3
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
export ACCEL_TEST_SAVE_DIR=$dir ACCEL_CONFIG_FILE= OMP_NUM_THREADS=1
"$launch" launch --cpu --num_processes 2 --main_process_port 0 "$worker" tracking "$variant"
