#!/usr/bin/env bash
# Fake rank for launcher_test.cpp: ignores SIGTERM and leaves a grandchild in its process group, so that only
# accel-launch's SIGKILL of the whole group after the grace period ends it. Writes the grandchild's pid to
# $MARKER_DIR/grandchild.$RANK.
set -u
trap '' TERM
sleep 60 &
echo $! > "$MARKER_DIR/grandchild.$RANK"
echo ready
if [ "$RANK" = "${FAIL_RANK:-none}" ]; then sleep 0.3; exit 5; fi
while true; do sleep 0.1; done
