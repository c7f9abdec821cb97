#!/usr/bin/env bash
# A dist_worker scenario on 2 ranks with ACCEL_TEST_SAVE_DIR a fresh directory (trackers append, traces
# overwrite: each run starts empty), removed afterwards.
#   in_fresh_dir.sh <accel-launch> <dist_worker> <scenario> <variant>
set -uo pipefail
launch=$1 worker=$2 scenario=$3 variant=$4
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
export ACCEL_TEST_SAVE_DIR=$dir ACCEL_CONFIG_FILE= OMP_NUM_THREADS=1
"$launch" launch --cpu --num_processes 2 --main_process_port 0 "$worker" "$scenario" "$variant"
