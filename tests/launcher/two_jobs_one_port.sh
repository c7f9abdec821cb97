#!/usr/bin/env bash
# Two jobs given one --main_process_port (issue 49): a rank of one job must never join the other. Each launch
# gives its ranks a run id (TORCHELASTIC_RUN_ID); rank 0 publishes it in its store and every other rank checks
# it first, so a stranger is refused with a message naming both ids, and the healthy job trains on, its sums
# exact.
#   1. Job A (2 ranks) runs; job B, "machine 1" of a 2-machine job on A's port (no port check on machine 1),
#      sends its ranks 2 and 3 to A's store: refused, naming both run ids; A finishes.
#   2. TRIALS times, two single-machine jobs started together on one port: exactly one finishes with exact
#      sums, the other fails (the port check, rank 0's bind, or a refused rank naming both ids).
# Usage: two_jobs_one_port.sh ACCEL_LAUNCH RENDEZVOUS_WORKER [TRIALS]
set -uo pipefail
launcher=$1 worker=$2 trials=${3:-2}
dir=$(mktemp -d "${TMPDIR:-/tmp}/two-jobs.XXXXXX")
trap 'kill $(jobs -p) 2>/dev/null; rm -rf "$dir"' EXIT
export ACCEL_CONFIG_FILE= OMP_NUM_THREADS=1
fail() {
  echo "two_jobs_one_port: FAILED: $*"
  for f in "$dir"/*.out; do echo "---- $f"; cat "$f"; done
  exit 1
}
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
# wait_for FILE PATTERN COUNT SECONDS: until COUNT lines of FILE match PATTERN.
wait_for() {
  local deadline=$((SECONDS + $4))
  until [ "$(grep -c "$2" "$1" 2>/dev/null)" -ge "$3" ]; do
    ((SECONDS < deadline)) || return 1
    sleep 0.1
  done
}

# ---- 1. a stranger reaches a running job's store ----
port=$(free_port)
common=(--cpu --main_process_ip 127.0.0.1 --main_process_port "$port")
STOP_FILE=$dir/stop1 "$launcher" launch "${common[@]}" --num_processes 2 "$worker" > "$dir/a.out" 2>&1 &
a=$!
wait_for "$dir/a.out" "joined run" 2 60 || fail "job A's ranks did not join within 60 s"
id_a=$(sed -n 's/.*joined run \([^ ]*\) as rank 0 .*/\1/p' "$dir/a.out")
[ -n "$id_a" ] && [ "$id_a" != none ] || fail "job A's run id is '$id_a', not a random one"
"$launcher" launch "${common[@]}" --num_processes 4 --num_machines 2 --machine_rank 1 --run_id intruder "$worker" \
  > "$dir/b.out" 2>&1 && fail "job B's ranks joined job A's store"
# The first of B's ranks refused ends B (its launcher stops the other): one message at least.
grep -q "^accel-launch: rank [23] (local rank [01], pid [0-9]*) failed with exit code 1$" "$dir/b.out" ||
  fail "job B did not fail on a refused rank"
grep -q "^rank [23] of run 'intruder' (world size 4, port $port) reached the rendezvous store at 127.0.0.1:$port of another job: run '$id_a' (world size 2, rank 0 is pid [0-9]* on .*, port $port)\. Two jobs use port $port, and this rank was refused before it touched the other job\. Give each job its own port (--main_process_port; 0 picks a free one on a single machine)" "$dir/b.out" ||
  fail "job B's ranks were not refused with a message naming both run ids"
touch "$dir/stop1"
wait "$a" || fail "job A failed after job B's ranks were refused"
[ "$(grep -c 'all-reduces, every sum 1$' "$dir/a.out")" = 2 ] || fail "job A's sums are not all exact"
echo "two_jobs_one_port: a stranger was refused naming run '$id_a' and run 'intruder'; job A finished, its sums exact"

# ---- 2. two jobs started together on one port ----
for ((t = 1; t <= trials; ++t)); do
  port=$(free_port)
  rm -f "$dir"/*.out
  for job in c d; do
    STOP_FILE=$dir/stop2.$t "$launcher" launch --cpu --num_processes 2 --main_process_port "$port" "$worker" \
      > "$dir/$job.out" 2>&1 &
    eval "pid_$job=$!"
  done
  # The loser ends by itself; then the winner is told to stop.
  deadline=$((SECONDS + 90))
  while kill -0 "$pid_c" 2>/dev/null && kill -0 "$pid_d" 2>/dev/null; do
    ((SECONDS < deadline)) || fail "trial $t: neither job ended within 90 s"
    sleep 0.1
  done
  touch "$dir/stop2.$t"
  wait "$pid_c"
  rc_c=$?
  wait "$pid_d"
  rc_d=$?
  if [ "$rc_c" = 0 ] && [ "$rc_d" != 0 ]; then winner=c loser=d
  elif [ "$rc_d" = 0 ] && [ "$rc_c" != 0 ]; then winner=d loser=c
  else fail "trial $t: exit codes $rc_c and $rc_d; exactly one job must finish"
  fi
  [ "$(grep -c 'all-reduces, every sum 1$' "$dir/$winner.out")" = 2 ] || fail "trial $t: the winner's sums are not all exact"
  how=$(grep -o "already in use\|EADDRINUSE\|address already in use\|of another job: run '[0-9a-f]*'" "$dir/$loser.out" | head -1)
  [ -n "$how" ] || fail "trial $t: the other job failed without saying that the port was taken or belonged to another job"
  echo "two_jobs_one_port: trial $t: one job finished with exact sums, the other failed ($how)"
done
echo "two_jobs_one_port: passed"
