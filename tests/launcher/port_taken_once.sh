#!/usr/bin/env bash
# Fake rank for launcher_test.cpp: on its first start rank 0 fails as a rank does whose picked port another
# program took first (EADDRINUSE) while rank 1 waits; on the next start both print MASTER_PORT and exit 0.
# Rank 1 waits for rank 0's "done" file for this port rather than for a marker of its own, so that how soon
# the launcher stops it on the first start (before or after bash has run a line) cannot change the outcome.
set -u
if [ "$RANK" = 0 ]; then
  if [ ! -e "$MARKER_DIR/started.0" ]; then
    touch "$MARKER_DIR/started.0"
    if [ "${OTHER_JOB:-0}" = 1 ]; then
      # Two launchers picked the same port: the first failure is a rank refused by the other job's store.
      echo "error: rank 1 of run 'aaaa' (world size 2, port $MASTER_PORT) reached the rendezvous store at" \
        "127.0.0.1:$MASTER_PORT of another job: run 'bbbb' (world size 2, rank 0 is pid 1 on vm, port $MASTER_PORT)." >&2
      exit 1
    fi
    echo "error: rank 0: rendezvous with 127.0.0.1:$MASTER_PORT failed after 0.1 s (timeout 1800 s): The server socket has" \
      "failed to listen on any local network address. port: $MASTER_PORT, code: -98, name: EADDRINUSE" >&2
    exit 1
  fi
  touch "$MARKER_DIR/done.$MASTER_PORT"
else
  for _ in $(seq 600); do
    [ -e "$MARKER_DIR/done.$MASTER_PORT" ] && break
    sleep 0.1
  done
  [ -e "$MARKER_DIR/done.$MASTER_PORT" ] || exit 3
fi
echo "port $MASTER_PORT"
