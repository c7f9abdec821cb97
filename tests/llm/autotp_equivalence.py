#!/usr/bin/env python3
"""AutoTP (issues 50 and 52): examples/llm/finetune on 2 ranks with a tensor-parallel size of 2 (each block's
q/k/v/gate/up split by output rows, o/down by input columns over the two ranks, which read the same batches)
against the same recipe in one process, on tiny models transformers makes here (no download).

  autotp_equivalence.py FINETUNE ACCEL_LAUNCH LLAMA_FACTORY_AUTOTP_JSON

Every tensor-parallel run builds its model empty and reads only its slices from the checkpoint
(load_pretrained_slices). Checks (each prints one line; the last line "autotp equivalence: all equal" only when
every check passed):
  full tp_size     Qwen2 (tied embeddings, GQA 4/2 heads, q/k/v biases), full fine-tuning (AdamW), accumulation
                   2, clipping 1.0: Accelerate's parallelism_config_tp_size 2 (DDP YAML) on 2 ranks with
                   --vocab_parallel true (the tied embedding = head split over the vocabulary, one shard; the
                   fused loss computed vocabulary-parallel); per-step losses and gradient norms before clipping
                   (which AdamW's step would not show off by a factor) within 1e-5 of one process, the saved
                   model (gathered: transformers' names and full shapes) within 1e-5; rank 0's parameter count
                   shows the split (embedding included).
  bf16 tp_size     the same tp_size 2 vocabulary-parallel run with --bf16 true (CPU bf16 autocast; its matmul
                   scratch comes through c10's raw_allocate, which CpuMemoryCounter's wrapper must support): per-step
                   losses within 5e-3 (bf16 rounding; measured 1.4e-3) of one process in bf16 and in float32.
  full autotp      through LLaMA-Factory's examples/deepspeed/ds_z2_autotp_config.json as the YAML's
                   deepspeed_config_file, unchanged (ZeRO-2 + tensor_parallel.autotp_size 2, "auto" sizes; its
                   gradient_clipping clips inside the engine, so norms are not compared there), the default
                   split (embedding and head whole, as DeepSpeed's AutoTP); and on 4
                   ranks (tp 2 x 2 data-parallel replicas, batch 2 each; ZeRO-2 over the replicas), norms
                   compared, vocabulary-parallel with the unfused loss (logits [tokens, V / 2] per rank).
  loaded bytes     rank 0's CPU allocations while reading its slices (CpuMemoryCounter, printed by the
                   recipe) equal the replicated tensors plus half of the split ones (the embedding among them
                   under --vocab_parallel), computed here from the checkpoint.
  lora tp_size     Qwen3, LoRA r 8 on q/k/v/o/gate/up/down (split adapters: B by rows under a column split, A
                   by columns under a row split) from one PEFT-made adapter, untied head split over the
                   vocabulary (frozen), fused loss: losses 1e-5, saved adapter 1e-5 (PEFT's keys and shapes).
  qwen3 autotp     Qwen3 (q/k norms per head_dim: their gradient summed over the group), full fine-tuning
                   through the DeepSpeed file (gradient_clipping auto) with DeepSpeed's own key
                   tensor_parallel.vocab_parallel_lm_head: true instead of --vocab_parallel: the untied lm_head
                   split over the vocabulary, embed_tokens whole (DeepSpeed's meaning), unfused loss computed
                   vocabulary-parallel: losses, norms and model within 1e-5 (without the q/k norm gradient sum
                   this row misses by 2.7e-3); rank 0's parameter count and slice reading show the head split
                   and the embedding whole.
  refusal          tp 2 over a model with 1 key/value head and vocab_size 265 under --vocab_parallel is refused
                   naming both (num_key_value_heads 1, vocab_size 265) and the tensor-parallel size 2.
The saved models load in transformers (the full model's logits computed there equal the one-process run's):
the default split's, the tied vocabulary-parallel one's and the untied vocabulary-parallel one's.
Exit 77 when transformers / peft / tokenizers are not importable.
"""
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time

try:
    import torch
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file
    from transformers import (AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM,
                              Qwen3Config, Qwen3ForCausalLM)
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
except ImportError as e:  # pragma: no cover
    print(f"autotp equivalence: skipped ({e})")
    sys.exit(77)

torch.set_num_threads(1)
FAILED = []
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def check(ok, line):
    print(("ok    " if ok else "FAIL  ") + line, flush=True)
    if not ok:
        FAILED.append(line)


def make_data(out):
    """A byte-level BPE tokenizer trained here and a plain-text JSONL of varied lengths (padding differs)."""
    rng = random.Random(0)
    words = "the a cat dog sum of plus minus is what number tell me please quickly answer".split()
    rows = [{"text": " ".join(rng.choice(words) for _ in range(rng.randint(6, 40)))} for _ in range(32)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([r["text"] for r in rows] * 3, trainers.BpeTrainer(
        vocab_size=264, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    data = os.path.join(out, "text.jsonl")
    with open(data, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return fast, data


def make_model(out, fast, kind, kv_heads=2, vocab=None):
    torch.manual_seed(0)
    common = dict(vocab_size=vocab or len(fast), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=kv_heads,
                  max_position_embeddings=256, eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id)
    if kind == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=16, tie_word_embeddings=False, **common))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(tie_word_embeddings=True, **common))
    with torch.no_grad():  # larger weights than the 0.02 init; biases and norms not at their init values
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.1)
            elif "bias" in name:
                p.normal_(0, 0.1)
            else:
                p.normal_(1, 0.1)
    model.save_pretrained(out)
    fast.save_pretrained(out)
    return out


def write_yaml(tmp, name, body):
    path = os.path.join(tmp, name)
    with open(path, "w") as f:
        f.write(body)
    return path


def finetune(fin, launch, cfg, model_dir, data, out, extra, steps=4, lr=1e-3, check_rc=True, batch=4):
    cmd = [fin, "--model_name_or_path", model_dir, "--dataset", data, "--output_dir", out,
           "--per_device_train_batch_size", str(batch), "--gradient_accumulation_steps", "2", "--max_steps", str(steps),
           "--learning_rate", repr(lr), "--lr_scheduler_type", "linear", "--warmup_steps", "1",
           "--weight_decay", "0", "--max_grad_norm", "1.0", "--seed", "42", "--logging_steps", "1",
           "--save_strategy", "no", "--max_length", "64", *extra]
    cmd += ["--report_to", "jsonl"]
    if launch:
        cmd = [launch, "launch", "--config_file", cfg, *cmd]
    env = dict(os.environ, OMP_NUM_THREADS="1", ACCEL_CONFIG_FILE="")
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if check_rc and r.returncode != 0:
        print(" ".join(cmd))
        print(r.stdout[-3000:], r.stderr[-3000:])
        raise RuntimeError(f"finetune failed ({r.returncode})")
    return r


def losses(out, key="train/loss"):
    with open(os.path.join(out, "runs", "trainer", "metrics.jsonl")) as f:
        return [r[key] for r in map(json.loads, f) if key in r]


# The elements of the tiny Qwen2's split projections (2 blocks: q 64x64+64, k and v 32x64+32, o 64x64, gate
# and up 128x64, down 64x128).
SPLIT_QWEN2 = 2 * ((64 * 64 + 64) + 2 * (32 * 64 + 32) + 64 * 64 + 3 * 128 * 64)


def parameters(run):
    """The "trainable parameters X of Y" line the recipe prints (rank 0's own count): Y."""
    for line in run.stdout.splitlines():
        if "trainable parameters" in line:
            return int(line.split(" of ")[-1])
    raise RuntimeError("finetune printed no parameter count:\n" + run.stdout[-1500:])


SPLIT_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj.weight", "gate_proj", "up_proj", "down_proj.weight")


def slice_bytes(model_dir, vocab_parallel, tp=2, vocab=("embed_tokens", "lm_head"), elements=False):
    """What a rank of tp allocates reading its slices: the replicated tensors whole, the split ones 1 / tp
    (`vocab`: which vocabulary tensors are split under vocab_parallel). elements: count elements, not bytes."""
    total = 0
    for name, t in load_file(os.path.join(model_dir, "model.safetensors")).items():
        split = any(k in name for k in SPLIT_NAMES) or (vocab_parallel and any(v in name for v in vocab))
        total += t.numel() * (1 if elements else t.element_size()) // (tp if split else 1)
    return total


def loaded_bytes(run):
    """The "tensor-parallel slices loaded: X bytes" line the recipe prints (rank 0's allocations): X."""
    for line in run.stdout.splitlines():
        if "tensor-parallel slices loaded:" in line:
            return int(line.split("loaded:")[1].split()[0])
    raise RuntimeError("finetune printed no slice-loading line:\n" + run.stdout[-1500:])


def reloads(label, one, two, fast):
    """Both saved models load in transformers; their logits agree within 1e-4."""
    m_one = AutoModelForCausalLM.from_pretrained(os.path.join(one, "model"))
    m_tp = AutoModelForCausalLM.from_pretrained(os.path.join(two, "model"))
    ids = fast(["the cat is what number", "tell me please"], return_tensors="pt", padding=True)
    with torch.no_grad():
        ld = (m_one(**ids).logits - m_tp(**ids).logits).abs().max().item()
    check(ld <= 1e-4, f"{label}: the saved model loads in transformers, logits within 1e-4 of the "
          f"one-process model's (max |diff| {ld:.2e})")


def max_diff(a, b):
    return max(abs(x - y) for x, y in zip(a, b)) if len(a) == len(b) and a else float("inf")


def tensors_diff(a, b):
    if set(a) != set(b):
        print("  keys differ:", sorted(set(a) ^ set(b))[:6])
        return float("inf")
    if any(a[k].shape != b[k].shape for k in a):
        print("  shapes differ:", [k for k in a if a[k].shape != b[k].shape][:6])
        return float("inf")
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def compare(label, one, two, sub, name, launched, norms=True):
    d = max_diff(losses(one), losses(two))
    # Gradient norms before clipping: AdamW's step (and clipping) would hide a gradient off by a constant
    # factor, the norm does not. Not with a DeepSpeed file's gradient_clipping: the ZeRO engine clips before
    # the Trainer measures.
    gd = 0.0
    if norms:
        g1, g2 = losses(one, "train/grad_norm"), losses(two, "train/grad_norm")
        gd = max_diff([x / g1[0] for x in g1], [x / g1[0] for x in g2]) if g1 else float("inf")
    said = f"gradient norms (relative {gd:.2e} <= 1e-5)" if norms else "gradient norms not compared (clipped by ZeRO)"
    td = tensors_diff(load_file(os.path.join(one, sub, name)), load_file(os.path.join(two, sub, name)))
    check(d <= 1e-5 and gd <= 1e-5 and td <= 1e-5,
          f"{label}: {len(losses(one))} step losses equal one process (max |diff| {d:.2e} <= 1e-5), {said}, "
          f"saved {sub} (full names and shapes) within 1e-5 (max |diff| {td:.2e}){launched}")


def main():
    fin, launch, ds_json = sys.argv[1:4]
    t0 = time.time()
    tmp = tempfile.mkdtemp(prefix="autotp_equivalence_")
    try:
        fast, data = make_data(tmp)
        qwen2 = make_model(os.path.join(tmp, "qwen2"), fast, "qwen2")
        qwen3 = make_model(os.path.join(tmp, "qwen3"), fast, "qwen3")
        bad = make_model(os.path.join(tmp, "kv1"), fast, "qwen2", kv_heads=1, vocab=len(fast) + 1)
        print(f"made: tiny Qwen2 (tied, 4/2 heads, biases) and Qwen3 (untied, q/k norms), 32 texts", flush=True)
        head = "use_cpu: true\nnum_processes: 2\nmain_process_port: 0\nmixed_precision: 'no'\n"
        tp_yaml = write_yaml(tmp, "tp.yaml", "backend: ddp\n" + head +
                             "parallelism_config:\n  parallelism_config_tp_size: 2\n")
        ds_yaml = write_yaml(tmp, "autotp.yaml", "distributed_type: DEEPSPEED\n" + head +
                             f"deepspeed_config:\n  deepspeed_config_file: {ds_json}\n")
        # The same file for the 4-rank and Qwen3 rows. Its gradient_clipping stays "auto" (max_grad_norm 1.0, the
        # engine clips): 0 against max_grad_norm 1.0 is a mismatch that Hugging Face's Trainer refuses (issue 51).
        unclipped = json.load(open(ds_json))
        ds_noclip = write_yaml(tmp, "ds_noclip.json", json.dumps(unclipped))

        one = os.path.join(tmp, "one_full")
        whole = parameters(finetune(fin, None, None, qwen2, data, one, []))
        embedding = len(fast) * 64
        vp = ["--vocab_parallel", "true"]
        for label, cfg, extra in [
                ("full tp_size 2 vocab-parallel (tied embedding = head, one shard; fused loss; "
                 "parallelism_config_tp_size, DDP)", tp_yaml, vp),
                ("full autotp 2 (LLaMA-Factory ds_z2_autotp_config.json: ZeRO-2; embedding and head whole)",
                 ds_yaml, [])]:
            out = os.path.join(tmp, "tp_" + os.path.basename(cfg))
            run = finetune(fin, launch, cfg, qwen2, data, out, extra)
            held = parameters(run)
            # Rank 0 holds half of every projection (and of the embedding under --vocab_parallel).
            split = SPLIT_QWEN2 + (embedding if extra else 0)
            compare(label, one, out, "model", "model.safetensors",
                    f"; rank 0 holds {held} of the {whole} parameters", norms=cfg == tp_yaml)
            if held != whole - split // 2:
                check(False, f"{label}: rank 0 holds {held} parameters, expected {whole} - {split} / 2")
            got, want = loaded_bytes(run), slice_bytes(qwen2, bool(extra))
            check(want <= got <= want * 1.01 + 4096,
                  f"loaded bytes, {label.split(' (')[0]}: rank 0 allocated "
                  f"{got} bytes reading its slices = the replicated tensors + half of the split ones "
                  f"({want}; the whole checkpoint: {slice_bytes(qwen2, True, tp=1)})")
        # bf16 autocast under tp 2: LibTorch's bf16 CPU matmul takes scratch through c10's raw_allocate, which
        # asserted on CpuMemoryCounter's allocator (installed by the slice loading) until it kept context == data.
        one_bf16, tp_bf16 = os.path.join(tmp, "one_bf16"), os.path.join(tmp, "tp_bf16")
        finetune(fin, None, None, qwen2, data, one_bf16, ["--bf16", "true"])
        finetune(fin, launch, tp_yaml, qwen2, data, tp_bf16, ["--bf16", "true"] + vp)
        d, d32 = max_diff(losses(one_bf16), losses(tp_bf16)), max_diff(losses(one), losses(tp_bf16))
        check(d <= 5e-3 and d32 <= 5e-3, f"bf16 tp_size 2 vocab-parallel (--bf16 true, fused loss): "
              f"{len(losses(tp_bf16))} step losses within bf16 rounding (5e-3) of one process in bf16 (max |diff| "
              f"{d:.2e}) and in float32 ({d32:.2e})")
        # tp 2 x dp 2 on 4 ranks: ZeRO-2 shards gradients and optimizer state over the 2 replicas, each reading
        # half of the batch (2 rows of one process's 4).
        ds4_yaml = write_yaml(tmp, "autotp4.yaml", "distributed_type: DEEPSPEED\n" +
                              head.replace("num_processes: 2", "num_processes: 4") +
                              f"deepspeed_config:\n  deepspeed_config_file: {ds_noclip}\n")
        ds_noclip_yaml = write_yaml(tmp, "autotp_noclip.yaml", "distributed_type: DEEPSPEED\n" + head +
                                    f"deepspeed_config:\n  deepspeed_config_file: {ds_noclip}\n")
        out = os.path.join(tmp, "tp_dp")
        finetune(fin, launch, ds4_yaml, qwen2, data, out, vp + ["--fused_linear_cross_entropy", "false"], batch=2)
        compare("full autotp 2 x 2 replicas on 4 ranks vocab-parallel, unfused loss (the file, gradient_clipping auto "
                "= max_grad_norm, clipped by the engine: ZeRO-2 over the replicas)", one, out, "model", "model.safetensors", "")
        reloads("the AutoTP run (embedding and head whole)", one, os.path.join(tmp, "tp_autotp.yaml"), fast)
        reloads("the tied vocabulary-parallel run", one, os.path.join(tmp, "tp_tp.yaml"), fast)

        init = os.path.join(tmp, "adapter_init")
        torch.manual_seed(1)
        peft = get_peft_model(AutoModelForCausalLM.from_pretrained(qwen3),
                              LoraConfig(task_type="CAUSAL_LM", r=8, lora_alpha=16, lora_dropout=0.0,
                                         target_modules=LORA_TARGETS))
        with torch.no_grad():  # B non-zero, so that every split adapter matters from the first step
            for n, p in peft.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.05)
        peft.save_pretrained(init)
        model_cfg = write_yaml(tmp, "lora.model.yaml", "use_peft: true\nlora_r: 8\nlora_alpha: 16\n"
                               f"lora_dropout: 0.0\nlora_target_modules: [{', '.join(LORA_TARGETS)}]\n")
        lora_args = ["--model_config", model_cfg, "--adapter_init", init]
        one_lora = os.path.join(tmp, "one_lora")
        finetune(fin, None, None, qwen3, data, one_lora, lora_args, lr=1e-2)
        tp_lora = os.path.join(tmp, "tp_lora")
        finetune(fin, launch, tp_yaml, qwen3, data, tp_lora, lora_args + vp, lr=1e-2)
        compare("lora tp_size 2 (Qwen3: q/k/v/o/gate/up/down adapters split with their layers; untied head split "
                "over the vocabulary, fused loss)", one_lora, tp_lora, "adapter", "adapter_model.safetensors", "")

        one3 = os.path.join(tmp, "one_qwen3")
        finetune(fin, None, None, qwen3, data, one3, [])
        tp3 = os.path.join(tmp, "tp_qwen3")
        # DeepSpeed's key in the user's file (no --vocab_parallel): the untied head split, the embedding whole.
        with_key = dict(unclipped, tensor_parallel=dict(unclipped["tensor_parallel"], vocab_parallel_lm_head=True))
        ds_key_yaml = write_yaml(tmp, "autotp_vp_key.yaml", "distributed_type: DEEPSPEED\n" + head +
                                 "deepspeed_config:\n  deepspeed_config_file: " +
                                 write_yaml(tmp, "ds_vp_key.json", json.dumps(with_key)) + "\n")
        run3 = finetune(fin, launch, ds_key_yaml, qwen3, data, tp3, ["--fused_linear_cross_entropy", "false"])
        compare("qwen3 autotp 2 (q/k norms, untied lm_head split over the vocabulary by DeepSpeed's "
                "tensor_parallel.vocab_parallel_lm_head: true, embed_tokens whole, unfused loss; the file, "
                "gradient_clipping auto)", one3, tp3, "model", "model.safetensors", "")
        whole3, held3 = slice_bytes(qwen3, False, tp=1, elements=True), parameters(run3)
        want3 = slice_bytes(qwen3, True, vocab=("lm_head",), elements=True)
        got3, bytes3 = loaded_bytes(run3), slice_bytes(qwen3, True, vocab=("lm_head",))
        check(held3 == want3 and bytes3 <= got3 <= bytes3 * 1.01 + 4096,
              f"qwen3 autotp 2, vocab_parallel_lm_head: rank 0 holds {held3} of the {whole3} parameters "
              f"(expected {want3}: half of the projections and of lm_head, embed_tokens whole) and read "
              f"{got3} bytes (expected {bytes3})")
        reloads("the untied vocabulary-parallel run", one3, tp3, fast)

        r = finetune(fin, launch, tp_yaml, bad, data, os.path.join(tmp, "bad"), vp, steps=1, check_rc=False)
        said = all(w in (r.stdout + r.stderr) for w in ("num_key_value_heads 1", "vocab_size 265",
                                                         "tensor-parallel size 2"))
        if r.returncode == 0 or not said:
            print((r.stdout + r.stderr)[-1500:])
        check(r.returncode != 0 and said, "refusal: 1 key/value head and vocab_size 265 over tp 2 (vocab-parallel) "
              "stop with one error naming num_key_value_heads 1, vocab_size 265 and the tensor-parallel size 2")
        print(f"time {time.time() - t0:.1f} s")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if FAILED:
        print(f"autotp equivalence: {len(FAILED)} checks failed")
        return 1
    print("autotp equivalence: all equal")
    return 0


if __name__ == "__main__":
    sys.exit(main())
