r"""PyTorch DDP (gloo, CPU) peer of ``bench/ddp_throughput.cpp``: same model, data, optimizer and sharding.

Launch with torchrun from the project venv, e.g.::

    OMP_NUM_THREADS=1 .venv/bin/python -m torch.distributed.run --nproc_per_node 2 --master_port 29500 \
        bench/peers/torch_ddp.py --steps 60 --warmup 10 --batch-size 64

Rank 0 prints one JSON line (``impl`` ``"pytorch-ddp"``) in the format of ``bench_ddp_throughput``.
"""

from __future__ import annotations

import os
import sys
import time

import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fashion_common as fc  # noqa: E402


def main() -> None:
    """Train for ``warmup + steps`` steps under DDP and print the result line on rank 0."""
    args = fc.parse_args(__doc__.splitlines()[0])
    threads = fc.set_threads_from_env()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.expect_world and world != args.expect_world:
        raise SystemExit(f"torch_ddp.py: world size is {world}, expected {args.expect_world}")

    model, optimizer = fc.make_model_and_optimizer()
    ddp = DistributedDataParallel(model)
    counter = fc.AllReduceByteCounter()
    if not args.no_byte_count:
        ddp.register_comm_hook(counter, fc.AllReduceByteCounter.hook)

    n = fc.samples_needed(args.steps, args.warmup, args.batch_size, world)
    x, y = fc.load_train(n)
    if x.shape[0] < n:
        raise SystemExit(f"torch_ddp.py: need {n} samples, the training set has {x.shape[0]}")
    batches = fc.rank_batches(x, y, args.batch_size, rank, world)

    first_step_unix_ms = 0.0
    start = 0.0
    payload_start = 0
    step = 0
    for data, target in batches:
        optimizer.zero_grad()
        loss = F.cross_entropy(ddp(data), target)
        loss.backward()
        optimizer.step()
        step += 1
        if step == 1:
            first_step_unix_ms = fc.now_unix_ms()
        if step == args.warmup:
            dist.barrier()
            start = time.perf_counter()
            payload_start = counter.payload
    dist.barrier()
    timing = fc.Timing(
        first_step_unix_ms=first_step_unix_ms,
        seconds=time.perf_counter() - start,
        timed_steps=step - args.warmup,
        payload_bytes=counter.payload - payload_start,
    )
    if rank == 0:
        print(
            fc.result_line("pytorch-ddp", world, threads, args.batch_size, timing, fc.param_bytes(model)),
            flush=True,
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
