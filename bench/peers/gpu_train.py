"""Python peers of ``bench/gpu_train.cpp``: the same single-GPU bf16 training loop in PyTorch and in Hugging
Face Accelerate, printing the same line.

Both mirror the C++ benchmark: the Fashion-MNIST CNN of ``fashion_common.Net`` on the first ``--limit``
training images, or the small transformer encoder classifier below on random tokens (label = token sum mod
10); a shuffling DataLoader with ``pin_memory=True`` and no worker processes; AdamW lr 1e-3 (PyTorch's default
implementation on CUDA, foreach); cross-entropy; ``--warmup`` untimed steps, then ``--steps`` timed ones
between two ``torch.cuda.synchronize()``.

    python3 gpu_train.py --impl torch|accelerate --model cnn|transformer [--batch 256] [--steps 300]
"""

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fashion_common import Net, load_train  # noqa: E402


class TinyTransformer(nn.Module):
    """d_model 256, 4 heads, feed-forward 1024, 4 layers, vocabulary 1000, 10 classes (as the C++ one)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(1000, 256)
        layer = nn.TransformerEncoderLayer(256, 4, dim_feedforward=1024)
        self.encoder = nn.TransformerEncoder(layer, 4, enable_nested_tensor=False)
        self.head = nn.Linear(256, 10)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.encoder(self.embed(tokens).transpose(0, 1))
        return self.head(x.mean(0))


def tokens(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    x = torch.randint(1000, (n, 128), dtype=torch.int64)
    return x, x.sum(1).remainder(10)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--impl", choices=["torch", "accelerate"], required=True)
    p.add_argument("--model", choices=["cnn", "transformer"], default="cnn")
    p.add_argument("--precision", choices=["bf16", "no"], default="bf16")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--limit", type=int, default=20000)
    a = p.parse_args()

    torch.manual_seed(0)
    model = Net() if a.model == "cnn" else TinyTransformer()
    x, y = load_train(a.limit) if a.model == "cnn" else tokens(a.limit)
    loader = DataLoader(TensorDataset(x, y), batch_size=a.batch, shuffle=True, pin_memory=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    bf16 = a.precision == "bf16"
    if a.impl == "accelerate":
        from accelerate import Accelerator

        acc = Accelerator(mixed_precision="bf16" if bf16 else "no")
        model, opt, loader = acc.prepare(model, opt, loader)
        device = acc.device
    else:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        model.to(device)

    done, start, last = 0, time.perf_counter(), 0.0
    while done < a.warmup + a.steps:
        for xb, yb in loader:
            if done == a.warmup:
                sync()
                start = time.perf_counter()
            if a.impl == "accelerate":
                loss = F.cross_entropy(model(xb), yb)  # prepare() wrapped the forward in autocast
                acc.backward(loss)
            else:
                xb, yb = xb.to(device, non_blocking=True), yb.to(device, non_blocking=True)
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                    loss = F.cross_entropy(model(xb), yb)
                loss.backward()
            opt.step()
            opt.zero_grad()
            done += 1
            if done >= a.warmup + a.steps:
                last = loss.item()
                break
    sync()
    s = time.perf_counter() - start
    name = "hf-accelerate" if a.impl == "accelerate" else "pytorch"
    print(
        f"gpu_train impl={name}(torch.optim.AdamW) model={a.model} precision={a.precision} batch={a.batch} "
        f"steps={a.steps} device={device} samples/s={a.steps * a.batch / s:.1f} last_loss={last:.4f}"
    )


if __name__ == "__main__":
    main()
