#!/usr/bin/env bash
# Checkpoints between hybrid sharding (2 machines x 2 ranks, two launchers on loopback) and the other
# layouts: saved by HYBRID_SHARD, resumed with zero3 on 2 ranks, on 1 process and with HYBRID_SHARD_ZERO2;
# saved by zero2 on 2 ranks, resumed with HYBRID_SHARD. Every phase checks its own results (dist_worker
# reshard_save / reshard_load: bitwise re-save, and the uninterrupted run's end state).
#   hybrid_reshard.sh <accel-launch> <dist_worker>
set -euo pipefail
launch=$1 worker=$2
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
export ACCEL_CONFIG_FILE= OMP_NUM_THREADS=1
two_machines() { "$here/two_machines.sh" "$launch" "$worker" "$@"; }
ranks() { local n=$1; shift; "$launch" launch --cpu --num_processes "$n" --main_process_port 0 "$worker" "$@"; }

dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
export ACCEL_TEST_CKPT_DIR=$dir/from_hybrid
mkdir -p "$ACCEL_TEST_CKPT_DIR"
two_machines reshard_save fsdp_hybrid
ranks 2 reshard_load zero3
ranks 1 reshard_load ddp
two_machines reshard_load fsdp_hybrid_zero2
echo "hybrid_reshard: HYBRID_SHARD's checkpoint resumed with zero3, ddp and HYBRID_SHARD_ZERO2"

export ACCEL_TEST_CKPT_DIR=$dir/to_hybrid
mkdir -p "$ACCEL_TEST_CKPT_DIR"
ranks 2 reshard_save zero2
two_machines reshard_load fsdp_hybrid
echo "hybrid_reshard: zero2's checkpoint resumed with HYBRID_SHARD"
