#!/usr/bin/env bash
# dist_worker restart_resume under accel-launch --max_restarts 1: rank 1 is killed once, the launcher
# restarts both ranks, and they resume from the newest checkpoint.
#   restart_resume.sh <accel-launch> <dist_worker> <variant> [scenario (default restart_resume)]
# The first attempt's output (the launcher's report of the killed rank, and the surviving rank's own failure
# report when it notices its peer is gone before the launcher stops it) is expected, so only the output
# after the restart is shown; the whole log is shown on failure.
set -uo pipefail
launch=$1 worker=$2 variant=$3 scenario=${4:-restart_resume}
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
export ACCEL_TEST_SAVE_DIR=$dir ACCEL_CONFIG_FILE= OMP_NUM_THREADS=1
if ! "$launch" launch --cpu --num_processes 2 --main_process_port 0 --max_restarts 1 "$worker" \
  "$scenario" "$variant" > "$dir/run.log" 2>&1; then
  cat "$dir/run.log"
  echo "$scenario: the restarted run failed" >&2
  exit 1
fi
grep -q "restarting all 2 rank(s) (restart 1 of 1)" "$dir/run.log" || { cat "$dir/run.log"; exit 1; }
sed -n '/restarting all 2 rank(s)/,$p' "$dir/run.log" | grep -v "was killed by signal" |
  grep -E "$scenario|resumed from|matches one process|passed"
