#!/usr/bin/env bash
# ZeRO-Infinity on this machine (issue 28): ZeRO-3 with Adam on 2 CPU ranks, the optimizer state in memory
# and on disk (offload_optimizer_device: nvme), side by side:
#   1. in memory, no cap: step time and peak resident memory per rank;
#   2. a memory cap (a cgroup holding both ranks and the launcher) below what run 1 needs: the nvme run trains
#      under it, and the in-memory run under the same cap is killed;
#   3. the nvme step against the in-memory step plus the disk bound (bytes each step reads and writes over
#      the O_DIRECT bandwidth measured in the nvme directory), and the peak against estimate-memory.
# Needs root for the cgroup (v1 memory controller or v2). Knobs: WIDTH, LAYERS, STEPS, RANKS, NVME_PATH.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${ACCEL_BUILD_DIR:-$root/build}
launch=$build/launcher/accel-launch
bench=$build/bench/bench_nvme_offload
width=${WIDTH:-2048} layers=${LAYERS:-24} steps=${STEPS:-4} ranks=${RANKS:-2}
nvme=${NVME_PATH:-/var/tmp/accel-nvme-bench}
mkdir -p "$nvme"

run() {  # run <cgroup or -> <bench args...>
  local cg=$1
  shift
  # A fixed mmap threshold: glibc otherwise raises it as large blocks are freed and keeps what was freed
  # resident, so the resident size would show the heap's high-water mark instead of what is in use (both runs
  # alike; it costs page faults, so both steps are slower than without it).
  local cmd=(env OMP_NUM_THREADS=1 ACCEL_CONFIG_FILE= MALLOC_MMAP_THRESHOLD_=1048576 "$launch" launch --cpu --num_processes "$ranks"
    --main_process_port 0 "$bench" --width "$width" --layers "$layers" --steps "$steps" "$@")
  if [[ $cg == - ]]; then
    "${cmd[@]}"
  else
    sh -c 'echo $$ > "$0"; exec "$@"' "$cg" "${cmd[@]}"
  fi
}
value() { sed -n "s/.*$1=\([0-9.]*\).*/\1/p" <<<"$2" | head -1; }
max_peak() { sed -n 's/.* peak_rss_over_baseline_bytes=\([0-9]*\).*/\1/p' <<<"$1" | sort -n | tail -1; }
max_setup() { sed -n 's/.*setup_peak_rss_over_baseline_bytes=\([0-9]*\).*/\1/p' <<<"$1" | sort -n | tail -1; }

echo "== 1. optimizer state in memory, no cap"
mem=$(run - 2>&1) || { echo "$mem"; exit 1; }
echo "$mem" | grep -v '^\[rank 1\]'
mem_step=$(value step_seconds "$mem")
mem_peak=$(max_peak "$mem")
baseline=$(value baseline_rss_bytes "$mem")
state=$(value adam_state_bytes_per_rank "$mem")

echo "== 2. optimizer state on disk (NVMe offload), no cap"
nv=$(run - --nvme_path "$nvme" 2>&1) || { echo "$nv"; exit 1; }
echo "$nv" | grep -v '^\[rank 1\]'
nv_peak=$(max_peak "$nv")

echo "== 3. both under one memory cap (a cgroup holding the ranks and the launcher)"
cgroup=""
if [[ -d /sys/fs/cgroup/memory ]] && mkdir -p /sys/fs/cgroup/memory/accel_nvme_bench 2>/dev/null; then
  cgroup=/sys/fs/cgroup/memory/accel_nvme_bench limit=memory.limit_in_bytes peak=memory.max_usage_in_bytes
elif [[ -f /sys/fs/cgroup/cgroup.controllers ]] && mkdir -p /sys/fs/cgroup/accel_nvme_bench 2>/dev/null; then
  cgroup=/sys/fs/cgroup/accel_nvme_bench limit=memory.max peak=memory.peak
  echo 0 >"$cgroup/memory.swap.max" 2>/dev/null || true
else
  echo "no memory cgroup can be made here (needs root): the capped runs are skipped"
fi
if [[ -n $cgroup ]]; then
  procs=$cgroup/cgroup.procs
  # What the cgroup is charged for the NVMe run (its anonymous memory: LibTorch's mapped code is charged
  # where it was first read), then a cap 10% above it.
  echo $((64 << 30)) >"$cgroup/$limit"
  run "$procs" --nvme_path "$nvme" >/dev/null 2>&1 || true
  charged=$(cat "$cgroup/$peak")
  cap=$((charged * 11 / 10))
  echo "$cap" >"$cgroup/$limit"
  [[ -f $cgroup/memory.memsw.limit_in_bytes ]] && echo "$cap" >"$cgroup/memory.memsw.limit_in_bytes" || true
  echo "the NVMe run was charged $((charged >> 20)) MiB at most; cap: $((cap >> 20)) MiB"
  if capped=$(run "$procs" --nvme_path "$nvme" 2>&1); then
    echo "nvme under the cap: trained"
    echo "$capped" | grep -E 'step_seconds|peak_rss' | sed 's/^\[rank 0\] /  /'
  else
    echo "nvme under the cap: FAILED"
    echo "$capped" | tail -5
  fi
  if oom=$(run "$procs" 2>&1); then
    echo "in memory under the cap: trained (the cap is not below its need: raise LAYERS)"
  else
    echo "in memory under the cap: killed, as expected ($(grep -o 'killed by signal [0-9]* ([A-Z]*)' <<<"$oom" | head -1))"
  fi
  rmdir "$cgroup" 2>/dev/null || true
fi

params=$((width * width * layers))
estimate=$("$launch" estimate-memory -p "$params" -n "$ranks" --backend zero --zero_stage 3 \
  --offload_optimizer nvme | sed -n 's/^bytes: //p')
nv_step=$(value step_seconds "$nv")
bound=$(value io_bound_seconds_per_step "$nv")
python3 - "$mem_step" "$nv_step" "$bound" "$mem_peak" "$nv_peak" "$state" "$estimate" <<'EOF'
import sys
mem_step, nv_step, bound, mem_peak, nv_peak, state = map(float, sys.argv[1:7])
est = dict(kv.split("=") for kv in sys.argv[7].split())
est_total = int(est["total"])
print(f"step: in memory {mem_step:.3f} s, nvme {nv_step:.3f} s ({nv_step / mem_step:.2f}x); "
      f"disk bound {bound:.3f} s: nvme / (in-memory step + bound) = {nv_step / (mem_step + bound):.2f} (goal <= 1.2)")
print(f"peak resident over the process baseline, per rank: in memory {mem_peak / 2**20:.0f} MiB, "
      f"nvme {nv_peak / 2**20:.0f} MiB ({nv_peak / mem_peak:.2f}x); Adam state per rank {state / 2**20:.0f} MiB")
print(f"estimate-memory with --offload_optimizer nvme: {est_total / 2**20:.0f} MiB per rank "
      f"(measured / estimate = {nv_peak / est_total:.2f}); on disk {int(est['nvme']) / 2**20:.0f} MiB per rank")
EOF
rm -rf "$nvme"
