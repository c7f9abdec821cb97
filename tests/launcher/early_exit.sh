#!/usr/bin/env bash
# Fake rank for launcher_test.cpp: rank 1 exits 0 at once, rank 0 runs on for $SLEEP seconds, then exits 0
# (a rank that returned early while the others go on, as after a rank-dependent break).
set -u
if [ "$RANK" = 1 ]; then exit 0; fi
sleep "${SLEEP:-7}"
