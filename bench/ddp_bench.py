#!/usr/bin/env python3
"""Peer benchmark: accelerate-cpp DDP vs PyTorch DDP vs Hugging Face Accelerate, side by side.

All three train the Fashion-MNIST CNN of ``examples/fashion_mnist`` with the same per-rank batch, the same
number of warm-up and timed steps, the same optimizer, the same split of batches between ranks and the same
number of intra-op threads per rank (``OMP_NUM_THREADS`` = cores / ranks, set explicitly for every run):

* ``accelerate-cpp``: ``accel-launch launch`` + ``build/bench/bench_ddp_throughput`` on 1 and 2 ranks;
* ``pytorch-ddp``: ``python -m torch.distributed.run`` (torchrun) + ``bench/peers/torch_ddp.py`` on 2 ranks;
* ``hf-accelerate``: ``accelerate launch`` + ``bench/peers/hf_accelerate.py`` on 2 ranks.

Each configuration runs ``--repeats`` times, interleaved (one run of every configuration per round, the order
rotated each round); the table reports medians. "Launch to first step" is the ``first_step_unix_ms`` a run
reports minus the wall-clock time the driver read just before starting the launcher. After its timed steps,
every multi-rank accelerate-cpp run also measures how much of DDP's all-reduce is hidden behind backward
(``--overlap-steps``, see ``bench/ddp_throughput.cpp``). The results go to stdout and replace the section
between ``<!-- ddp-bench:start -->`` and ``<!-- ddp-bench:end -->`` of ``BENCHMARKS.md`` (``--out``; a new
file is created with just that section). Any failed run stops the driver with a non-zero exit status; no
number is ever filled in.

Usage (from the repository root)::

    python3 bench/ddp_bench.py [--steps 60] [--warmup 10] [--batch-size 64] [--repeats 3]
                               [--wait-idle 15] [--overlap-steps 20] [--build-dir build]
                               [--out BENCHMARKS.md] [--python .venv/bin/python]

The driver uses only the standard library; the peers run with the project venv's Python (``--python``).
"""

import argparse
import datetime as dt
import json
import os
import platform
import resource
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PEERS = REPO / "bench" / "peers"
RUN_TIMEOUT_S = 900
CONTENTION_CORES = 0.25  # other processes' average CPU use during a run above which the report warns
SECTION_START, SECTION_END = "<!-- ddp-bench:start -->", "<!-- ddp-bench:end -->"


class BenchError(RuntimeError):
    """A run failed or produced output the driver cannot trust."""


@dataclass(frozen=True)
class Config:
    """One benchmarked configuration: an implementation, its launcher and a number of ranks."""

    impl: str
    launcher: str
    world: int

    @property
    def label(self) -> str:
        """Short human-readable name, e.g. ``accelerate-cpp x2``."""
        return f"{self.impl} x{self.world}"


CONFIGS = (
    Config("accelerate-cpp", "accel-launch", 1),
    Config("accelerate-cpp", "accel-launch", 2),
    Config("pytorch-ddp", "torchrun", 2),
    Config("hf-accelerate", "accelerate launch", 2),
)


@dataclass
class Runs:
    """The JSON records and launch times of every repeat of one configuration."""

    config: Config
    records: list[dict] = field(default_factory=list)
    launch_ms: list[float] = field(default_factory=list)
    other_load: list[float] = field(default_factory=list)

    def median(self, key: str) -> float:
        """Median of ``key`` over the repeats."""
        return statistics.median(float(r[key]) for r in self.records)

    @property
    def samples_per_s(self) -> float:
        """Median throughput (samples per second, all ranks together)."""
        return self.median("samples_per_s")

    @property
    def quiet_samples_per_s(self) -> float | None:
        """Median throughput over the runs during which the rest of the machine was idle, if any."""
        quiet = [
            float(rec["samples_per_s"])
            for rec, load in zip(self.records, self.other_load, strict=True)
            if load < CONTENTION_CORES
        ]
        return statistics.median(quiet) if quiet else None

    @property
    def launch_median_ms(self) -> float:
        """Median launch-to-first-step time in milliseconds."""
        return statistics.median(self.launch_ms)


def parse_args() -> argparse.Namespace:
    """Command line of the driver."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60, help="timed steps per run (default 60)")
    p.add_argument("--warmup", type=int, default=10, help="untimed steps before timing (default 10, >= 1)")
    p.add_argument("--batch-size", type=int, default=64, help="batch size per rank (default 64)")
    p.add_argument("--repeats", type=int, default=3, help="runs per configuration, interleaved (default 3)")
    p.add_argument(
        "--overlap-steps",
        type=int,
        default=20,
        help="measurements of the all-reduce / backward overlap after each multi-rank accelerate-cpp run "
        "(default 20)",
    )
    p.add_argument(
        "--build-dir", type=Path, default=REPO / "build", help="CMake build directory (default build)"
    )
    p.add_argument(
        "--out", type=Path, default=REPO / "BENCHMARKS.md", help="report file (default BENCHMARKS.md)"
    )
    p.add_argument(
        "--wait-idle",
        type=float,
        default=15.0,
        help="before each run, wait up to this many seconds for other processes to leave the CPU idle "
        "(default 15; 0 disables)",
    )
    p.add_argument(
        "--python",
        type=Path,
        default=REPO / ".venv" / "bin" / "python",
        help="Python with torch and accelerate for the peers (default .venv/bin/python)",
    )
    args = p.parse_args()
    if min(args.steps, args.warmup, args.batch_size, args.repeats, args.overlap_steps) < 1:
        p.error("--steps, --warmup, --batch-size, --repeats and --overlap-steps must be >= 1")
    return args


def free_port() -> int:
    """A TCP port that was free a moment ago (for the Python launchers' rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def require_file(path: Path, hint: str) -> Path:
    """``path`` if it exists, else stop with ``hint``."""
    if not path.exists():
        raise BenchError(f"{path} not found: {hint}")
    return path


def command(cfg: Config, args: argparse.Namespace, accelerate_bin: Path) -> list[str]:
    """The command line that launches ``cfg``."""
    bench_args = [
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--batch-size",
        str(args.batch_size),
    ]
    n = str(cfg.world)
    if cfg.impl == "accelerate-cpp":
        return [
            str(args.build_dir / "launcher" / "accel-launch"), "launch", "--cpu",
            "--num_processes", n, "--main_process_port", "0", "--mixed_precision", "no",
            "--backend", "ddp" if cfg.world > 1 else "local",
            str(args.build_dir / "bench" / "bench_ddp_throughput"), *bench_args,
            *(["--overlap-steps", str(args.overlap_steps)] if cfg.world > 1 else []),
        ]  # fmt: skip
    peer_args = [*bench_args, "--expect-world", n]
    if cfg.impl == "pytorch-ddp":
        return [
            str(args.python), "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", n,
            "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
            str(PEERS / "torch_ddp.py"), *peer_args,
        ]  # fmt: skip
    if cfg.impl == "hf-accelerate":
        # `accelerate launch --cpu --num_processes N` starts ONE process (its multi-CPU path expects mpirun,
        # via --mpirun_hostfile); --multi_gpu only selects Accelerate's torchrun-based launcher, and
        # Accelerator(cpu=True) in the script then gives DistributedType.MULTI_CPU with gloo.
        return [
            str(accelerate_bin), "launch", "--multi_gpu", "--num_processes", n, "--num_machines", "1",
            "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(free_port()),
            str(PEERS / "hf_accelerate.py"), *peer_args,
        ]  # fmt: skip
    raise BenchError(f"unknown implementation {cfg.impl}")


def parse_record(output: str, cfg: Config) -> dict:
    """The single JSON result line in ``output``, checked against ``cfg``.

    A ``[rank 0] `` prefix (accel-launch) before the JSON is allowed.
    """
    records = []
    for line in output.splitlines():
        at = line.find('{"impl"')
        if at >= 0:
            try:
                records.append(json.loads(line[at:]))
            except json.JSONDecodeError as e:
                raise BenchError(f"{cfg.label}: unparsable result line {line!r}: {e}") from e
    if len(records) != 1:
        raise BenchError(f"{cfg.label}: expected one JSON result line, found {len(records)}")
    rec = records[0]
    if rec.get("impl") != cfg.impl or rec.get("world") != cfg.world:
        raise BenchError(f"{cfg.label}: result is for {rec.get('impl')} x{rec.get('world')}")
    return rec


def cpu_busy_seconds() -> float:
    """CPU seconds all processes of the machine have spent busy since boot (from ``/proc/stat``)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    # user nice system idle iowait irq softirq steal ...; guest time is already part of user.
    busy = fields[0] + fields[1] + fields[2] + sum(fields[5:8])
    return busy / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds() -> float:
    """CPU seconds used by this driver and its waited-for descendants (launchers and ranks)."""
    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        total += usage.ru_utime + usage.ru_stime
    return total


def wait_for_idle(max_wait_s: float) -> float:
    """Wait, at most ``max_wait_s``, until other processes use < ``CONTENTION_CORES`` cores over 1 s.

    Returns the seconds waited. Running anyway after the limit is fine: the run's own contention figure
    records what happened.
    """
    start = time.monotonic()
    while time.monotonic() - start < max_wait_s:
        busy0, own0, wall0 = cpu_busy_seconds(), own_cpu_seconds(), time.monotonic()
        time.sleep(1.0)
        load = (cpu_busy_seconds() - busy0 - (own_cpu_seconds() - own0)) / (time.monotonic() - wall0)
        if load < CONTENTION_CORES:
            break
    return time.monotonic() - start


def run_once(
    cfg: Config, args: argparse.Namespace, accelerate_bin: Path, env: dict[str, str]
) -> tuple[dict, float, float]:
    """Run ``cfg`` once.

    Returns its JSON record, its launch-to-first-step time in milliseconds and the CPU load, in cores, that
    processes other than this benchmark put on the machine during the run.
    """
    cmd = command(cfg, args, accelerate_bin)
    busy0, own0, wall0 = cpu_busy_seconds(), own_cpu_seconds(), time.monotonic()
    t0_ms = time.time() * 1e3
    try:
        proc = subprocess.run(
            cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            timeout=RUN_TIMEOUT_S, check=False,
        )  # fmt: skip
    except subprocess.TimeoutExpired as e:
        raise BenchError(f"{cfg.label}: no result after {RUN_TIMEOUT_S} s: {shlex.join(cmd)}") from e
    other_load = max(
        0.0, (cpu_busy_seconds() - busy0 - (own_cpu_seconds() - own0)) / (time.monotonic() - wall0)
    )
    if proc.returncode != 0:
        tail = "\n".join(proc.stdout.splitlines()[-30:])
        raise BenchError(f"{cfg.label} failed (exit {proc.returncode}): {shlex.join(cmd)}\n{tail}")
    rec = parse_record(proc.stdout, cfg)
    expected = {
        "steps": args.steps,
        "batch_per_rank": args.batch_size,
        "threads": int(env["OMP_NUM_THREADS"]),
    }
    for key, want in expected.items():
        if rec.get(key) != want:
            raise BenchError(f"{cfg.label}: reported {key}={rec.get(key)}, expected {want}")
    if cfg.impl == "accelerate-cpp" and cfg.world > 1 and not isinstance(rec.get("overlap"), dict):
        raise BenchError(f"{cfg.label}: no overlap measurement in the result line")
    launch_ms = float(rec["first_step_unix_ms"]) - t0_ms
    if not 0 < launch_ms < RUN_TIMEOUT_S * 1e3:
        raise BenchError(f"{cfg.label}: implausible launch-to-first-step time {launch_ms:.1f} ms")
    return rec, launch_ms, other_load


def capture(cmd: list[str]) -> str:
    """Stripped stdout of ``cmd``, or ``"?"`` if it cannot be run."""
    try:
        return subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=REPO).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"


def machine_info(python: Path) -> dict[str, str]:
    """Facts about this machine and software that the figures depend on."""
    cpu = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    versions = capture(
        [str(python), "-c", "import sys, torch, accelerate; "
         "print(sys.version.split()[0], torch.__version__, accelerate.__version__)"]
    ).split()  # fmt: skip
    if len(versions) != 3:
        raise BenchError(
            f"{python} cannot import torch and accelerate (pip install accelerate into the venv)"
        )
    commit = capture(["git", "rev-parse", "--short", "HEAD"])
    if capture(["git", "status", "--porcelain", "--untracked-files=no"]) not in ("", "?"):
        commit += " (with uncommitted changes)"
    return {
        "cores (nproc)": str(os.cpu_count()),
        "CPU": cpu,
        "OS": f"{platform.system()} {platform.release()}",
        "Python (peers)": versions[0],
        "torch": versions[1],
        "accelerate": versions[2],
        "accelerate-cpp commit": commit,
    }


def fmt_ratio(value: float, goal: str, met: bool | None) -> str:
    """``1.23x`` plus the goal and whether it is met."""
    if met is None:
        return f"{value:.2f}x"
    return f"{value:.2f}x (goal {goal}: {'met' if met else 'NOT met'})"


def overlap_line(r: Runs) -> str:
    """The all-reduce / backward overlap of a multi-rank accelerate-cpp configuration (medians over runs)."""

    def med(key: str) -> float:
        return statistics.median(float(rec["overlap"][key]) for rec in r.records)

    hidden = med("hidden_fraction")
    per_run = ", ".join(f"{float(rec['overlap']['hidden_fraction']):.0%}" for rec in r.records)
    return (
        f"- All-reduce time hidden behind backward, accelerate-cpp ({r.config.world} ranks): {hidden:.0%} "
        f"(goal >= 80%: {'met' if hidden >= 0.8 else 'NOT met'}; runs {per_run}); forward + backward "
        f"without communication {med('backward_ms'):.2f} ms, all-reduce of the same buckets alone "
        f"{med('allreduce_ms'):.2f} ms, forward + synced backward {med('backward_synced_ms'):.2f} ms "
        f"(medians over runs of each run's median of {r.records[0]['overlap']['repeats']})"
    )


def summary(results: list[Runs]) -> tuple[str, str]:
    """The Markdown results table and the list of ratios."""
    by = {(r.config.impl, r.config.world): r for r in results}
    ours1, ours2 = by[("accelerate-cpp", 1)], by[("accelerate-cpp", 2)]
    ddp2, hf2 = by[("pytorch-ddp", 2)], by[("hf-accelerate", 2)]
    all_quiet = all(r.quiet_samples_per_s is not None for r in results)

    def tput(r: Runs) -> float:
        # Compare like with like: idle-machine runs when every configuration has one, else all runs.
        quiet = r.quiet_samples_per_s
        return quiet if all_quiet and quiet is not None else r.samples_per_s

    basis = (
        f"medians of the runs with other CPU load < {CONTENTION_CORES} cores"
        if all_quiet
        else "medians of all runs; NOT every configuration had a run on an idle machine"
    )

    lines = [
        "| implementation | launcher | ranks | threads/rank | samples/s (median) | samples/s (all runs) "
        "| samples/s (median, idle-machine runs) "
        "| step ms | launch to first step, ms (median) | wire bytes/step | theory bytes/step "
        "| other CPU load, cores (max) |",
        "|---|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        rec = r.records[-1]
        runs = ", ".join(f"{float(x['samples_per_s']):.0f}" for x in r.records)
        lines.append(
            f"| {r.config.impl} | `{r.config.launcher}` | {r.config.world} | {rec['threads']} "
            f"| {r.samples_per_s:.0f} | {runs} "
            f"| {'-' if r.quiet_samples_per_s is None else f'{r.quiet_samples_per_s:.0f}'} "
            f"| {r.median('step_ms'):.2f} | {r.launch_median_ms:.0f} "
            f"| {r.median('wire_bytes_per_step'):.0f} | {r.median('theory_bytes_per_step'):.0f} "
            f"| {max(r.other_load):.2f} |"
        )
    table = "\n".join(lines)

    def wire_ratio(r: Runs) -> str:
        theory = r.median("theory_bytes_per_step")
        return f"{r.median('wire_bytes_per_step') / theory:.3f}" if theory else "n/a"

    ratios = [
        f"Throughput ratios use {basis}.",
        "",
        "- Throughput, accelerate-cpp / PyTorch DDP (2 ranks): "
        + fmt_ratio(tput(ours2) / tput(ddp2), ">= 1.10", tput(ours2) >= 1.10 * tput(ddp2)),
        "- Throughput, accelerate-cpp / HF Accelerate (2 ranks): "
        + fmt_ratio(tput(ours2) / tput(hf2), ">= 1.30", tput(ours2) >= 1.30 * tput(hf2)),
        overlap_line(ours2),
        "- Launch to first step, `accelerate launch` / `accel-launch` (2 ranks): "
        + fmt_ratio(
            hf2.launch_median_ms / ours2.launch_median_ms,
            ">= 3",
            hf2.launch_median_ms >= 3 * ours2.launch_median_ms,
        ),
        "- Launch to first step, torchrun / `accel-launch` (2 ranks): "
        + fmt_ratio(ddp2.launch_median_ms / ours2.launch_median_ms, "", None),
        "- Scaling, accelerate-cpp 2 ranks / 1 rank (samples/s): "
        + fmt_ratio(tput(ours2) / tput(ours1), "", None),
        "- Wire bytes per step / theoretical ring all-reduce volume 2(N-1)/N x parameter bytes (2 ranks): "
        f"accelerate-cpp {wire_ratio(ours2)}, PyTorch DDP {wire_ratio(ddp2)}, "
        f"HF Accelerate {wire_ratio(hf2)}",
    ]

    worst = max(max(r.other_load) for r in results)
    if worst > CONTENTION_CORES:
        ratios.append(
            f"- WARNING: other processes used up to {worst:.2f} cores during some runs (last column), so "
            "those runs competed for the CPU; rerun on a quiet machine before drawing conclusions."
        )
    return table, "\n".join(ratios)


def report(results: list[Runs], args: argparse.Namespace, info: dict[str, str], load: tuple[str, str]) -> str:
    """Markdown report: intro, command, machine, table, ratios, notes."""
    table, ratios = summary(results)
    two = next(r for r in results if r.config.world == 2)
    param_bytes = two.median("theory_bytes_per_step") * two.config.world / (2 * (two.config.world - 1))

    cmd = "python3 bench/ddp_bench.py " + shlex.join(
        ["--steps", str(args.steps), "--warmup", str(args.warmup), "--batch-size", str(args.batch_size),
         "--repeats", str(args.repeats), "--wait-idle", f"{args.wait_idle:g}",
         "--overlap-steps", str(args.overlap_steps)]
    )  # fmt: skip
    machine = "\n".join(f"- {k}: {v}" for k, v in info.items())
    launches = "\n".join(
        f"- {r.config.label}: `{shlex.join(command(r.config, args, Path('.venv/bin/accelerate')))}`"
        .replace(str(REPO) + "/", "")
        for r in results
    )  # fmt: skip
    date = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return f"""{SECTION_START}
<!-- Generated by bench/ddp_bench.py; rerun it rather than editing by hand. -->

## DDP throughput and launch time: accelerate-cpp vs PyTorch DDP vs Hugging Face Accelerate

The same training job three ways: the Fashion-MNIST CNN of `examples/fashion_mnist` (conv 1->32, conv
32->64, fc 1600->128, fc 128->10; {param_bytes:,.0f} bytes of fp32 parameters), SGD (lr 0.01, momentum 0.9),
cross-entropy, per-rank batch {args.batch_size}, sequential data where rank r takes global batches
r, r+N, ...; {args.warmup} warm-up steps, then {args.steps} timed steps between two barriers. All runs are on
CPU with gloo, with `OMP_NUM_THREADS` = cores / ranks set explicitly for every run. Each configuration ran
{args.repeats} time(s), interleaved (order rotated each round); the table shows medians.

Reproduce (from the repository root, after `scripts/setup.sh` and `.venv/bin/pip install accelerate`):

```bash
{cmd}
```

Run on {date}.

Machine:

{machine}
- load average (1/5/15 min) before / after the benchmark: {load[0]} / {load[1]}

{table}

{ratios}

Definitions and notes:

- samples/s counts all ranks: timed steps x batch per rank x ranks / seconds between the barrier after the
  last warm-up step and the barrier after the last step.
- Launch to first step: wall clock when rank 0 finished its first optimizer step minus wall clock just before
  the driver started the launcher. It includes the launcher itself (`accelerate launch` and torchrun are
  Python programs that import torch before spawning the ranks), process start-up (for the Python ranks:
  interpreter, `import torch`, `import accelerate`), data loading, model set-up, rendezvous and one step.
- Wire bytes: bytes each rank hands to all-reduce during the timed steps, converted to the bytes a ring
  all-reduce sends (2(N-1)/N x payload), divided by the steps. accelerate-cpp counts inside its Communicator;
  the Python peers count with a DDP communication hook that wraps PyTorch's stock `allreduce_hook`
  (the same all-reduce DDP does by default, plus a Python call per gradient bucket; the peers'
  `--no-byte-count` turns it off, and in trials the difference was within run-to-run noise). Gloo's actual
  algorithm may move a different number of bytes; this is the standard volume benchmarks compare against.
- Data: accelerate-cpp and HF Accelerate use their own data loaders (per-sample collation into a batch);
  the PyTorch DDP peer slices pre-built tensors, which costs slightly less per step.
- HF Accelerate: `accelerate launch --cpu --num_processes 2` starts a single process (world size 1) because
  Accelerate's multi-CPU launch path goes through MPI (`--mpirun_hostfile` / `mpirun`); the peer would detect
  this and fail. The benchmark therefore uses Accelerate's torchrun-based launcher (`--multi_gpu`, which needs
  no GPU) and `Accelerator(cpu=True)` in the script, which Accelerate maps to `DistributedType.MULTI_CPU` with
  the gloo backend (the PyTorch wheel has no MPI backend); the script checks both. `HF_HOME` points to an
  empty temporary directory so that no `accelerate config` default file changes the run.
- Other CPU load: CPU time the whole machine spent busy during a run (`/proc/stat`) minus the CPU time of
  the driver and everything it launched, divided by the run's wall time. On a small machine, ranks that use
  every core are slowed down by anything else that runs; intra-op thread pools (2 threads on 2 cores, the
  1-rank configuration) can stall badly when one of their cores is taken. Before each run the driver waits
  (up to `--wait-idle` seconds) for the rest of the machine to go idle, then runs anyway.

- Overlap: after its timed steps, each multi-rank accelerate-cpp run times, {args.overlap_steps} times on its
  last batch and in rotated order, each after a barrier and as the slowest rank's time: forward + backward
  under `no_sync` (no communication), the all-reduce of buffers the sizes of DDP's buckets (same plan) with
  no backward, and forward + synced backward (bucket all-reduces launched from the gradient hooks, then
  waited for). Hidden = 1 - (synced - without communication) / all-reduce alone, clamped to [0, 1]; copies
  into and out of the buckets and waiting for a slower rank count as exposed communication.

Exact launch commands (ports vary per run):

{launches}
{SECTION_END}
"""


def write_report(path: Path, section: str) -> None:
    """Replace the benchmark's section of ``path`` (between the markers), or create the file with it."""
    if not path.exists():
        path.write_text(f"# Benchmarks\n\n{section}")
        return
    text = path.read_text()
    start, end = text.find(SECTION_START), text.find(SECTION_END)
    if start < 0 or end < start:
        raise BenchError(f"{path} has no {SECTION_START} ... {SECTION_END} section to replace")
    path.write_text(text[:start] + section + text[end + len(SECTION_END) + 1 :])


def main() -> int:
    """Run every configuration ``--repeats`` times, print the results and write the report."""
    args = parse_args()
    args.build_dir = args.build_dir.resolve()
    try:
        require_file(
            args.build_dir / "launcher" / "accel-launch", "build the project first (scripts/setup.sh)"
        )
        require_file(
            args.build_dir / "bench" / "bench_ddp_throughput", "build the target bench_ddp_throughput"
        )
        require_file(args.python, "create the project venv (scripts/setup.sh) or pass --python")
        accelerate_bin = require_file(
            args.python.parent / "accelerate", "pip install accelerate into the venv"
        )
        info = machine_info(args.python)
        cores = os.cpu_count() or 1
        load_before = " ".join(f"{x:.2f}" for x in os.getloadavg())
        print(
            f"{cores} cores, {info['CPU']}, torch {info['torch']}, accelerate {info['accelerate']}",
            flush=True,
        )

        results = [Runs(cfg) for cfg in CONFIGS]
        with tempfile.TemporaryDirectory(prefix="ddp_bench_hf_home_") as hf_home:
            for rep in range(args.repeats):
                shift = rep % len(results)
                for runs in results[shift:] + results[:shift]:
                    cfg = runs.config
                    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, cores // cfg.world)))
                    if args.wait_idle > 0:
                        waited = wait_for_idle(args.wait_idle)
                        if waited > 2:
                            print(f"        waited {waited:.0f} s for the CPU to become idle", flush=True)
                    if cfg.impl == "hf-accelerate":
                        env["HF_HOME"] = hf_home
                    rec, launch_ms, other_load = run_once(cfg, args, accelerate_bin, env)
                    runs.records.append(rec)
                    runs.launch_ms.append(launch_ms)
                    runs.other_load.append(other_load)
                    print(
                        f"[{rep + 1}/{args.repeats}] {cfg.label:<18} {rec['samples_per_s']:>9.1f} samples/s "
                        f"{rec['step_ms']:>8.2f} ms/step  launch to first step {launch_ms:>7.0f} ms  "
                        f"other load {other_load:.2f} cores",
                        flush=True,
                    )
        load_after = " ".join(f"{x:.2f}" for x in os.getloadavg())
    except BenchError as e:
        print(f"ddp_bench: error: {e}", file=sys.stderr)
        return 1

    table, ratios = summary(results)
    print(f"\n{table}\n\n{ratios}")
    try:
        write_report(args.out, report(results, args, info, (load_before, load_after)))
    except BenchError as e:
        print(f"ddp_bench: error: {e}", file=sys.stderr)
        return 1
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
