"""Python peers of ``bench/gpu_train.cpp``: the same single-GPU bf16 training loop in PyTorch and in Hugging
Face Accelerate, and the same training through Hugging Face's ``Trainer`` (``--impl hf-trainer``, the peer of
``bench_gpu_train --impl trainer``), printing the same line.

Both mirror the C++ benchmark: the Fashion-MNIST CNN of ``fashion_common.Net`` on the first ``--limit``
training images, or the small transformer encoder classifier below on random tokens (label = token sum mod
10); a shuffling DataLoader with ``pin_memory=True`` and no worker processes; AdamW lr 1e-3 (PyTorch's default
implementation on CUDA, foreach); cross-entropy; ``--warmup`` untimed steps, then ``--steps`` timed ones
between two ``torch.cuda.synchronize()``.

``hf-trainer`` keeps HF's defaults (clipping at 1.0, ``dataloader_pin_memory``) except a constant learning
rate, lr 1e-3, ``--optim`` (adamw_torch or adamw_torch_fused) and bf16; a callback times the end of step
``--warmup`` to the end of the last step, after ``torch.cuda.synchronize()``.

    python3 gpu_train.py --impl torch|accelerate|hf-trainer --model cnn|transformer [--batch 256] [--steps 300]
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


def hf_trainer(a: argparse.Namespace, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    import tempfile

    from transformers import Trainer, TrainerCallback, TrainingArguments

    class Classifier(nn.Module):
        """HF's Trainer calls model(**batch) and reads the loss from the output."""

        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, inputs: torch.Tensor, labels: torch.Tensor) -> dict:
            logits = self.inner(inputs)
            return {"loss": F.cross_entropy(logits, labels), "logits": logits}

    class Rows(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return x.size(0)

        def __getitem__(self, i: int) -> dict:
            return {"inputs": x[i], "labels": y[i]}

    class StepClock(TrainerCallback):
        def __init__(self) -> None:
            self.start = self.stop = 0.0

        def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001, ANN003
            if state.global_step in (a.warmup, a.warmup + a.steps):
                sync()
                if state.global_step == a.warmup:
                    self.start = time.perf_counter()
                else:
                    self.stop = time.perf_counter()

    clock = StepClock()
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out,
            per_device_train_batch_size=a.batch,
            max_steps=a.warmup + a.steps,
            learning_rate=1e-3,
            lr_scheduler_type="constant",
            optim=a.optim,
            bf16=a.precision == "bf16",
            save_strategy="no",
            report_to="none",
            disable_tqdm=True,
            seed=0,
            remove_unused_columns=False,
            use_cpu=not torch.cuda.is_available(),
        )
        trainer = Trainer(model=Classifier(model), args=args, train_dataset=Rows(), callbacks=[clock])
        result = trainer.train()
    s = clock.stop - clock.start
    print(
        f"gpu_train impl=hf-trainer({a.optim}) model={a.model} precision={a.precision} batch={a.batch} "
        f"steps={a.steps} device={args.device} samples/s={a.steps * a.batch / s:.1f} "
        f"training_loss={result.training_loss:.4f}"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--impl", choices=["torch", "accelerate", "hf-trainer"], required=True)
    p.add_argument("--optim", choices=["adamw_torch", "adamw_torch_fused"], default="adamw_torch")
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
    if a.impl == "hf-trainer":
        hf_trainer(a, model, x, y)
        return
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
