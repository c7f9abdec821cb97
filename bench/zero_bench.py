#!/usr/bin/env python3
"""Sharded training vs DDP on 2 CPU ranks: step time and per-rank memory of each backend, side by side.

Runs build/bench/bench_zero_memory (a ~21 M-parameter MLP with Adam) under accel-launch once per config
template (DDP, ZeRO stage 1, ZeRO stage 2, FSDP SHARD_GRAD_OP), interleaved over --repeats rounds, and prints
each backend's median step time and measured per-rank bytes relative to DDP, next to what the ZeRO paper's
accounting predicts for fp32 Adam (optimizer state / N; gradients / N from stage 2). With --out it replaces the
"Sharded training" section of BENCHMARKS.md.

    .venv/bin/python bench/zero_bench.py [--steps 6] [--repeats 3] [--out BENCHMARKS.md]
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import statistics
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
CONFIGS = [
    ("ddp", "config_templates/ddp_cpu.yaml"),
    ("zero stage 1", "config_templates/zero_stage1.yaml"),
    ("zero stage 2", "config_templates/zero_stage2.yaml"),
    ("fsdp SHARD_GRAD_OP", "config_templates/fsdp_shard_grad_op.yaml"),
]
START, END = "<!-- zero-bench:start -->", "<!-- zero-bench:end -->"


def run(build: pathlib.Path, config: str, steps: int) -> dict:
    cmd = [str(build / "launcher/accel-launch"), "launch", "--config_file", str(ROOT / config),
           str(build / "bench/bench_zero_memory"), "--steps", str(steps)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        sys.exit(f"zero_bench: {' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    for line in proc.stdout.splitlines():
        if line.startswith("[rank 0] {"):
            return json.loads(line[len("[rank 0] "):])
    sys.exit(f"zero_bench: no result line from {config}:\n{proc.stdout}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--build-dir", default=str(ROOT / "build"))
    parser.add_argument("--out", help="BENCHMARKS.md to update")
    args = parser.parse_args()
    build = pathlib.Path(args.build_dir)

    results: dict[str, list[dict]] = {name: [] for name, _ in CONFIGS}
    for r in range(args.repeats):
        order = CONFIGS if r % 2 == 0 else list(reversed(CONFIGS))
        for name, config in order:
            results[name].append(run(build, config, args.steps))
    ddp = results["ddp"][0]
    ddp_ms = statistics.median(x["step_ms"] for x in results["ddp"])
    n = ddp["world"]
    expected = {
        "ddp": (1, 1, 1),
        "zero stage 1": (1 + 1 / n, 1, 1 / n),
        "zero stage 2": (1 + 1 / n, 1 / n, 1 / n),
        "fsdp SHARD_GRAD_OP": (1 + 1 / n, 1 / n, 1 / n),
    }
    rows = ["| backend | step time vs DDP | params | grads | optimizer state | total | expected (params, grads, opt) |",
            "|---|---|---|---|---|---|---|"]
    for name, _ in CONFIGS:
        x = results[name][0]
        ms = statistics.median(y["step_ms"] for y in results[name])
        e = expected[name]
        rows.append(
            f"| {name} | {ms / ddp_ms:.3f} ({ms:.0f} ms) | {x['param_bytes'] / ddp['param_bytes']:.3f} "
            f"| {x['grad_bytes'] / ddp['grad_bytes']:.3f} | {x['optimizer_bytes'] / ddp['optimizer_bytes']:.3f} "
            f"| {x['total_bytes'] / ddp['total_bytes']:.3f} | {e[0]:.2f}, {e[1]:.2f}, {e[2]:.2f} |")
    table = "\n".join(rows)
    mib = ddp["total_bytes"] / 2**20
    text = (f"{START}\n## Sharded training vs DDP (per rank, {n} CPU ranks)\n\n"
            f"Model: MLP with {ddp['parameters']:,} parameters, Adam, fp32; per-rank bytes measured by "
            f"`Accelerator::memory_report()` after `optimizer.step()` (DDP: {mib:.1f} MiB per rank); median step "
            f"time of {args.repeats} interleaved runs of {args.steps} steps. Ratios are relative to DDP. Stages 1-2 "
            f"keep whole fp32 parameters plus a 1/N fp32 master slice, hence parameters at 1 + 1/N.\n\n"
            f"Reproduce: `.venv/bin/python bench/zero_bench.py --steps {args.steps} --repeats {args.repeats} "
            f"--out BENCHMARKS.md` ({datetime.date.today().isoformat()})\n\n{table}\n{END}\n")
    print(text)
    if args.out:
        path = pathlib.Path(args.out)
        old = path.read_text() if path.exists() else "# Benchmarks\n"
        if START in old and END in old:
            new = old[: old.index(START)] + text.rstrip("\n") + old[old.index(END) + len(END):]
        else:
            new = old.rstrip("\n") + "\n\n" + text
        path.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
