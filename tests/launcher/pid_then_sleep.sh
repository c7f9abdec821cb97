#!/usr/bin/env bash
# Fake rank for launcher_test.cpp: writes its pid to $MARKER_DIR/pid.$RANK and the resolved config file's path
# to $MARKER_DIR/config.$RANK, says ready, then sleeps a minute as
# the same process (exec), ignoring SIGTERM: only the launcher's death (PR_SET_PDEATHSIG) or SIGKILL ends it.
# With HELPER=1 it first starts a helper of its own (a wrapper script's program, a data worker), pid in
# $MARKER_DIR/helper.$RANK, that also ignores SIGTERM and sleeps a minute: PR_SET_PDEATHSIG does not reach it.
# With TERM_EXITS=1 the rank ends on SIGTERM; its helper does not.
set -u
trap '' TERM
if [ "${HELPER:-}" = 1 ]; then
  sleep 60 &
  echo $! > "$MARKER_DIR/helper.$RANK"
fi
echo $$ > "$MARKER_DIR/pid.$RANK"
echo "$ACCEL_CONFIG_FILE" > "$MARKER_DIR/config.$RANK"
echo ready
# TERM_EXITS=1: the rank itself ends on SIGTERM (its helper still ignores it).
[ "${TERM_EXITS:-}" = 1 ] && trap - TERM
exec sleep 60
