#!/usr/bin/env bash
# save_model on 2 ranks with one backend, load_model on 3 ranks and on 1 process with another: the weights
# must be the exported ones, bitwise (dist_worker hf_export, then hf_import).
#   export_reload.sh <accel-launch> <dist_worker> <save variant> <load variant>
set -euo pipefail
launch=$1 worker=$2 save=$3 load=$4
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
export ACCEL_TEST_SAVE_DIR=$dir ACCEL_CONFIG_FILE= OMP_NUM_THREADS=1
"$launch" launch --cpu --num_processes 2 --main_process_port 0 "$worker" hf_export "$save"
"$launch" launch --cpu --num_processes 3 --main_process_port 0 "$worker" hf_import "$load"
"$worker" hf_import local
echo "export_reload: exported on 2 ranks with $save, loaded on 3 ranks with $load and on 1 process"
