#!/usr/bin/env bash
# dist_worker restart_resume under accel-launch --max_restarts 1: rank 1 is killed once, the launcher
# restarts both ranks, and they resume from the newest checkpoint.
#   restart_resume.sh <accel-launch> <dist_worker> <variant>
# The launcher's report of the killed rank is part of this test's expected output, so it is shown only on
# failure.
set -uo pipefail
launch=$1 worker=$2 variant=$3
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
export ACCEL_TEST_SAVE_DIR=$dir ACCEL_CONFIG_FILE= OMP_NUM_THREADS=1
if ! "$launch" launch --cpu --num_processes 2 --main_process_port 0 --max_restarts 1 "$worker" \
  restart_resume "$variant" > "$dir/run.log" 2>&1; then
  cat "$dir/run.log"
  echo "restart_resume: the restarted run failed" >&2
  exit 1
fi
grep -q "restarting all 2 rank(s) (restart 1 of 1)" "$dir/run.log" || { cat "$dir/run.log"; exit 1; }
grep -v "was killed by signal" "$dir/run.log" | grep -E "restart_resume|matches one process|passed"
