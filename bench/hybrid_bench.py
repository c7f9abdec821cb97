#!/usr/bin/env python3
"""Hybrid sharding against the layouts it sits between, on 2 machines x 2 ranks (two accel-launch processes on
this machine, tests/launcher/two_machines.sh): step time, per-rank memory, the bytes each rank sends per step by
collective, and the bytes that cross between the machines.

Runs build/bench/bench_zero_memory (the ~21 M-parameter MLP with Adam of zero_bench.py) once per layout.
Bytes crossing machines, per machine and step, from each rank's counted wire bytes (the Communicator's ring
volume): under HYBRID_* only the all-reduces of the shards cross (every one of them); the collectives over
all 4 ranks cross in proportion to the peers on the other machine: the point-to-point reduce-scatter,
all-gather and reduce send 2 of each rank's 3 messages across, Gloo's ring all-reduce (ranks 0-1-2-3) one of
each machine's two ranks' sends. ZeRO-3 with ZeRO++ hpZ (zero_hpz_partition_size 2, the machine): forward
gathers every unit over the 4 ranks, backward from the machine's secondary copy, which crosses nothing; the
forward part of its all-gather bytes is half of plain ZeRO-3's (both gather every unit once per pass).

  python3 bench/hybrid_bench.py [--steps 4] [--build build] [--only ddp,zero3,"zero3 hpZ"]
"""
import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
LAYOUTS = [
    ("ddp", "distributed_type: MULTI_CPU\n"),
    ("fsdp FULL_SHARD", "distributed_type: FSDP\nfsdp_config:\n  fsdp_sharding_strategy: FULL_SHARD\n"),
    ("fsdp HYBRID_SHARD", "distributed_type: FSDP\nfsdp_config:\n  fsdp_sharding_strategy: HYBRID_SHARD\n"),
    ("fsdp SHARD_GRAD_OP", "distributed_type: FSDP\nfsdp_config:\n  fsdp_sharding_strategy: SHARD_GRAD_OP\n"),
    ("fsdp HYBRID_SHARD_ZERO2",
     "distributed_type: FSDP\nfsdp_config:\n  fsdp_sharding_strategy: HYBRID_SHARD_ZERO2\n"),
    ("zero3", "distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stage: 3\n"),
    ("zero3 hpZ",
     "distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stage: 3\n  zero_hpz_partition_size: 2\n"),
]


def run(build, yaml_text, steps):
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write("use_cpu: true\nnum_machines: 2\nnum_processes: 4\n" + yaml_text)
        path = f.name
    try:
        cmd = [str(ROOT / "tests/launcher/two_machines.sh"), str(build / "launcher/accel-launch"),
               "--config_file", path, str(build / "bench/bench_zero_memory"), "--steps", str(steps)]
        env = dict(os.environ, OMP_NUM_THREADS="1", ACCEL_CONFIG_FILE="")
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, env=env)
    finally:
        os.unlink(path)
    if proc.returncode != 0:
        sys.exit(f"hybrid_bench: {' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    out = {}
    for line in proc.stdout.splitlines():
        line = line.split("] ", 1)[-1] if line.startswith("[rank") else line
        if line.startswith("{"):
            out.update(json.loads(line))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--build", default=str(ROOT / "build"))
    ap.add_argument("--only", default="", help="comma-separated layout names (ddp always runs: the baseline)")
    args = ap.parse_args()
    build = pathlib.Path(args.build)
    only = set(args.only.split(",")) if args.only else None
    rows = []
    plain_zero3_gather = None
    for name, text in LAYOUTS:
        if only is not None and name != "ddp" and name not in only:
            continue
        r = run(build, text, args.steps)
        hybrid = "HYBRID" in name
        if hybrid:
            cross = 2 * r["all_reduce_wire"]
        elif name == "zero3 hpZ":
            if plain_zero3_gather is None:
                sys.exit("hybrid_bench: the zero3 hpZ row needs the zero3 row (its forward all-gathers)")
            gather = plain_zero3_gather / 2  # forward only: backward's stay inside the machine
            cross = 2 * (r["reduce_wire"] + gather) * 2 / 3 + r["all_reduce_wire"]
        else:
            cross = 2 * (r["reduce_wire"] + r["all_gather_wire"]) * 2 / 3 + r["all_reduce_wire"]
        if name == "zero3":
            plain_zero3_gather = r["all_gather_wire"]
        rows.append((name, r, cross))
        print(f"{name}: {r}", file=sys.stderr)
    ddp = rows[0][1]
    mib = 1 << 20
    print(f"Model: {ddp['parameters']:,} parameters (fp32, Adam), 2 machines x 2 CPU ranks, per-rank batch 32, "
          f"{args.steps} timed steps. Reproduce: `python3 bench/hybrid_bench.py --steps {args.steps}`\n")
    print("| layout | step time vs DDP | params | grads | optimizer state | all-reduce sent | "
          "reduce-scatter/reduce sent | all-gather sent | across machines per machine | vs DDP |")
    print("|---|---|---|---|---|---:|---:|---:|---:|---:|")
    ddp_cross = rows[0][2]
    for name, r, cross in rows:
        print(f"| {name} | {r['step_ms'] / ddp['step_ms']:.3f} ({r['step_ms']:.0f} ms) | "
              f"{r['param_bytes'] / ddp['param_bytes']:.3f} | {r['grad_bytes'] / ddp['grad_bytes']:.3f} | "
              f"{r['optimizer_bytes'] / ddp['optimizer_bytes']:.3f} | {r['all_reduce_wire'] / mib:.1f} MiB | "
              f"{r['reduce_wire'] / mib:.1f} MiB | {r['all_gather_wire'] / mib:.1f} MiB | "
              f"{cross / mib:.1f} MiB | {cross / ddp_cross:.3f} |")
    one_replica = ddp["parameters"] * 4
    print(f"\nOne replica's gradients, all-reduced between 2 machines (DDP with one process per machine): "
          f"{one_replica / mib:.1f} MiB sent per machine per step.")


if __name__ == "__main__":
    main()
