"""The sample order of transformers' Trainer, which tests/trainer/trainer_peft_test.cpp ([.hf_order]) compares
with accel::Trainer's: a real Trainer.train() over a toy dataset whose samples are their own indices, recording
what the model sees. HF's order: accelerate's SeedableRandomSampler, a RandomSampler over torch.randperm(n) with
a generator seeded (data_seed or the seed set_seed gave torch) + epoch.

  hf_trainer_order.py OUT_FILE   one line per case: "<name> <epoch> <index> <index> ..." (exit 77 when
                                 transformers is not importable)
"""
import os
import sys
import tempfile

try:
    import torch
    from transformers import Trainer, TrainingArguments
except ImportError as e:  # pragma: no cover
    print(f"hf_trainer_order: skipped ({e})")
    sys.exit(77)


class Indices(torch.utils.data.Dataset):
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"x": torch.tensor([float(i)])}


class Recorder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.seen = []

    def forward(self, x):
        self.seen.extend(int(v) for v in x.flatten().tolist())
        return {"loss": (self.w * x).sum()}


def order(n, batch, seed, data_seed, epochs):
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, per_device_train_batch_size=batch, num_train_epochs=epochs,
                                 seed=seed, data_seed=data_seed, save_strategy="no", report_to="none",
                                 use_cpu=True, disable_tqdm=True, logging_strategy="no")
        model = Recorder()
        Trainer(model=model, args=args, train_dataset=Indices(n)).train()
    return [model.seen[e * n:(e + 1) * n] for e in range(epochs)]


def main():
    lines = []
    for name, n, batch, seed, data_seed in [("seed42", 10, 4, 42, None), ("seed7_data_seed3", 13, 3, 7, 3),
                                            ("seed0", 40, 8, 0, None)]:
        for epoch, idx in enumerate(order(n, batch, seed, data_seed, 2)):
            lines.append(" ".join([name, str(epoch), *map(str, idx)]))
    with open(sys.argv[1], "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"hf_trainer_order: transformers' Trainer order written for {len(lines)} epochs")


if __name__ == "__main__":
    main()
