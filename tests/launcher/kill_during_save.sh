#!/usr/bin/env bash
# A rank killed with SIGKILL in the middle of save_state(): the run fails, the checkpoints written before stay
# loadable, and load_state() on a new run resumes from the newest complete one (dist_worker auto_checkpoint).
#   kill_during_save.sh <accel-launch> <dist_worker> <variant>
# The first run's log (which reports the killed rank) is shown only if that run unexpectedly succeeds.
set -uo pipefail
launch=$1 worker=$2 variant=$3
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
export ACCEL_TEST_SAVE_DIR=$dir ACCEL_CONFIG_FILE= OMP_NUM_THREADS=1
if ACCEL_TEST_PHASE=crash "$launch" launch --cpu --num_processes 2 --main_process_port 0 "$worker" \
  auto_checkpoint "$variant" > "$dir/crash.log" 2>&1; then
  cat "$dir/crash.log"
  echo "kill_during_save: the run with a killed rank succeeded; it must fail" >&2
  exit 1
fi
if ! grep -q "auto_checkpoint: rank 1 killed while saving checkpoint_2" "$dir/crash.log"; then
  cat "$dir/crash.log"
  echo "kill_during_save: the run failed before the save it should interrupt" >&2
  exit 1
fi
echo "kill_during_save: rank 1 was killed while saving; left behind: $(ls "$dir/run/checkpoints" | tr '\n' ' ')"
ACCEL_TEST_PHASE=resume "$launch" launch --cpu --num_processes 2 --main_process_port 0 "$worker" \
  auto_checkpoint "$variant"
