#!/usr/bin/env python3
"""PyTorch FSDP2 (torch.distributed.fsdp.fully_shard) peer of build/bench/bench_zero_memory: the same MLP
(4 x Linear(width, width) + ReLU, Linear(width, 10)), Adam(lr 1e-4), per-rank batch 32, fp32, gloo on CPU.
Every Linear is its own FSDP unit, then the root, as FSDP2's documentation recommends.

    torchrun --nproc_per_node 2 bench/peers/torch_fsdp2.py --steps 6 [--no-reshard]

Prints one JSON line from rank 0 with the keys bench_zero_memory prints: step time and the bytes this rank
holds in parameters, gradients and optimizer state after optimizer.step() (storages counted once).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def storage_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        t = local(t)
        key = t.untyped_storage().data_ptr()
        if key in seen or t.untyped_storage().nbytes() == 0:
            continue
        seen.add(key)
        total += t.untyped_storage().nbytes()
    return total


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--width", type=int, default=2304)
    parser.add_argument("--no-reshard", action="store_true", help="reshard_after_forward=False (SHARD_GRAD_OP)")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    w = args.width
    layers = []
    for _ in range(4):
        layers += [torch.nn.Linear(w, w), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(w, 10))
    params = sum(p.numel() for p in model.parameters())
    reshard = not args.no_reshard
    for m in model:
        if isinstance(m, torch.nn.Linear):
            fully_shard(m, reshard_after_forward=reshard)
    fully_shard(model, reshard_after_forward=reshard)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    batch = 32
    n = (args.steps + args.warmup) * batch * world
    x, y = torch.randn(n, w), torch.randint(0, 10, (n,))
    start = 0.0
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            dist.barrier()
            start = time.perf_counter()
        lo = (step * world + rank) * batch  # global batches r, r+N, ... as the C++ loader shards them
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x[lo:lo + batch]), y[lo:lo + batch])
        loss.backward()
        optimizer.step()
    dist.barrier()
    seconds = time.perf_counter() - start
    p = storage_bytes(model.parameters())
    g = storage_bytes(q.grad for q in model.parameters())
    o = storage_bytes(v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0)
    if rank == 0:
        print(json.dumps({"backend": "torch-fsdp2" + ("" if reshard else " (no reshard)"), "world": world,
                          "parameters": params, "step_ms": seconds / args.steps * 1e3, "param_bytes": p,
                          "grad_bytes": g, "optimizer_bytes": o, "total_bytes": p + g + o}), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
