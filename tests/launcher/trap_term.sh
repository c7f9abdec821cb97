#!/usr/bin/env bash
# Fake rank for launcher_test.cpp: writes $MARKER_DIR/term.$RANK when SIGTERM arrives, then exits 0; with
# TERM_DELAY, only after that many seconds (a checkpoint saved on SIGTERM, as the Trainer does). ALSO_TRAP
# names more signals handled the same way (INT: Ctrl-C).
set -u
trap 'sleep "${TERM_DELAY:-0}"; echo term > "$MARKER_DIR/term.$RANK"; exit 0' TERM ${ALSO_TRAP:-}
echo ready
while true; do sleep 0.1; done
