#!/usr/bin/env python3
"""Peak memory per rank of examples/llm/finetune on one long sequence: one process vs sequence parallelism
(sp_size 2) and context parallelism (cp_size 2, K/V all-gathered or passed around a ring:
cp_comm_strategy allgather / alltoall) on 2 CPU ranks (issue 52's long-sequence table).

  sequence_parallel_memory.py FINETUNE ACCEL_LAUNCH [--seq 8192] [--hidden 512] [--layers 4] [--heads 8]
                              [--kv_heads 2] [--intermediate 1536] [--vocab 300] [--shape qwen2-0.5b]
                              [--lora R] [--gradient_checkpointing] [--steps 2] [--runs one,sp2,cp2,cp2ring]

A Qwen2 of the given shape (random weights, a 300-token byte-level BPE tokenizer; by default a 300-row
vocabulary so that the logits do not dominate) and documents longer than --seq are made in a temporary
directory; each run trains --steps steps of batch 1 (fp32, rows truncated to --seq, no padding; full
fine-tuning, or LoRA of rank R on every Linear but the head with --lora R; the loss through the fused linear +
cross-entropy, finetune's default, so the logits never materialise whole) and reports each rank's peak
resident set (getrusage's ru_maxrss through /usr/bin/time). The same run at sequence 256 gives its fixed part
(LibTorch, the model, AdamW's state, DDP's buckets): the difference is what the long sequence costs a rank.
Each rank's CPU time (user + sys of the whole process at --seq) is printed beside it.

--shape qwen2-0.5b sets Qwen2-0.5B's width (hidden 896, intermediate 4864, 14 heads / 2 kv heads, a
151,936-row vocabulary, tied embeddings; the tokenizer still uses only its first 300 rows); --layers then says
how many of its 24 layers (default 4). Big: run it under `flock /tmp/accel-bigmem.lock` after `free -g`.
"""
import argparse
import json
import os
import random
import re
import shutil
import subprocess
import tempfile

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM


def make(out, a):
    rng = random.Random(0)
    words = "the a cat dog sum of plus minus is what number tell me please quickly answer river stone".split()
    docs = [" ".join(rng.choice(words) for _ in range(a.seq * 2)) for _ in range(4)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(docs[:1], trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.save_pretrained(out)
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=max(a.vocab, len(fast)), hidden_size=a.hidden, intermediate_size=a.intermediate,
                      num_hidden_layers=a.layers, num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
                      max_position_embeddings=2 * a.seq, tie_word_embeddings=True)
    Qwen2ForCausalLM(cfg).save_pretrained(out)
    with open(os.path.join(out, "text.jsonl"), "w") as f:
        for d in docs:
            f.write(json.dumps({"text": d}) + "\n")


def run(fin, launch, cfg, model, out, seq, a):
    cmd = ["/usr/bin/time", "-f", "peak_rss_kb %M cpu_s %U %S", fin, "--model_name_or_path", model, "--dataset",
           os.path.join(model, "text.jsonl"), "--output_dir", out, "--per_device_train_batch_size", "1",
           "--max_steps", str(a.steps), "--learning_rate", "1e-4", "--save_strategy", "no", "--report_to", "none",
           "--max_length", str(seq), "--logging_steps", "1", "--fused_linear_cross_entropy", "true"]
    if a.lora:
        cmd += ["--model_config", os.path.join(model, "lora.model.yaml")]
    if a.gradient_checkpointing:
        cmd += ["--gradient_checkpointing", "true"]
    if launch:
        cmd = [launch, "launch", "--config_file", cfg, *cmd]
    r = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    text = r.stdout + r.stderr
    if r.returncode != 0:
        raise RuntimeError(text[-3000:])
    found = re.findall(r"peak_rss_kb (\d+) cpu_s ([\d.]+) ([\d.]+)", text)
    return [int(k) / 1024 for k, _, _ in found], [float(u) + float(s) for _, u, s in found]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("finetune")
    p.add_argument("launch")
    for name, value in [("seq", 8192), ("hidden", 512), ("layers", 4), ("heads", 8), ("kv_heads", 2),
                        ("intermediate", 1536)]:
        p.add_argument("--" + name, type=int, default=value)
    p.add_argument("--vocab", type=int, default=300, help="rows of the embedding (and tied head)")
    p.add_argument("--shape", choices=["qwen2-0.5b"], help="Qwen2-0.5B's width (--layers still applies)")
    p.add_argument("--lora", type=int, default=0, help="LoRA rank on every Linear but the head (0: full)")
    p.add_argument("--gradient_checkpointing", action="store_true")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--runs", default="one,sp2,cp2,cp2ring", help="which rows, comma-separated")
    a = p.parse_args()
    if a.shape == "qwen2-0.5b":
        a.hidden, a.intermediate, a.heads, a.kv_heads, a.vocab = 896, 4864, 14, 2, 151936
    tmp = tempfile.mkdtemp(prefix="sp_memory_")
    try:
        model = os.path.join(tmp, "model")
        make(model, a)
        if a.lora:
            with open(os.path.join(model, "lora.model.yaml"), "w") as f:
                f.write(f"use_peft: true\nlora_r: {a.lora}\nlora_alpha: {2 * a.lora}\nlora_dropout: 0.0\n"
                        "lora_target_modules: all-linear\n")
        # A copy: a rebuild of the tree meanwhile must not swap the binary under a run.
        a.finetune = shutil.copy2(a.finetune, os.path.join(tmp, "finetune"))
        configs = {}
        for name, sizes in [("sp2", "  parallelism_config_sp_size: 2\n  parallelism_config_sp_backend: deepspeed\n"),
                            ("cp2", "  parallelism_config_cp_size: 2\n"),
                            ("cp2ring", "  parallelism_config_cp_size: 2\n  parallelism_config_cp_comm_strategy: alltoall\n")]:
            configs[name] = os.path.join(tmp, name + ".yaml")
            with open(configs[name], "w") as f:
                f.write("backend: ddp\nuse_cpu: true\nnum_processes: 2\nmain_process_port: 0\n"
                        "mixed_precision: 'no'\nparallelism_config:\n" + sizes)
        kind = f"LoRA r {a.lora} (all-linear)" if a.lora else "full fine-tuning"
        print(f"shape: hidden {a.hidden}, {a.layers} layers, {a.heads} heads / {a.kv_heads} kv heads, "
              f"intermediate {a.intermediate}, vocab {max(a.vocab, 300)}; batch 1, fp32, {kind}, fused loss, "
              f"{'gradient checkpointing, ' if a.gradient_checkpointing else ''}{a.steps} steps")
        print(f"| run | sequence | peak RSS per rank (MiB) | the same run at sequence 256 | the sequence's part "
              f"(difference) | CPU s per rank (user+sys) at the sequence |")
        print("|---|---|---|---|---|---|")
        for key, name, cfg in [("one", "one process", None), ("sp2", "sp_size 2 (2 ranks)", configs["sp2"]),
                               ("cp2", "cp_size 2, allgather (2 ranks)", configs["cp2"]),
                               ("cp2ring", "cp_size 2, alltoall: ring (2 ranks)", configs["cp2ring"])]:
            if key not in a.runs.split(","):
                continue
            launch = a.launch if cfg else None
            fixed, _ = run(a.finetune, launch, cfg, model, os.path.join(tmp, "fixed"), 256, a)
            peaks, cpu = run(a.finetune, launch, cfg, model, os.path.join(tmp, "run"), a.seq, a)
            print(f"| {name} | {a.seq} | {', '.join(f'{x:.0f}' for x in peaks)} | "
                  f"{', '.join(f'{x:.0f}' for x in fixed)} | "
                  f"{', '.join(f'{x - y:.0f}' for x, y in zip(peaks, fixed))} | "
                  f"{', '.join(f'{x:.0f}' for x in cpu)} |", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
