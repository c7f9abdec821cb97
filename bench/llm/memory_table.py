"""README's memory table for real model sizes: per-rank training state of every training type at 1, 2 and 8
ranks, from `accel-launch estimate-memory --model_config config.json --type TYPE --num_processes N` (the
config.json files written here from transformers' configurations of Qwen2.5 0.5B / 1.5B / 7B; no weights).
In parentheses, what the estimate names beside the state as held for a moment while training (not in its total):
autograd's gradient of a trained embedding beside its bucket or shard (twice with a tied head; `transient=`).

    python bench/llm/memory_table.py build/launcher/accel-launch
    python bench/llm/memory_table.py build/launcher/accel-launch --max_length 512,2048

With --max_length, a second table: the activations of one row of each length per rank (estimate-memory
--max_length L --per_device_train_batch_size 1; gradient checkpointing as the type sets it: on for minimal) and
the total with them at 2 ranks (state + what is held beside it + activations).
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile

from transformers import Qwen2Config

SIZES = {
    "Qwen2.5-0.5B": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True),
    "Qwen2.5-1.5B": dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True),
    "Qwen2.5-7B": dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False),
}
TYPES = ["full", "deepspeed", "stage2_offload", "stage3", "lora", "qlora", "minimal"]
RANKS = [1, 2, 8]


def estimate(launch, config, kind, ranks):
    out = subprocess.run([launch, "estimate-memory", "--model_config", config, "--type", kind, "--num_processes",
                          str(ranks)], capture_output=True, text=True, env=dict(os.environ, ACCEL_CONFIG_FILE=""))
    if out.returncode != 0:
        return "refused: " + out.stderr.strip().splitlines()[-1][:80]
    total = int(re.search(r"total=(\d+)", out.stdout).group(1))
    extra = sum(int(m.group(1)) for m in re.finditer(r"(?:gathered|transient)=(\d+)", out.stdout))
    return f"{total / 1e9:.1f}" + (f" (+{extra / 1e9:.1f})" if extra else "")


def activations(launch, config, kind, length, ranks=2):
    out = subprocess.run([launch, "estimate-memory", "--model_config", config, "--type", kind, "--num_processes",
                          str(ranks), "--max_length", str(length), "--per_device_train_batch_size", "1"],
                         capture_output=True, text=True, env=dict(os.environ, ACCEL_CONFIG_FILE=""))
    if out.returncode != 0:
        return "refused"
    act = int(re.search(r"activations=(\d+)", out.stdout).group(1))
    total = float(re.search(r"total with activations.*: ([0-9.]+) MiB", out.stdout).group(1)) * 2**20
    return f"{act / 1e9:.2f} / {total / 1e9:.1f}"


def activation_table(launch, work, lengths):
    print(f"\n| model | type | " + " | ".join(f"{n} tokens: activations / total (2 ranks)" for n in lengths) + " |")
    print("|---|---|" + "---|" * len(lengths))
    for name in SIZES:
        config = os.path.join(work, name + ".json")
        for kind in TYPES:
            cells = [activations(launch, config, kind, n) for n in lengths]
            print(f"| {name} | {kind} | " + " | ".join(cells) + " |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("launch")
    ap.add_argument("--max_length", help="comma-separated row lengths: adds the activations table")
    a = ap.parse_args()
    launch = a.launch
    with tempfile.TemporaryDirectory() as work:
        print("| model | type | " + " | ".join(f"{n} rank{'s' if n > 1 else ''}" for n in RANKS) + " |")
        print("|---|---|" + "---|" * len(RANKS))
        for name, shape in SIZES.items():
            config = os.path.join(work, name + ".json")
            Qwen2Config(**shape).to_json_file(config)
            for kind in TYPES:
                cells = [estimate(launch, config, kind, n) for n in RANKS]
                print(f"| {name} | {kind} | " + " | ".join(cells) + " |")
        if a.max_length:
            activation_table(launch, work, [int(n) for n in a.max_length.split(",")])


if __name__ == "__main__":
    main()
