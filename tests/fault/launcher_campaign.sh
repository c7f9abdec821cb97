#!/usr/bin/env bash
# Fault-injection campaign against `accel-launch launch` (issue 30): each abuse repeated N times at a randomly
# chosen moment, its outcomes counted. launcher_test.cpp checks each behaviour once at a fixed moment; this
# script looks for the moments where it breaks (start-up, port picking, rendezvous, training, stopping).
#
#   launcher_campaign.sh ACCEL_LAUNCH [N [REAL_PROGRAM [ARGS...]]]
#
# N (default 3, about 40 s) trials of each of kinds 1-4; N=20 or more for a one-off measurement (about 4 min).
# The ranks are a small bash program (written here; builtins only, so each rank is one process, plus in kind 1
# a subshell) that runs up to 30 s if undisturbed; with REAL_PROGRAM (a real training program, such as
# examples/gan/gan --epochs 60 --train-limit 4096) every other trial of kinds 1, 2 and 4 runs that program as
# the ranks instead, so the abuse lands during LibTorch start-up, the rendezvous or training. Kinds:
#   1. kill -9 of the launcher after 0-3 s: 2 s later no process started under it may remain, nor its resolved
#      config file in its TMPDIR (each counted as an orphan); the shell ranks each start a helper subshell
#      first, which only the launcher's watchdog can end.
#   2. SIGTERM or SIGINT (sometimes twice) to the launcher after 0-3 s, the ranks exiting on SIGTERM or ignoring
#      it: exit 143 / 130 within a few seconds (else hang), "received SIG...; forwarded it" once ranks ran
#      (else unreported), nothing left behind (else orphan).
#   3. One rank (0 or 1) exits 0 after 0-2 s while the other runs on: with --early_exit_report 1, "rank R exited
#      with code 0 1 s ago while 1 rank(s) still run" within 3.5 s of that exit (else unreported); once the other rank exits, the launcher
#      exits 0 at once (else hang).
#   4. Rank 0 or 1 killed with SIGKILL, SIGSEGV or SIGABRT after 0-3 s, the other rank exiting on SIGTERM or
#      ignoring it: "rank R (local rank R, pid P) was killed by signal S (NAME)" naming that rank and pid (else
#      unreported), exit code 128 + S (else wrong), within 5 s (else hang), nothing left behind.
#   5. Bad invocations, once each (far too many ranks, num_processes 0, port 70000, a program that does not
#      exist / is a directory / is not executable, a config file that does not exist / is a directory /
#      is /dev/zero / is a FIFO nobody writes to, a busy port): exit non-zero within 5 s (else hang) with
#      exactly one line, "accel-launch: error: ...", on stderr and nothing on stdout (else unreported).
# Every process a trial starts carries ACCEL_CAMPAIGN_TAG=<campaign>-<trial> in its environment; that is how
# orphans are found (grandchildren included) and how everything is killed at the end. Prints one line per
# trial, one summary line per kind and
#   launcher campaign: K trials, 0 orphans, 0 hangs, 0 unreported, 0 wrong
# ("wrong": an unexpected exit code, or a trial that could not be set up) and exits 1 if any count but K is not
# 0. ACCEL_CAMPAIGN_SEED=S (printed first) repeats a campaign's random choices (not the machine's timing).
set -u
export LC_ALL=C

if [ $# -lt 1 ] || [ ! -x "$1" ]; then
  echo "usage: launcher_campaign.sh ACCEL_LAUNCH [N [REAL_PROGRAM [ARGS...]]]" >&2
  exit 2
fi
launch=$1
trials=${2:-3}
shift $(($# >= 2 ? 2 : 1))
real=("$@")  # empty: shell ranks only
case $trials in '' | *[!0-9]*)
  echo "launcher_campaign.sh: N must be a number, got '$trials'" >&2
  exit 2
  ;;
esac

export ACCEL_CONFIG_FILE='' OMP_NUM_THREADS=1
unset RANK LOCAL_RANK WORLD_SIZE LOCAL_WORLD_SIZE GROUP_RANK MASTER_ADDR MASTER_PORT ACCEL_CAMPAIGN_TAG
ulimit -c 0  # ranks killed with SIGSEGV/SIGABRT write no core files

seed=${ACCEL_CAMPAIGN_SEED:-$(((${EPOCHREALTIME/./} + $$) % 1000000))}
case $seed in '' | *[!0-9]*)
  echo "launcher_campaign.sh: ACCEL_CAMPAIGN_SEED must be a number, got '$seed'" >&2
  exit 2
  ;;
esac
campaign=accel-campaign-$$-$seed
dir=$(mktemp -d "${TMPDIR:-/tmp}/accel-launcher-campaign.XXXXXX")
launcher_pid=

# ---- helpers -----------------------------------------------------------------------------------------------

now_ms() { local t=${EPOCHREALTIME/./}; echo $((t / 1000)); }
# Random choices: a 64-bit LCG (Knuth's MMIX constants), its high bits used, set in $r and never called in
# $(...), which would not advance the state. Not bash's RANDOM: its low bits, taken every third draw, can come
# out 0 17 times in 20.
random_state=$seed
next_random() {
  random_state=$((random_state * 6364136223846793005 + 1442695040888963407))
  r=$(((random_state >> 33) & 0x7fffffff))
}
# r = a random number of milliseconds in [0, $1].
random_ms() {
  next_random
  r=$((r % ($1 + 1)))
}
# r = one of the words $@, at random.
pick() {
  local words=("$@")
  next_random
  r=${words[$((r % $#))]}
}
seconds() { printf '%d.%03d' $(($1 / 1000)) $(($1 % 1000)); }

# Pids of the live processes whose environment has ACCEL_CAMPAIGN_TAG=$1 (or $1-<anything>); zombies have no
# environment left and are not listed.
tagged_pids() {
  grep -lzsE "^ACCEL_CAMPAIGN_TAG=$1(-.*)?\$" /proc/[0-9]*/environ 2>/dev/null | cut -d/ -f3
}

# Number of processes tagged $1 with a RANK: the ranks and anything they started (not the launcher or its
# watchdog).
count_ranks() {
  local pid n=0
  for pid in $(tagged_pids "$1"); do
    [ "$pid" != "$launcher_pid" ] && grep -qzE '^RANK=' "/proc/$pid/environ" 2>/dev/null && n=$((n + 1))
  done
  echo "$n"
}

# True when process $1 ignores SIGINT (bash makes background jobs ignore it when it cannot be reset).
int_ignored() {
  local mask
  mask=$(awk '/^SigIgn:/ {print $2}' "/proc/$1/status" 2> /dev/null)
  [ -n "$mask" ] && (((0x$mask & 2) != 0))
}

# Pid of the process of rank $2 under tag $1 (the one whose environment has RANK=$2), or nothing.
rank_pid() {
  local pid
  for pid in $(tagged_pids "$1"); do
    [ "$pid" = "$launcher_pid" ] && continue
    if tr '\0' '\n' < "/proc/$pid/environ" 2>/dev/null | grep -qx "RANK=$2"; then
      echo "$pid"
      return
    fi
  done
}

# True once process $1 (a child of this shell) has exited; it is then reaped and its exit code put in $rc
# (also on later calls).
reaped_pid='' reaped_rc=''
exited() {
  local stat
  if [ "$1" = "$reaped_pid" ]; then
    rc=$reaped_rc
    return 0
  fi
  if read -r stat 2>/dev/null < "/proc/$1/stat"; then
    stat=${stat##*) }
    [ "${stat:0:1}" = Z ] || return 1
  fi
  wait "$1" 2>/dev/null
  rc=$?
  reaped_pid=$1 reaped_rc=$rc
  return 0
}

# Waits up to $2 ms for launcher $1 to exit (exit code in $rc); false on timeout.
wait_exit() {
  local deadline=$(($(now_ms) + $2))
  until exited "$1"; do
    [ "$(now_ms)" -ge "$deadline" ] && return 1
    sleep 0.02
  done
}

# Kills launcher $1 and everything tagged $2 with SIGKILL, and reaps the launcher.
kill_all() {
  local pid
  if [ -n "$1" ]; then
    kill -KILL "$1" 2>/dev/null
    wait "$1" 2>/dev/null
  fi
  for pid in $(tagged_pids "$2"); do kill -KILL "$pid" 2>/dev/null; done
}

# Counts into $left the processes still tagged $1 after up to $2 ms (the launcher excluded), and kills them;
# with a trial directory $3, also the files its launcher left in its TMPDIR ($3/tmp: the resolved config file,
# which the launcher or, when the launcher is killed, its watchdog deletes), and deletes them.
count_left() {
  local deadline=$(($(now_ms) + $2)) pids files
  left=0
  while :; do
    pids=$(tagged_pids "$1")
    [ -z "$pids" ] && break
    if [ "$(now_ms)" -ge "$deadline" ]; then
      left=$(echo "$pids" | wc -w)
      echo "    left behind: $(for p in $pids; do tr '\0' ' ' < "/proc/$p/cmdline" 2>/dev/null; echo -n "(pid $p) "; done)"
      kill_all "" "$1"
      break
    fi
    sleep 0.05
  done
  [ -n "${3:-}" ] || return 0
  files=$(find "$3/tmp" -mindepth 1 -maxdepth 1 2> /dev/null)
  [ -z "$files" ] && return 0
  left=$((left + $(echo "$files" | wc -l)))
  echo "    files left behind: $(echo $files)"
  rm -rf "$3/tmp" && mkdir -p "$3/tmp"
}

# Starts accel-launch on 2 ranks in the background with tag $1, output in $2/out and $2/err, then the rest of
# the arguments (launcher options, then the program); sets $launcher_pid. SIGINT and SIGQUIT, which bash
# ignores in background jobs, are set back to their defaults so that the launcher catches SIGINT.
start() {
  local tag=$1 trial_dir=$2
  shift 2
  (
    trap - INT QUIT
    exec env ACCEL_CAMPAIGN_TAG="$tag" CAMPAIGN_DIR="$trial_dir" TMPDIR="$trial_dir/tmp" "$launch" launch --cpu --num_processes 2 \
      --main_process_port 0 --backend ddp --grace_period 1 --early_exit_report 1 "$@"
  ) > "$trial_dir/out" 2> "$trial_dir/err" < /dev/null &
  launcher_pid=$!
}

# The last lines of a trial's launcher output, indented, after a bad outcome.
show() {
  echo "    launcher stderr (last 8 lines):"
  tail -n 8 "$1/err" | sed 's/^/      /'
}

# Lines the ranks of trial directory $1 printed so far (how far the program got).
printed() { grep -c '^\[rank ' "$1/out"; }

new_trial_dir() {
  local d=$dir/$1
  mkdir -p "$d/tmp" && mkfifo "$d/fifo.0" "$d/fifo.1" && echo "$d"
}

# The shell rank: writes $CAMPAIGN_DIR/pid.$RANK and says ready, then waits (bash builtins only, so that the
# rank is one process) for a line on its FIFO or for $LIFE seconds (default 30), then exits 0. EARLY=R: rank R
# instead exits 0 after $EARLY_MS ms, writing exited.$RANK first. TERM=ignore: SIGTERM is ignored (only the
# launcher's SIGKILL after the grace period ends the rank); otherwise SIGTERM makes it exit 0.
cat > "$dir/rank.sh" << 'EOF'
#!/usr/bin/env bash
set -u
echo $$ > "$CAMPAIGN_DIR/pid.$RANK"
if [ "${TERM_MODE:-exit}" = ignore ]; then trap '' TERM; else trap 'exit 0' TERM; fi
exec 3<> "$CAMPAIGN_DIR/fifo.$RANK"
# HELPER=1: a helper of the rank's own (a subshell, as a wrapper script's program), which the launcher's
# watchdog must kill with the rank's process group when the launcher dies.
if [ "${HELPER:-}" = 1 ]; then (read -r -t "${LIFE:-30}" -u 3 _) & fi
echo ready
if [ "${EARLY:-}" = "$RANK" ]; then
  read -r -t "$(printf '%d.%03d' $((EARLY_MS / 1000)) $((EARLY_MS % 1000)))" -u 3 _
  : > "$CAMPAIGN_DIR/exited.$RANK"
  exit 0
fi
read -r -t "${LIFE:-30}" -u 3 _
exit 0
EOF
chmod +x "$dir/rank.sh"

cleanup() {
  kill_all "$launcher_pid" "$campaign"
  rm -rf "$dir"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

total_trials=0 total_orphans=0 total_hangs=0 total_unreported=0 total_wrong=0
# Adds this kind's counts to the totals and prints its summary line: $1 = description, then trials, orphans,
# hangs, unreported, wrong.
summary() {
  summaries+=("$1: $2 trials, $3 orphans, $4 hangs, $5 unreported, $6 wrong")
  total_trials=$((total_trials + $2)) total_orphans=$((total_orphans + $3)) total_hangs=$((total_hangs + $4))
  total_unreported=$((total_unreported + $5)) total_wrong=$((total_wrong + $6))
}
summaries=()

# Program of trial $1 for kinds 1, 2 and 4: the real program on odd trials when there is one.
uses_real() { [ ${#real[@]} -gt 0 ] && [ $(($1 % 2)) -eq 1 ]; }

echo "launcher campaign: seed $seed, $trials trial(s) per kind, ranks: shell${real[*]:+ and ${real[*]}}"

# ---- 1. kill -9 of the launcher ------------------------------------------------------------------------------
orphans=0
for ((i = 0; i < trials; ++i)); do
  tag=$campaign-k1-$i
  d=$(new_trial_dir "k1-$i")
  random_ms 3000 && delay=$r
  if uses_real "$i"; then
    what=real
    start "$tag" "$d" "${real[@]}"
  else
    what=shell+helper
    HELPER=1 start "$tag" "$d" "$dir/rank.sh"
  fi
  sleep "$(seconds "$delay")"
  ranks=$(count_ranks "$tag") printed=$(printed "$d")
  kill -KILL "$launcher_pid" 2>/dev/null
  wait "$launcher_pid" 2>/dev/null
  launcher_pid=
  count_left "$tag" 2000 "$d"
  orphans=$((orphans + left))
  echo "  kill -9 #$i ($what ranks, after $(seconds "$delay") s, $ranks rank process(es) up, $printed line(s) printed): $left orphan(s)"
  [ "$left" -gt 0 ] && show "$d"
done
summary "kill -9 of the launcher" "$trials" "$orphans" 0 0 0

# Starts trial $i's ranks in sections 2 and 4: the real program on the trials uses_real picks, else the shell
# rank with TERM_MODE=$term_mode; `what` names which.
start_trial_ranks() {
  if uses_real "$i"; then
    what=real
    start "$tag" "$d" "${real[@]}"
  else
    what="shell, TERM_MODE=$term_mode"
    TERM_MODE=$term_mode start "$tag" "$d" "$dir/rank.sh"
  fi
}

# The end of a trial of sections 2-4: no launcher left to kill at exit, the trial's leftover processes counted
# as orphans, its line printed ("LINE, N orphan(s)"), and its directory shown when it went wrong.
end_trial() {
  launcher_pid=
  count_left "$tag" 1000 "$d"
  orphans=$((orphans + left))
  echo "$1, $left orphan(s)"
  if [ "$outcome" != ok ] || [ "$left" -gt 0 ]; then show "$d"; fi
}

# ---- 2. SIGTERM / SIGINT to the launcher -------------------------------------------------------------------
orphans=0 hangs=0 unreported=0 wrong=0
for ((i = 0; i < trials; ++i)); do
  tag=$campaign-k2-$i
  d=$(new_trial_dir "k2-$i")
  random_ms 3000 && delay=$r
  pick TERM INT && signal=$r
  pick yes no no && twice=$r
  pick exit ignore && term_mode=$r
  start_trial_ranks
  sleep "$(seconds "$delay")"
  ranks=$(count_ranks "$tag") printed=$(printed "$d")
  if [ "$signal" = INT ] && int_ignored "$launcher_pid"; then
    echo "    (SIGINT is ignored here, as under nohup, and so rightly by the launcher: sending SIGTERM instead)"
    signal=TERM
  fi
  ended_by_itself=no
  exited "$launcher_pid" && ended_by_itself=yes
  kill -"$signal" "$launcher_pid" 2>/dev/null
  if [ "$twice" = yes ]; then
    sleep 0.1
    kill -"$signal" "$launcher_pid" 2>/dev/null
  fi
  expected=$([ "$signal" = TERM ] && echo 143 || echo 130)
  outcome=ok
  if [ "$ended_by_itself" = yes ]; then
    outcome="wrong: the launcher ended by itself (exit code $rc) before the signal; the program must run longer"
    wrong=$((wrong + 1))
  elif ! wait_exit "$launcher_pid" 6000; then
    outcome="hang (still running 6 s after SIG$signal)"
    hangs=$((hangs + 1))
    kill_all "$launcher_pid" "$tag"
  elif [ "$rc" != "$expected" ]; then
    outcome="wrong exit code $rc, expected $expected"
    wrong=$((wrong + 1))
  elif [ "$ranks" -gt 0 ] &&
    ! grep -q "^accel-launch: received SIG$signal; forwarded it to all 2 rank(s) and stopped them\$" "$d/err"; then
    outcome="unreported: $ranks rank(s) ran, but no 'received SIG$signal; forwarded it' line"
    unreported=$((unreported + 1))
  fi
  end_trial "  SIG$signal$([ "$twice" = yes ] && echo " twice") #$i ($what, after $(seconds "$delay") s, $ranks rank process(es) up, $printed line(s) printed): $outcome"
done
summary "SIGTERM/SIGINT to the launcher" "$trials" "$orphans" "$hangs" "$unreported" "$wrong"

# ---- 3. a rank exits 0 early while the other runs on ------------------------------------------------------
orphans=0 hangs=0 unreported=0 wrong=0
for ((i = 0; i < trials; ++i)); do
  tag=$campaign-k3-$i
  d=$(new_trial_dir "k3-$i")
  pick 0 1 && early=$r
  other=$((1 - early))
  random_ms 2000 && early_ms=$r
  EARLY=$early EARLY_MS=$early_ms LIFE=60 start "$tag" "$d" "$dir/rank.sh"
  exec {hold}<> "$d/fifo.$other"  # open here too: writing to it below never blocks
  outcome=ok
  deadline=$(($(now_ms) + 10000))
  until [ -e "$d/exited.$early" ] || [ "$(now_ms)" -ge "$deadline" ]; do sleep 0.02; done
  exit_at=$(now_ms)
  pattern="^accel-launch: rank $early exited with code 0 [1-3] s ago while 1 rank\(s\) still run \($other\); "
  reported_after=
  if [ ! -e "$d/exited.$early" ]; then
    outcome="wrong: rank $early did not start and exit within 10 s"
    wrong=$((wrong + 1))
  else
    deadline=$((exit_at + 3500))
    until grep -qE "$pattern" "$d/err"; do
      if [ "$(now_ms)" -ge "$deadline" ] || exited "$launcher_pid"; then break; fi
      sleep 0.05
    done
    if grep -qE "$pattern" "$d/err"; then
      reported_after=$(seconds $(($(now_ms) - exit_at)))
    else
      outcome="unreported: no 'rank $early exited with code 0 ... s ago' line 3.5 s after it exited"
      unreported=$((unreported + 1))
    fi
  fi
  echo go >&"$hold"  # the other rank exits 0 now; so must the launcher
  exec {hold}>&-
  if ! wait_exit "$launcher_pid" 3000; then
    [ "$outcome" = ok ] && outcome="hang (still running 3 s after the last rank exited)"
    hangs=$((hangs + 1))
    kill_all "$launcher_pid" "$tag"
  elif [ "$rc" != 0 ] && [ "$outcome" = ok ]; then
    outcome="wrong exit code $rc, expected 0"
    wrong=$((wrong + 1))
  fi
  end_trial "  rank $early exits 0 after $(seconds "$early_ms") s #$i: ${reported_after:+reported after $reported_after s, }$outcome"
done
summary "a rank exits 0 early" "$trials" "$orphans" "$hangs" "$unreported" "$wrong"

# ---- 4. a rank killed by a signal --------------------------------------------------------------------------
orphans=0 hangs=0 unreported=0 wrong=0
for ((i = 0; i < trials; ++i)); do
  tag=$campaign-k4-$i
  d=$(new_trial_dir "k4-$i")
  pick 0 1 && victim=$r
  pick KILL:9 SEGV:11 ABRT:6 && signal=${r%:*} number=${r#*:}
  random_ms 3000 && delay=$r
  pick exit ignore && term_mode=$r
  start_trial_ranks
  sleep "$(seconds "$delay")"
  deadline=$(($(now_ms) + 10000))
  pid=$(rank_pid "$tag" "$victim")
  while [ -z "$pid" ] && [ "$(now_ms)" -lt "$deadline" ] && ! exited "$launcher_pid"; do
    sleep 0.02
    pid=$(rank_pid "$tag" "$victim")
  done
  printed=$(printed "$d")
  outcome=ok
  if [ -z "$pid" ] && exited "$launcher_pid"; then
    outcome="wrong: the launcher ended by itself (exit code $rc) before rank $victim was found; the program must run longer"
    wrong=$((wrong + 1))
  elif [ -z "$pid" ]; then
    outcome="wrong: rank $victim did not start within 10 s"
    wrong=$((wrong + 1))
    kill_all "$launcher_pid" "$tag"
  else
    kill -"$signal" "$pid"
    if ! wait_exit "$launcher_pid" 5000; then
      outcome="hang (still running 5 s after rank $victim was killed)"
      hangs=$((hangs + 1))
      kill_all "$launcher_pid" "$tag"
    elif ! grep -qE "^accel-launch: rank $victim \(local rank $victim, pid $pid\) was killed by signal $number \(SIG$signal\)\$" "$d/err"; then
      outcome="unreported: no 'rank $victim (local rank $victim, pid $pid) was killed by signal $number (SIG$signal)' line"
      unreported=$((unreported + 1))
    elif [ "$rc" != $((128 + number)) ]; then
      outcome="wrong exit code $rc, expected $((128 + number))"
      wrong=$((wrong + 1))
    fi
  fi
  end_trial "  rank $victim SIG$signal #$i ($what, after $(seconds "$delay") s, $printed line(s) printed): $outcome"
done
summary "a rank killed by SIGKILL/SIGSEGV/SIGABRT" "$trials" "$orphans" "$hangs" "$unreported" "$wrong"

# ---- 5. bad invocations ------------------------------------------------------------------------------------
d=$(new_trial_dir k5)
mkfifo "$d/no_writer.yaml"
# A listening socket on a free port (another program's server), for the busy-port case.
busy_port=
if command -v perl > /dev/null; then
  exec {listener}< <(exec env ACCEL_CAMPAIGN_TAG="$campaign-listener" perl -MIO::Socket::INET -e '$| = 1; my $s = IO::Socket::INET->new(LocalAddr => "127.0.0.1",
    LocalPort => 0, Listen => 5) or die; print $s->sockport, "\n"; sleep 120' 2> /dev/null)
  listener_pid=$!
  read -r -t 5 -u "$listener" busy_port || busy_port=
fi
cases=(
  "num_processes far above the cores|--num_processes 1000 /bin/true"
  "num_processes 0|--num_processes 0 /bin/true"
  "port out of range|--main_process_port 70000 /bin/true"
  "a program that does not exist|$d/no/such/program"
  "a program that is a directory|$d"
  "a program that is not executable|$d/rank.sh.not-executable"
  "a config file that does not exist|--config_file $d/missing.yaml /bin/true"
  "a config file that is a directory|--config_file $d /bin/true"
  "a config file that is /dev/zero|--config_file /dev/zero /bin/true"
  "a config file that is a FIFO nobody writes to|--config_file $d/no_writer.yaml /bin/true"
)
: > "$d/rank.sh.not-executable"
[ -n "$busy_port" ] && cases+=("a busy port|--main_process_port $busy_port /bin/true")
count=0 orphans=0 hangs=0 unreported=0
for entry in "${cases[@]}"; do
  name=${entry%%|*}
  read -r -a args <<< "${entry#*|}"
  count=$((count + 1))
  started=$(now_ms)
  # The later --num_processes / --main_process_port replace start()'s: CLI11 keeps one value, so start() is
  # not used; the same options are given here once.
  opts=(--cpu --backend ddp)
  [[ " ${args[*]} " == *" --num_processes "* ]] || opts+=(--num_processes 2)
  [[ " ${args[*]} " == *" --main_process_port "* ]] || opts+=(--main_process_port 0)
  timeout -k 2 5 env ACCEL_CAMPAIGN_TAG="$campaign-k5" "$launch" launch "${opts[@]}" "${args[@]}" \
    > "$d/out" 2> "$d/err" < /dev/null
  rc=$?
  took=$(seconds $(($(now_ms) - started)))
  lines=$(wc -l < "$d/err")
  if [ "$rc" = 137 ] || [ "$rc" = 124 ]; then
    outcome="hang (still running after 5 s)"
    hangs=$((hangs + 1))
  elif [ "$rc" = 0 ] || [ "$lines" != 1 ] || ! grep -q '^accel-launch: error: ' "$d/err" || [ -s "$d/out" ]; then
    outcome="unreported: exit code $rc, $lines stderr line(s), $(wc -c < "$d/out") stdout byte(s)"
    unreported=$((unreported + 1))
  else
    outcome="ok, exit code $rc: $(cut -c 1-110 "$d/err")"
  fi
  echo "  $name: $outcome ($took s)"
  [[ $outcome == ok* ]] || show "$d"
  count_left "$campaign-k5" 500
  orphans=$((orphans + left))
done
[ -n "$busy_port" ] || echo "  a busy port: not tried (no perl to listen on a port)"
[ -n "$busy_port" ] && kill "$listener_pid" 2> /dev/null
summary "bad invocations" "$count" "$orphans" "$hangs" "$unreported" 0

for line in "${summaries[@]}"; do echo "$line"; done
echo "launcher campaign: $total_trials trials, $total_orphans orphans, $total_hangs hangs, $total_unreported unreported, $total_wrong wrong"
[ $((total_orphans + total_hangs + total_unreported + total_wrong)) -eq 0 ]
