#!/usr/bin/env bash
# Fake rank for launcher_test.cpp: on its first start rank 0 fails as a rank does whose picked port another
# program took first (EADDRINUSE) while rank 1 waits; on the next start both print MASTER_PORT and exit 0.
set -u
if [ ! -e "$MARKER_DIR/started.$RANK" ]; then
  touch "$MARKER_DIR/started.$RANK"
  if [ "$RANK" = 0 ]; then
    echo "error: rank 0: rendezvous with 127.0.0.1:$MASTER_PORT failed after 0.1 s (timeout 1800 s): The server socket has" \
      "failed to listen on any local network address. port: $MASTER_PORT, code: -98, name: EADDRINUSE" >&2
    exit 1
  fi
  sleep 60
fi
echo "port $MASTER_PORT"
