#!/usr/bin/env bash
# Fake rank for launcher_test.cpp: rank 1 exits 0 at once, rank 0 runs on for $SLEEP seconds, then exits 0
# (a rank that returned early while the others go on, as after a rank-dependent break). With $FAIL_LINE,
# rank 0 then prints it and exits 1 instead (as a rank whose collective failed when the other left).
set -u
if [ "$RANK" = 1 ]; then exit 0; fi
sleep "${SLEEP:-7}"
if [ -n "${FAIL_LINE:-}" ]; then
  echo "$FAIL_LINE" >&2
  exit 1
fi
