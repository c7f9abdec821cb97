#!/usr/bin/env bash
# Fake rank for launcher_test.cpp: rank $FAIL_RANK prints a few lines and then exits with $FAIL_CODE, or kills
# itself with signal $FAIL_SIGNAL; every other rank sleeps for a minute (and must be stopped by accel-launch).
set -u
if [ "$RANK" = "$FAIL_RANK" ]; then
  for i in $(seq 1 25); do echo "rank $RANK line $i"; done
  echo "about to fail" >&2
  sleep 0.5
  if [ -n "${FAIL_SIGNAL:-}" ]; then kill "-$FAIL_SIGNAL" $$; fi
  exit "${FAIL_CODE:-3}"
fi
echo "rank $RANK sleeping"
sleep 60
