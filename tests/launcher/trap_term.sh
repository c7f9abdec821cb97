#!/usr/bin/env bash
# Fake rank for launcher_test.cpp: writes $MARKER_DIR/term.$RANK when SIGTERM arrives, then exits 0.
set -u
trap 'echo term > "$MARKER_DIR/term.$RANK"; exit 0' TERM
echo ready
while true; do sleep 0.1; done
