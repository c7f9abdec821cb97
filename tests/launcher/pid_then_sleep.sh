#!/usr/bin/env bash
# Fake rank for launcher_test.cpp: writes its pid to $MARKER_DIR/pid.$RANK, says ready, then sleeps a minute as
# the same process (exec), ignoring SIGTERM: only the launcher's death (PR_SET_PDEATHSIG) or SIGKILL ends it.
set -u
echo $$ > "$MARKER_DIR/pid.$RANK"
echo ready
trap '' TERM
exec sleep 60
