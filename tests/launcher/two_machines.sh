#!/usr/bin/env bash
# Two accel-launch processes on this machine acting as machine 0 and machine 1 of a 2 x 2 job (loopback).
# Usage: two_machines.sh ACCEL_LAUNCH PROGRAM ARGS...
set -euo pipefail
launcher=$1
shift
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
common=(--cpu --num_machines 2 --num_processes 4 --main_process_ip 127.0.0.1 --main_process_port "$port")
"$launcher" launch "${common[@]}" --machine_rank 0 "$@" &
first=$!
"$launcher" launch "${common[@]}" --machine_rank 1 "$@" &
second=$!
rc=0
wait "$first" || rc=$?
wait "$second" || rc=$?
# A test's PASS_REGULAR_EXPRESSION overrides the exit status: this line says both launchers succeeded.
((rc != 0)) || echo "two_machines: both launchers exited 0"
exit $rc
