#!/usr/bin/env python3
"""Issue 52's sequence and context parallelism: examples/llm/finetune on 2 (3 and 4) CPU ranks through
accel-launch with parallelism_config_sp_size 2 (DeepSpeed Ulysses) or cp_size 2 (context parallelism) trains
a tiny Qwen2 made here (by transformers, random weights) on sequences of 1024 tokens with the per-step losses
and final weights of one process on the whole sequences.

  sp_equivalence.py FINETUNE ACCEL_LAUNCH

Rows (each prints one line; the last "sp equivalence: all equal" only when every check passed):
  sp2 packed   packed rows of exactly 1024 tokens (packing_strategy wrapped: documents restart their
               position ids inside a row), 2 ranks sp_size 2 vs one process: losses within 1e-5, gradient
               norms before clipping within 1e-5 relative (AdamW alone would hide a gradient scaled by a
               constant), model 1e-5.
  cp3 ring packed  the same on 3 ranks with cp_size 3 and cp_comm_strategy alltoall (ring attention: key/value
               blocks passed around the ring point to point, merged by log-sum-exp, the document mask per
               block pair; 3 ranks so that the ring's next and previous rank differ).
  sp2 unfused  sp2 packed with --fused_linear_cross_entropy false (the rows above take each rank's loss through
               the fused linear + cross-entropy, the default; this one through the model's logits).
  sp2 padded   unpacked rows of different lengths (padding, attention mask; the length padded to a multiple
               of the group), gradient accumulation 2.
  sp4 refused  sp_size 4 with 2 kv heads: the UsageError naming both head counts.
  sp2 / cp2 / cp2 ring causal  one unpadded row per batch (lengths not multiples of the group): attention
               without a mask (Ulysses: SDPA's causal flag over the whole sequence; context, allgather: each
               chunk causally over the keys before it; ring: the causal flag on a rank's own block, the hidden
               block pairs skipped).
  sp2 x dp2    4 ranks (2 sequence-parallel groups x 2 data-parallel replicas, batch 1 each) vs one process
               with batch 2.
  sp2 zero2    2 ranks sp_size 2 under ZeRO stage 2 (gradients reduce-scattered over every rank), with
               gradient checkpointing (the all-to-alls run again in backward); SGD at learning rate 0.1 without
               clipping, against one process trained so (ZeRO's engine clips before the Trainer logs a norm).
  sp2 zero3 / cp2 fsdp   the same (SGD) with ZeRO-3 (TRL's ALST file's stage) and with FSDP FULL_SHARD (its
               context-parallel file's backend; cp_comm_strategy unset: allgather, Accelerate's default).
Exit 77 when torch / transformers / tokenizers / safetensors are not importable.
"""
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time

try:
    import torch
    from safetensors.torch import load_file
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
except ImportError as e:  # pragma: no cover
    print(f"sp equivalence: skipped ({e})")
    sys.exit(77)

FAILED = []
SEED = 42


def check(ok, line):
    print(("ok    " if ok else "FAIL  ") + line, flush=True)
    if not ok:
        FAILED.append(line)


def make(out):
    """A byte-level BPE tokenizer, a tiny Qwen2 (4 heads, 2 kv heads, q/k/v biases) and text documents of
    ~100-900 tokens."""
    rng = random.Random(0)
    words = "the a cat dog sum of plus minus is what number tell me please quickly answer river stone".split()
    docs = [" ".join(rng.choice(words) for _ in range(rng.randint(60, 500))) for _ in range(24)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(docs, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.save_pretrained(out)
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=len(fast), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                      tie_word_embeddings=True, eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id)
    model = Qwen2ForCausalLM(cfg)
    with torch.no_grad():  # larger weights than the 0.02 init, so that training moves the loss visibly
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.1)
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.1)
    model.save_pretrained(out)
    data = os.path.join(out, "text.jsonl")
    with open(data, "w") as f:
        for d in docs:
            f.write(json.dumps({"text": d}) + "\n")
    return [len(fast(d)["input_ids"]) for d in docs]


def config(tmp, name, backend, ranks, sizes, clipping=1.0):
    path = os.path.join(tmp, name + ".yaml")
    with open(path, "w") as f:
        f.write(f"backend: {backend}\nuse_cpu: true\nnum_processes: {ranks}\nmain_process_port: 0\n"
                "mixed_precision: 'no'\n" + (f"deepspeed_config:\n  zero_stage: 2\n  gradient_clipping: {clipping}\n" if backend == "zero" else "")
                + "parallelism_config:\n" + "".join(f"  parallelism_config_{k}: {v}\n" for k, v in sizes.items()))
    return path


def run(fin, launch, cfg, model_dir, out, batch, accum, extra, kind="sequence", lr="1e-3", clip="1.0"):
    cmd = [fin, "--model_name_or_path", model_dir, "--dataset", os.path.join(model_dir, "text.jsonl"),
           "--output_dir", out, "--per_device_train_batch_size", str(batch), "--gradient_accumulation_steps",
           str(accum), "--max_steps", "3", "--learning_rate", lr, "--lr_scheduler_type", "linear",
           "--warmup_steps", "1", "--weight_decay", "0", "--max_grad_norm", clip, "--seed", str(SEED),
           "--logging_steps", "1", "--save_strategy", "no", "--report_to", "jsonl", "--max_length", "1024",
           *extra]
    if launch:
        cmd = [launch, "launch", "--config_file", cfg, *cmd]
    r = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if r.returncode != 0:
        raise RuntimeError(f"finetune failed ({r.returncode}): {r.stdout[-3000:]} {r.stderr[-3000:]}")
    group = re.search(r"parallelism_config_[cs]p_size: (\d+)", open(cfg).read()) if launch else None
    if launch and kind != "x" and f"{kind} parallelism over groups of {group[1]} ranks" not in r.stdout:
        print(r.stdout[-2000:])
        raise RuntimeError(f"finetune did not say it split the sequences ({kind} parallelism)")
    if launch and kind == "context":
        strategy = "alltoall" if "cp_comm_strategy: alltoall" in open(cfg).read() else "allgather"
        if f"(cp_comm_strategy {strategy})" not in r.stdout:
            print(r.stdout[-2000:])
            raise RuntimeError(f"finetune did not say it moved keys and values by {strategy}")
    with open(os.path.join(out, "runs", "trainer", "metrics.jsonl")) as f:
        rows = [row for row in map(json.loads, f) if "train/loss" in row]
    # The gradient norm before clipping: AdamW would hide a gradient off by a constant factor, this does not.
    return ([r["train/loss"] for r in rows], [r["train/grad_norm"] for r in rows if "train/grad_norm" in r],
            load_file(os.path.join(out, "model", "model.safetensors")))


def compare(name, one, got):
    (la, ga, ta), (lb, gb, tb) = one, got
    d = max(abs(a - b) for a, b in zip(la, lb)) if len(la) == len(lb) and la else float("inf")
    gd = max((abs(a - b) / a for a, b in zip(ga, gb)), default=0.0) if len(ga) == len(gb) else float("inf")
    md = max((ta[k] - tb[k]).abs().max().item() for k in ta) if set(ta) == set(tb) else float("inf")
    check(d <= 1e-5 and gd <= 1e-5 and md <= 1e-5,
          f"{name}: {len(lb)} step losses equal one process (max |diff| {d:.2e} <= 1e-5; first {la[0]:.5f}, "
          f"last {la[-1]:.5f} / {lb[-1]:.5f}), gradient norms (max relative diff {gd:.2e} <= 1e-5; first "
          f"{ga[0] if ga else 0:.4f}), final model within 1e-5 (max |diff| {md:.2e})")


def main():
    fin, launch = sys.argv[1:3]
    t0 = time.time()
    tmp = tempfile.mkdtemp(prefix="sp_equivalence_")
    try:
        base = os.path.join(tmp, "base")
        lengths = make(base)
        print(f"made: tiny Qwen2 (hidden 64, 4 heads, 2 kv heads, 2 layers), {len(lengths)} documents of "
              f"{min(lengths)}-{max(lengths)} tokens", flush=True)
        packed = ["--packing", "--packing_strategy", "wrapped"]
        one = run(fin, None, None, base, os.path.join(tmp, "one_packed"), 2, 1, packed)
        # cp3 ring: cp_comm_strategy alltoall (ring attention, blocks passed point to point) on 3 ranks, where
        # the next and the previous rank differ; the FULL_SHARD row below keeps Accelerate's default
        # (allgather).
        for name, sizes, ranks in [("sp2 packed", {"sp_size": 2, "sp_backend": "deepspeed"}, 2),
                                   ("cp3 ring packed", {"cp_size": 3, "cp_comm_strategy": "alltoall"}, 3)]:
            cfg = config(tmp, name.split()[0], "ddp", ranks, sizes)
            compare(f"{name} ({ranks} ranks, rows of 1024 tokens)",
                    one, run(fin, launch, cfg, base, os.path.join(tmp, name.replace(" ", "_")), 2, 1, packed,
                             "context" if name.startswith("cp") else "sequence"))
        # The loss under sp: each rank's part through the fused linear + cross-entropy (the default, the rows
        # above) or, with it off, the model's logits: both equal one process (which took the fused loss).
        cfg = config(tmp, "sp2_unfused", "ddp", 2, {"sp_size": 2, "sp_backend": "deepspeed"})
        compare("sp2 unfused packed (2 ranks, --fused_linear_cross_entropy false)", one,
                run(fin, launch, cfg, base, os.path.join(tmp, "sp2_unfused"), 2, 1,
                    packed + ["--fused_linear_cross_entropy", "false"]))
        # ZeRO's engine clips before the Trainer sees the norm: this row trains with SGD and no clipping
        # instead, so that the weights show a gradient off by any factor.
        sgd = dict(lr="0.1", clip="0")
        one_sgd = run(fin, None, None, base, os.path.join(tmp, "one_sgd"), 2, 1, packed + ["--optim", "sgd"], **sgd)
        cfg = config(tmp, "zero2", "zero", 2, {"sp_size": 2, "sp_backend": "deepspeed"}, clipping=0.0)
        compare("sp2 zero2 packed (2 ranks, ZeRO-2, SGD, gradient checkpointing)", one_sgd,
                run(fin, launch, cfg, base, os.path.join(tmp, "zero2"), 2, 1,
                    packed + ["--optim", "sgd", "--gradient_checkpointing", "true"], **sgd))
        # TRL's ALST file shards with ZeRO-3, its context-parallel file with FSDP: both sharded over every rank.
        for name, text, kind in [
                ("sp2 zero3", "backend: zero\ndeepspeed_config:\n  zero_stage: 3\n  gradient_clipping: 0.0\n"
                 "parallelism_config:\n  parallelism_config_sp_size: 2\n", "sequence"),
                ("cp2 fsdp", "backend: fsdp\nfsdp_config:\n  fsdp_sharding_strategy: FULL_SHARD\n"
                 "parallelism_config:\n  parallelism_config_cp_size: 2\n", "context")]:
            cfg = os.path.join(tmp, name.replace(" ", "_") + ".yaml")
            with open(cfg, "w") as f:
                f.write("use_cpu: true\nnum_processes: 2\nmain_process_port: 0\nmixed_precision: 'no'\n" + text)
            compare(f"{name} packed (2 ranks, {'ZeRO-3' if 'zero' in name else 'FULL_SHARD'}, SGD)", one_sgd,
                    run(fin, launch, cfg, base, os.path.join(tmp, name.replace(" ", "_")), 2, 1,
                        packed + ["--optim", "sgd"], kind, **sgd))
        cfg = config(tmp, "sp2dp2", "ddp", 4, {"sp_size": 2, "sp_backend": "deepspeed"})
        compare("sp2 x dp2 packed (4 ranks, batch 1 per replica)", one,
                run(fin, launch, cfg, base, os.path.join(tmp, "sp2dp2"), 1, 1, packed))
        one = run(fin, None, None, base, os.path.join(tmp, "one_padded"), 2, 2, [])
        cfg = config(tmp, "sp2", "ddp", 2, {"sp_size": 2, "sp_backend": "deepspeed"})
        compare("sp2 padded (2 ranks, rows of different lengths, accumulation 2)", one,
                run(fin, launch, cfg, base, os.path.join(tmp, "sp2_padded"), 2, 2, []))
        cfg = config(tmp, "sp4", "ddp", 4, {"sp_size": 4})
        try:
            run(fin, launch, cfg, base, os.path.join(tmp, "sp4"), 2, 1, packed)
            check(False, "sp4: trained, but 2 kv heads do not split over 4 ranks")
        except RuntimeError as e:
            want = "num_attention_heads 4 and num_key_value_heads 2 must both be divisible by the sequence-parallel size 4"
            check(want in str(e), f"sp4 refused: '{want}'")
        # One unpadded row per batch: causal attention without a mask (SDPA's causal flag; context
        # parallelism's two chunks with zero rows before them), the length padded to a multiple of the group.
        one = run(fin, None, None, base, os.path.join(tmp, "one_single"), 1, 1, [])
        for name, sizes, kind in [("sp2", {"sp_size": 2}, "sequence"),
                                  ("cp2", {"cp_size": 2}, "context"),
                                  ("cp2 ring", {"cp_size": 2, "cp_comm_strategy": "alltoall"}, "context")]:
            compare(f"{name} causal (2 ranks, one row of up to 1024 tokens per batch, no mask)", one,
                    run(fin, launch, config(tmp, name.replace(" ", "_") + "_single", "ddp", 2, sizes), base,
                        os.path.join(tmp, name.replace(" ", "_") + "_single"), 1, 1, [], kind))
        print(f"time {time.time() - t0:.1f} s")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if FAILED:
        print(f"sp equivalence: {len(FAILED)} checks failed")
        return 1
    print("sp equivalence: all equal")
    return 0


if __name__ == "__main__":
    sys.exit(main())
