#!/usr/bin/env bash
# `accel-launch test` must fail, naming the check, when the ranks' training differs from one process
# (ACCEL_TEST_CHECK_FAULT=weights perturbs the trained weights before the comparison).
#   test_command_fails.sh <accel-launch>
set -uo pipefail
launch=$1
out=$(ACCEL_CONFIG_FILE= OMP_NUM_THREADS=1 ACCEL_TEST_CHECK_FAULT=weights \
  "$launch" test --cpu --num_processes 2 --main_process_port 0 2>&1)
code=$?
if [[ $code -eq 0 ]] || ! grep -q "accel-launch test: FAILED" <<<"$out" ||
  ! grep -q "matches one process on the whole batch (max difference" <<<"$out"; then
  echo "$out"
  echo "test_command_fails: expected a failure naming the training check (exit code $code)" >&2
  exit 1
fi
echo "test_command_fails: accel-launch test exited $code and named the training check"
