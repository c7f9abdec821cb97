#!/usr/bin/env bash
# Saves a sharded checkpoint on 2 ranks with one backend, then resumes it on 3 ranks, on 1 rank and on 2 ranks
# with another (or the same) backend; every phase checks its own results (dist_worker reshard_save / reshard_load).
#   reshard.sh <accel-launch> <dist_worker> <save variant> <load variant>
set -euo pipefail
launch=$1 worker=$2 save_variant=$3 load_variant=$4
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
export ACCEL_TEST_CKPT_DIR=$dir ACCEL_CONFIG_FILE= OMP_NUM_THREADS=1
"$launch" launch --cpu --num_processes 2 --main_process_port 0 "$worker" reshard_save "$save_variant"
for n in 3 1 2; do
  "$launch" launch --cpu --num_processes "$n" --main_process_port 0 "$worker" reshard_load "$load_variant"
done
