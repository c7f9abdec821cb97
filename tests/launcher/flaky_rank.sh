#!/usr/bin/env bash
# Fake rank for launcher_test.cpp: rank 1 fails (exit 3) while TORCHELASTIC_RESTART_COUNT < $FAIL_TIMES; then
# every rank succeeds and says which attempt it is.
set -u
if [ "$RANK" = "1" ] && [ "$TORCHELASTIC_RESTART_COUNT" -lt "$FAIL_TIMES" ]; then
  echo "rank 1 fails on attempt $TORCHELASTIC_RESTART_COUNT"
  exit 3
fi
echo "rank $RANK ok on attempt $TORCHELASTIC_RESTART_COUNT of at most $TORCHELASTIC_MAX_RESTARTS restarts, port $MASTER_PORT"
