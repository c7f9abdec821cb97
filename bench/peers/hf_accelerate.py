r"""Hugging Face Accelerate peer of ``bench/ddp_throughput.cpp``: the same loop written the Accelerate way.

``Accelerator(cpu=True)``, ``accelerator.prepare(model, optimizer, dataloader)``, ``accelerator.backward``.
Under a multi-process launch Accelerate picks ``DistributedType.MULTI_CPU`` and, since the PyTorch wheel has
no MPI backend, the gloo process group; the prepared data loader gives rank r the global batches
r, r+N, ... of the sequential order, which is exactly accelerate-cpp's sharding (checked at start-up).

Launch (see ``bench/ddp_bench.py`` for why it is ``--multi_gpu`` and not ``--cpu``)::

    OMP_NUM_THREADS=1 .venv/bin/accelerate launch --multi_gpu --num_processes 2 --num_machines 1 \
        --mixed_precision no --dynamo_backend no --main_process_port 29500 \
        bench/peers/hf_accelerate.py --steps 60 --warmup 10 --batch-size 64 --expect-world 2

Rank 0 prints one JSON line (``impl`` ``"hf-accelerate"``) in the format of ``bench_ddp_throughput``.
"""

import os
import sys
import time

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import DistributedType
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fashion_common as fc  # noqa: E402


def main() -> None:
    """Train for ``warmup + steps`` steps with Accelerate and print the result line on rank 0."""
    args = fc.parse_args(__doc__.splitlines()[0])
    threads = fc.set_threads_from_env()
    accelerator = Accelerator(cpu=True)
    world, rank = accelerator.num_processes, accelerator.process_index
    if args.expect_world and world != args.expect_world:
        raise SystemExit(
            f"hf_accelerate.py: world size is {world}, expected {args.expect_world} "
            f"(distributed type {accelerator.distributed_type})"
        )
    if world > 1 and (
        accelerator.distributed_type != DistributedType.MULTI_CPU or torch.distributed.get_backend() != "gloo"
    ):
        raise SystemExit(
            f"hf_accelerate.py: expected MULTI_CPU with gloo, got {accelerator.distributed_type} "
            f"with {torch.distributed.get_backend()}"
        )

    model, optimizer = fc.make_model_and_optimizer()
    n = fc.samples_needed(args.steps, args.warmup, args.batch_size, world)
    x, y = fc.load_train(n)
    if x.shape[0] < n:
        raise SystemExit(f"hf_accelerate.py: need {n} samples, the training set has {x.shape[0]}")
    loader = DataLoader(TensorDataset(x, y), batch_size=args.batch_size, shuffle=False)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    counter = fc.AllReduceByteCounter()
    if isinstance(model, DistributedDataParallel) and not args.no_byte_count:
        model.register_comm_hook(counter, fc.AllReduceByteCounter.hook)

    expected = fc.rank_batches(x, y, args.batch_size, rank, world)
    first_step_unix_ms = 0.0
    start = 0.0
    payload_start = 0
    step = 0
    for data, target in loader:
        if step == 0 and not torch.equal(data, expected[0][0]):
            raise SystemExit("hf_accelerate.py: the prepared data loader does not shard like accelerate-cpp")
        optimizer.zero_grad()
        loss = F.cross_entropy(model(data), target)
        accelerator.backward(loss)
        optimizer.step()
        step += 1
        if step == 1:
            first_step_unix_ms = fc.now_unix_ms()
        if step == args.warmup:
            accelerator.wait_for_everyone()
            start = time.perf_counter()
            payload_start = counter.payload
    accelerator.wait_for_everyone()
    if step != len(expected):
        raise SystemExit(f"hf_accelerate.py: rank {rank} ran {step} steps, expected {len(expected)}")
    timing = fc.Timing(
        first_step_unix_ms=first_step_unix_ms,
        seconds=time.perf_counter() - start,
        timed_steps=step - args.warmup,
        payload_bytes=counter.payload - payload_start,
    )
    if accelerator.is_main_process:
        params = fc.param_bytes(accelerator.unwrap_model(model))
        print(fc.result_line("hf-accelerate", world, threads, args.batch_size, timing, params), flush=True)
    accelerator.end_training()


if __name__ == "__main__":
    main()
