"""Shared pieces of the Python peers of ``bench/ddp_throughput.cpp``.

Everything here mirrors ``examples/fashion_mnist/fashion_mnist.hpp`` and ``bench/ddp_throughput.cpp`` so that
PyTorch DDP, Hugging Face Accelerate and accelerate-cpp train the same model on the same data with the same
optimizer and the same split of batches between ranks:

* Fashion-MNIST from the Debian package ``dataset-fashion-mnist`` (gzip-compressed IDX files, or
  ``$FASHION_MNIST_DIR``), images normalised as ``(x / 255 - 0.2860) / 0.3530``;
* the CNN conv(1->32, k3) relu maxpool2, conv(32->64, k3) relu maxpool2, flatten, fc(1600->128) relu,
  fc(128->10); cross-entropy loss; SGD lr 0.01 momentum 0.9; ``torch.manual_seed(0)``;
* sequential order, per-rank batch ``B``; rank ``r`` of ``N`` takes global batches ``r, r+N, r+2N, ...``;
* ``steps + warmup`` batches per rank; timing starts after the ``warmup``-th step (after a barrier) and ends
  after a final barrier;
* rank 0 prints one JSON line with the same keys, order and number formats as the C++ benchmark.
"""

import argparse
import gzip
import json
import os
import struct
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

DEFAULT_DATA_DIR = "/usr/share/datasets/fashion-mnist"
MEAN, STD = 0.2860, 0.3530


def parse_args(description: str) -> argparse.Namespace:
    """Parse the command line shared with ``bench_ddp_throughput``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--steps", type=int, default=60, help="timed steps (default 60)")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps before timing (default 10)")
    parser.add_argument("--batch-size", type=int, default=64, help="batch size per rank (default 64)")
    parser.add_argument(
        "--expect-world",
        type=int,
        default=0,
        help="fail unless the job has exactly this many ranks (0: do not check)",
    )
    parser.add_argument(
        "--no-byte-count",
        action="store_true",
        help="do not register the byte-counting DDP communication hook (wire_bytes_per_step is then 0)",
    )
    args = parser.parse_args()
    if args.steps < 1 or args.warmup < 1 or args.batch_size < 1:
        parser.error("--steps, --warmup and --batch-size must be >= 1")
    return args


def set_threads_from_env() -> int:
    """Set torch's intra-op thread count from ``OMP_NUM_THREADS`` (as LibTorch does) and return it."""
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads:
        torch.set_num_threads(int(threads))
    return torch.get_num_threads()


def _read_idx(path: str, magic: int, header: int) -> tuple[np.ndarray, int]:
    try:
        with gzip.open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError as e:
        raise SystemExit(
            f"cannot open {path}: install the Debian package dataset-fashion-mnist or set FASHION_MNIST_DIR"
        ) from e
    got_magic, count = struct.unpack(">II", raw[:8])
    if got_magic != magic:
        raise SystemExit(f"bad IDX magic in {path}: {got_magic}, expected {magic}")
    return np.frombuffer(raw, dtype=np.uint8, offset=header), count


def load_train(limit: int = 0, data_dir: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Load the first ``limit`` (0: all 60000) training samples.

    Returns images [n, 1, 28, 28] float32, normalised, and labels [n] int64.
    """
    data_dir = data_dir or os.environ.get("FASHION_MNIST_DIR", DEFAULT_DATA_DIR)
    images, n = _read_idx(os.path.join(data_dir, "train-images-idx3-ubyte.gz"), 2051, 16)
    labels, n_labels = _read_idx(os.path.join(data_dir, "train-labels-idx1-ubyte.gz"), 2049, 8)
    if n != n_labels:
        raise SystemExit(f"{data_dir}: {n} images but {n_labels} labels")
    if 0 < limit < n:
        n = limit
    x = torch.from_numpy(images[: n * 28 * 28].copy()).view(n, 1, 28, 28)
    x = x.to(torch.float32).div_(255.0).sub_(MEAN).div_(STD)
    y = torch.from_numpy(labels[:n].copy()).to(torch.int64)
    return x, y


def samples_needed(steps: int, warmup: int, batch_size: int, world: int) -> int:
    """Samples the whole job reads: ``steps + warmup`` batches per rank (as in the C++ benchmark)."""
    return (steps + warmup) * batch_size * world


def rank_batches(
    x: torch.Tensor, y: torch.Tensor, batch_size: int, rank: int, world: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Rank ``rank``'s batches: global batches ``rank, rank + world, ...`` of the sequential order.

    The batches are views (slices) of ``x`` and ``y``; no copy is made.
    """
    n_global = x.shape[0] // batch_size
    return [
        (x[g * batch_size : (g + 1) * batch_size], y[g * batch_size : (g + 1) * batch_size])
        for g in range(rank, n_global, world)
    ]


class Net(nn.Module):
    """The Fashion-MNIST CNN of ``examples/fashion_mnist/fashion_mnist.hpp``."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3)
        self.conv2 = nn.Conv2d(32, 64, 3)
        self.fc1 = nn.Linear(64 * 5 * 5, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.fc1(x.flatten(1)))
        return self.fc2(x)


def make_model_and_optimizer() -> tuple[Net, torch.optim.SGD]:
    """Seeded model and its SGD(lr 0.01, momentum 0.9) optimizer."""
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    return model, optimizer


def param_bytes(model: nn.Module) -> int:
    """Bytes of all trainable parameters (what one DDP step all-reduces)."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def ring_all_reduce_bytes(payload: int, world: int) -> float:
    """Bytes one rank sends in a bandwidth-optimal (ring) all-reduce of ``payload`` bytes: 2(N-1)/N x payload.

    Same definition as ``ByteCount::wire`` in ``accelerate_cpp/include/accel/communicator.hpp``.
    """
    return 2.0 * payload * (world - 1) / world


class AllReduceByteCounter:
    """DDP communication hook that runs PyTorch's stock ``allreduce_hook`` and counts the bytes it reduces.

    Register with ``ddp_model.register_comm_hook(counter, AllReduceByteCounter.hook)`` before the first
    backward. ``payload`` is the sum of the gradient buckets handed to all-reduce on this rank.
    """

    def __init__(self, process_group: dist.ProcessGroup | None = None) -> None:
        self.process_group = process_group
        self.payload = 0
        self.calls = 0

    @staticmethod
    def hook(state: "AllReduceByteCounter", bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """Count ``bucket`` and all-reduce it exactly as DDP's default hook does."""
        buffer = bucket.buffer()
        state.payload += buffer.numel() * buffer.element_size()
        state.calls += 1
        return default_hooks.allreduce_hook(state.process_group, bucket)


def now_unix_ms() -> float:
    """Wall-clock time in milliseconds since the Unix epoch."""
    return time.time() * 1e3


@dataclass
class Timing:
    """What the training loop measured on one rank."""

    first_step_unix_ms: float
    seconds: float
    timed_steps: int
    payload_bytes: int


def result_line(
    impl: str,
    world: int,
    threads: int,
    batch_size: int,
    timing: Timing,
    params: int,
) -> str:
    """The JSON line printed by rank 0, with the keys and number formats of ``bench_ddp_throughput``."""
    steps = timing.timed_steps
    record = {
        "impl": impl,
        "world": world,
        "threads": threads,
        "batch_per_rank": batch_size,
        "steps": steps,
        "samples_per_s": round(steps * batch_size * world / timing.seconds, 1),
        "step_ms": round(timing.seconds / steps * 1e3, 3),
        "wire_bytes_per_step": round(ring_all_reduce_bytes(timing.payload_bytes, world) / steps, 1),
        "theory_bytes_per_step": round(ring_all_reduce_bytes(params, world), 1),
        "first_step_unix_ms": round(timing.first_step_unix_ms, 1),
    }
    return json.dumps(record)
