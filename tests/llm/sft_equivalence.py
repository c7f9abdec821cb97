#!/usr/bin/env python3
"""Issue 51's "Equal to the Python stack": examples/llm/finetune against TRL's SFTTrainer over transformers +
PEFT (+ bitsandbytes for QLoRA), on a tiny Qwen2 and a byte-level BPE tokenizer made here, with the Qwen2.5
chat template and a conversational JSONL whose rows differ in length (padding and per-rank label counts
differ: Hugging Face's num_items_in_batch).

  sft_equivalence.py FINETUNE ACCEL_LAUNCH CONFIG_TEMPLATES_DIR QWEN2_5_JINJA

Checks (each prints one line; the last line "sft equivalence: all equal" only when every check passed):
  lora   LoRA r 8 on q/k/v/o, dropout 0, AdamW + linear warmup, clipping 1.0: SFTTrainer + PEFT from an adapter
         initialised by PEFT and saved; finetune --adapter_init from the same files. Gradient accumulation 1 (20
         steps) and 2 (8), and all-linear (every Linear but lm_head) with accumulation 1 (20 steps). Per-step
         losses within 1e-4, trained adapters within 1e-5 (same keys); PeftModel.from_pretrained loads our
         adapter (logits within 1e-4 of PEFT's trained model); our load_adapter of PEFT's trained adapter,
         merged and saved (--save_merged at learning rate 0), gives PEFT's logits in transformers (1e-4).
  tied   lora_tied_embeddings.py: LoRA + modules_to_save [embed_tokens] on this tied model, PEFT's
         ensure_weight_tying false (its default: the head keeps the original weight, frozen) and true, 6 steps
         each: losses, adapter files and config, each side loading the other's adapter, the merged model's
         tie_word_embeddings and logits, generate --adapter.
  full   full fine-tuning, 20 steps (accumulation 2), the same (losses 1e-4, model tensors 1e-5).
         --bf16 true (CPU autocast, float32 master weights), 3 steps: the fused loss equals the unfused one
         (first step 1e-5, then 1e-3: bf16 rounding of the head's gradient products), off float32 by bf16 rounding.
  ranks  accel-launch 2 ranks x half the batch on ddp_cpu, zero_stage2, zero_stage3, fsdp_full_shard equal
         one process: losses within 1e-5, saved adapter / model within 1e-6; ZeRO-3's --save_merged model (merged
         from the state gathered to the main process) equals PEFT's merge_and_unload of the one-process adapter.
  bf16   --dtype bfloat16 on a bf16 checkpoint: --save_merged under ZeRO-3 (bf16 adapters, TRL's
         autocast_adapter_dtype=False) and in one process (float32 adapters, PEFT's default) bit for bit against
         PEFT's merge_and_unload with the same flag; LoRA 6 steps against SFTTrainer + PEFT with float32
         adapters (losses 1e-3 and closer than to PEFT's bf16 adapters, adapter file float32 within 5e-3,
         PeftModel.from_pretrained logits within 2 bf16 ulps), and FULL_SHARD on 2 ranks equal one process
         (losses 1e-3, adapter 2e-3); LoRA + modules_to_save [embed_tokens] on FULL_SHARD and DDP (float32
         and bf16: float32 adapters beside the bf16 embedding copy) equal one process.
  options, ranks vs SFTTrainer: full fine-tuning with weight decay, cosine_with_min_lr, a warmup ratio,
         packing, evaluation every 3 steps with dataloader_drop_last, the logged learning rates; 2 ranks
         against SFTTrainer on 2 forked Gloo ranks with average_tokens_across_devices true and false.
  qlora  load_in_4bit (NF4, nested) + LoRA against transformers' BitsAndBytesConfig + PEFT on bitsandbytes'
         CPU Linear4bit (adapters kept in fp32: TRL 1.16 would make them bf16), 8 steps: with bitsandbytes given
         the nearest 8-bit absmax codes (as accel::quant picks them; its CPU search takes a neighbour in a few
         blocks) losses within 1e-4 and adapters within 1e-5; with each library's own codes losses within 1e-4.
  readme the README's `accel-launch train -t full finetune --model_name_or_path DIR --dataset FILE` with the
         type's shipped files (eval_strategy: epoch, no --eval_dataset) on a bf16 checkpoint: it trains;
         --dtype auto keeps bf16 and --dtype float32 saves float32 with a config.json saying so (transformers
         reloads each in the dtype its own --dtype would give).
  types  the other six types with one command each (accel-launch train -t TYPE finetune, the shipped files), one
         step on 2 ranks: the adapter (lora, qlora, minimal; r as TYPE.model.yaml) or the model (deepspeed,
         stage2_offload, stage3) is saved, trained by the step, with the tokenizer and the model's own chat
         templates (additional_chat_templates/ too); -t lora --assistant_only_loss on TRL's marker-less
         qwen2_5.jinja logs the variant SFTTrainer swaps in and warns as TRL's stop-token check says.
  vocab  a tokenizer with ids past config.json's vocab_size (transformers: IndexError in the embedding): the
         recipe refuses before training, naming vocab_size, the id and the fix.
  options full fine-tuning with weight_decay 0.5 (none on biases and norms), cosine_with_min_lr, warmup_steps 0.2
         (a ratio), packing (bfd, padding-free), accumulation 2, eval_strategy steps on a packed eval set: losses
         (1e-4), model (1e-5) and every eval_loss (1e-4, the last step's too) equal SFTTrainer's.
  ranks vs SFTTrainer  ddp_cpu 2 ranks against SFTTrainer on 2 ranks (forked as torchrun starts them, Gloo) on
         completion-only data with very different label counts per rank, accumulation 2,
         average_tokens_across_devices true and false: losses 1e-4, model 1e-5.
Exit 77 when trl / peft / transformers / bitsandbytes are not importable.
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
    from peft import AutoPeftModelForCausalLM, LoraConfig, PeftModel, get_peft_model
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
    from trl import SFTConfig, SFTTrainer
    import bitsandbytes  # noqa: F401
    import datasets
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
except ImportError as e:  # pragma: no cover
    print(f"sft equivalence: skipped ({e})")
    sys.exit(77)

torch.set_num_threads(1)
datasets.disable_progress_bars()
SEED = 42
FULL_STEPS = 20  # full fine-tuning's steps (issue 51's count; accumulation 2: 3.3 epochs of 48 rows)
LORA = dict(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
FAILED = []


def check(ok, line):
    print(("ok    " if ok else "FAIL  ") + line, flush=True)
    if not ok:
        FAILED.append(line)


# ---- the tiny model, tokenizer and data ---------------------------------------------------------------------
def make(out, jinja):
    pat = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
           r"""\s*[\r\n]+|\s+(?!\S)|\s+""")
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(pat), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    rng = random.Random(0)
    words = "the a cat dog sum of plus minus is what number tell me please quickly answer".split()
    rows = []
    for i in range(48):  # 1-3 turns, an optional system prompt, answers of 1-12 words: lengths ~25-150 tokens
        msgs = [{"role": "system", "content": "You add numbers."}] if i % 3 == 0 else []
        for _ in range(rng.randint(1, 3)):
            a, b = rng.randint(0, 99), rng.randint(0, 99)
            msgs.append({"role": "user", "content": f"What is {a} plus {b}?"})
            tail = " ".join(rng.choice(words) for _ in range(rng.randint(0, 11)))
            msgs.append({"role": "assistant", "content": f"{a} plus {b} is {a + b}. {tail}".strip()})
        rows.append({"messages": msgs})
    text = [m["content"] for r in rows for m in r["messages"]] * 3
    tok.train_from_iterator(text, trainers.BpeTrainer(
        vocab_size=260, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = open(jinja).read()
    fast.save_pretrained(out)
    torch.manual_seed(0)
    # Every projection's input is a multiple of 64 wide: bitsandbytes 0.50.2's CPU dequantize_4bit of a 2-d
    # weight with rows shorter than its 64-value blocks is wrong (32 x 32: max error 0.127 where the NF4 codes,
    # equal to accel::quant's, give 0.041; the flattened tensor dequantises right), and its no-grad CPU forward
    # raises on such a layer (_convert_weight_packed_for_cpu: "shape '[32, 0]' is invalid").
    cfg = Qwen2Config(vocab_size=len(fast), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=True, eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id)
    model = Qwen2ForCausalLM(cfg)
    with torch.no_grad():  # larger weights than the 0.02 init, so that training moves the loss visibly
        for p in model.parameters():
            p.normal_(0, 0.1) if p.dim() == 2 else None
        for layer in model.model.layers:  # q/k/v biases (zeros at init) non-zero, norms not all ones
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.1)
            layer.input_layernorm.weight.normal_(1, 0.1)
    model.save_pretrained(out)
    data = os.path.join(out, "chat.jsonl")
    with open(data, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    lengths = [len(fast(fast.apply_chat_template(r["messages"], tokenize=False))["input_ids"]) for r in rows]
    return fast, data, lengths


# ---- Python: TRL's SFTTrainer ------------------------------------------------------------------------------
class Recording(SFTTrainer):
    """SFTTrainer keeping every micro-batch's training_step value: their sum over a step is the step's logged
    loss unrounded (transformers 5 logs tr_loss / steps; with logging_steps 1 one step)."""

    def training_step(self, *a, **k):
        loss = super().training_step(*a, **k)
        self.micro.append(loss.item())
        return loss


def hf_train(model, tok, data, out, batch, accum, steps, lr, eval_data=None, history=None, **extra):
    """`extra`: more SFTConfig keys (they win over these); `history`: a list given the trainer's log_history.
    On 2 ranks (fork_ranks) the logged losses are the ranks' mean (each rank's micro-batches differ)."""
    keys = dict(output_dir=out, per_device_train_batch_size=batch, gradient_accumulation_steps=accum,
                max_steps=steps, learning_rate=lr, lr_scheduler_type="linear", warmup_steps=2,
                weight_decay=0.0, max_grad_norm=1.0, seed=SEED, logging_steps=1, save_strategy="no",
                report_to="none", use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False,
                disable_tqdm=True, max_length=1024, dataloader_num_workers=0)
    args = SFTConfig(**dict(keys, **extra))
    ds = datasets.load_dataset("json", data_files=data, split="train")
    ev = datasets.load_dataset("json", data_files=eval_data, split="train") if eval_data else None
    # TRL 1.16's SFTTrainer turns a quantised model's trainable parameters into bf16 (QLoRA's paper); our recipe
    # trains them in the model's dtype (fp32 here), as transformers' Trainer + PEFT do: put them back, unrounded.
    fp32 = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    trainer = Recording(model=model, args=args, train_dataset=ds, eval_dataset=ev, processing_class=tok)
    for n, p in model.named_parameters():
        if n in fp32:
            p.data = fp32[n]
    trainer.micro = []
    trainer.train()
    if history is not None:
        history.extend(trainer.state.log_history)
    logged = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    if trainer.args.world_size > 1:
        return logged
    losses = [sum(trainer.micro[i:i + accum]) for i in range(0, len(trainer.micro), accum)]
    assert len(losses) == steps and all(abs(a - b) < 1e-6 for a, b in zip(losses, logged)), (losses, logged)
    return losses


# ---- ours: examples/llm/finetune ---------------------------------------------------------------------------
def ours(bin_, launch, cfg, model_dir, data, out, batch, accum, steps, lr, extra):
    cmd = [bin_, "--model_name_or_path", model_dir, "--dataset", data, "--output_dir", out,
           "--per_device_train_batch_size", str(batch), "--gradient_accumulation_steps", str(accum),
           "--max_steps", str(steps), "--learning_rate", repr(lr), "--lr_scheduler_type", "linear",
           "--warmup_steps", "2", "--weight_decay", "0", "--max_grad_norm", "1.0", "--seed", str(SEED),
           "--logging_steps", "1", "--save_strategy", "no", "--report_to", "jsonl", *extra]
    if launch:
        cmd = [launch, "launch", "--config_file", cfg, *cmd]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        print(" ".join(cmd))
        print(r.stdout[-3000:], r.stderr[-3000:])
        raise RuntimeError(f"finetune failed ({r.returncode})")
    return r


def our_rates(out):
    with open(os.path.join(out, "runs", "trainer", "metrics.jsonl")) as f:
        return [r["train/learning_rate"] for r in map(json.loads, f) if "train/loss" in r]


def our_losses(out):
    with open(os.path.join(out, "runs", "trainer", "metrics.jsonl")) as f:
        return [r["train/loss"] for r in map(json.loads, f) if "train/loss" in r]


def max_diff(a, b):
    return max(abs(x - y) for x, y in zip(a, b)) if len(a) == len(b) else float("inf")


def tensors_diff(a, b):
    """Largest absolute difference over two state dicts with the same keys (inf when the keys differ)."""
    if set(a) != set(b):
        print("  keys differ:", sorted(set(a) ^ set(b))[:6])
        return float("inf")
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def our_model_tensors(d):
    return load_file(os.path.join(d, "model.safetensors"))


def logits_of(model, tok, rows):
    texts = [tok.apply_chat_template(r["messages"], tokenize=False) for r in rows]
    tok.padding_side = "right"
    enc = tok(texts, return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model(**enc).logits
    return out[enc["attention_mask"].bool()]


def model_config(tmp, kind):
    """TRL's ModelConfig keys in a file, as TYPE.model.yaml (the command line takes the same keys:
    --lora_target_modules "[q_proj, k_proj]" reaches the program intact, model_arguments_test.cpp)."""
    path = os.path.join(tmp, f"{kind}.model.yaml")
    with open(path, "w") as f:
        f.write(f"use_peft: true\nlora_r: {LORA['r']}\nlora_alpha: {LORA['lora_alpha']}\nlora_dropout: 0.0\n"
                + ("lora_target_modules: all-linear\n" if kind == "lora_all" else
                   f"lora_target_modules: [{', '.join(LORA['target_modules'])}]\n"))
        if kind == "qlora":
            f.write("load_in_4bit: true\nbnb_4bit_quant_type: nf4\nuse_bnb_nested_quant: true\n")
    return path


# ---- the checks --------------------------------------------------------------------------------------------
def lora_rows(fin, tmp, base, tok, data, rows):
    """LoRA, accumulation 1 and 2: losses, adapters, each side loading the other's adapter."""
    results = {}
    init = os.path.join(tmp, "adapter_init")
    torch.manual_seed(1)
    peft = get_peft_model(AutoModelForCausalLM.from_pretrained(base), LoraConfig(task_type="CAUSAL_LM", **LORA))
    peft.save_pretrained(init)
    lora_args = ["--model_config", model_config(tmp, "lora"), "--adapter_init", init]
    for accum, steps in [(1, 20), (2, 8)]:  # 20: the count (1.7 epochs: the second in HF's order)
        peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), init, is_trainable=True)
        hf_out = os.path.join(tmp, f"hf_lora_{accum}")
        ref = hf_train(peft, tok, data, hf_out, 4, accum, steps, 1e-2)
        peft.save_pretrained(os.path.join(hf_out, "adapter"))
        out = os.path.join(tmp, f"our_lora_{accum}")
        ours(fin, None, None, base, data, out, 4, accum, steps, 1e-2, lora_args)
        got = our_losses(out)
        d = max_diff(ref, got)
        check(d <= 1e-4, f"lora accumulation {accum}: {steps} step losses equal SFTTrainer + PEFT's "
              f"(max |diff| {d:.2e} <= 1e-4; first {ref[0]:.5f}, last {ref[-1]:.5f} / {got[-1]:.5f})")
        ad = tensors_diff(load_file(os.path.join(hf_out, "adapter", "adapter_model.safetensors")),
                          load_file(os.path.join(out, "adapter", "adapter_model.safetensors")))
        check(ad <= 1e-5, f"lora accumulation {accum}: adapter files have PEFT's keys, tensors within 1e-5 "
              f"(max |diff| {ad:.2e})")
        results[accum] = (ref, hf_out, out)
    # all-linear (PEFT's shorthand: every Linear but lm_head), accumulation 1, 20 steps.
    init_all = os.path.join(tmp, "adapter_init_all")
    torch.manual_seed(2)
    cfg = dict(LORA, target_modules="all-linear")
    get_peft_model(AutoModelForCausalLM.from_pretrained(base), LoraConfig(task_type="CAUSAL_LM", **cfg)) \
        .save_pretrained(init_all)
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), init_all, is_trainable=True)
    hf_out = os.path.join(tmp, "hf_lora_all")
    ref = hf_train(peft, tok, data, hf_out, 4, 1, 20, 1e-2)
    peft.save_pretrained(os.path.join(hf_out, "adapter"))
    out = os.path.join(tmp, "our_lora_all")
    ours(fin, None, None, base, data, out, 4, 1, 20, 1e-2,
         ["--model_config", model_config(tmp, "lora_all"), "--adapter_init", init_all])
    d = max_diff(ref, our_losses(out))
    ad = tensors_diff(load_file(os.path.join(hf_out, "adapter", "adapter_model.safetensors")),
                      load_file(os.path.join(out, "adapter", "adapter_model.safetensors")))
    n = len(load_file(os.path.join(out, "adapter", "adapter_model.safetensors")))
    check(d <= 1e-4 and ad <= 1e-5, f"lora all-linear accumulation 1: 20 step losses equal SFTTrainer + PEFT's "
          f"(max |diff| {d:.2e} <= 1e-4), adapter ({n} tensors) within 1e-5 ({ad:.2e})")
    # Each side loads the other's adapter (accumulation 1's).
    _, hf_out, out = results[1]
    theirs = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), os.path.join(hf_out, "adapter"))
    mine = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), os.path.join(out, "adapter"))
    ld = (logits_of(theirs, tok, rows) - logits_of(mine, tok, rows)).abs().max().item()
    check(ld <= 1e-4, f"lora: PeftModel.from_pretrained loads our adapter, logits within 1e-4 of PEFT's "
          f"trained model (max |diff| {ld:.2e})")
    # AutoPeftModelForCausalLM finds the base through adapter_config.json's base_model_name_or_path, which
    # PEFT writes (the path the base was loaded from); with null it looks on the Hub.
    names = [json.load(open(os.path.join(d, "adapter", "adapter_config.json")))["base_model_name_or_path"]
             for d in (hf_out, out)]
    try:
        auto = AutoPeftModelForCausalLM.from_pretrained(os.path.join(out, "adapter"))
        ad = (logits_of(auto, tok, rows) - logits_of(mine, tok, rows)).abs().max().item()
    except OSError as e:
        ad = f"{type(e).__name__}: {str(e)[:80]}"
    check(names[0] == names[1] and isinstance(ad, float) and ad <= 1e-6,
          f"lora: our adapter_config.json's base_model_name_or_path is PEFT's ({names[1]!r} / {names[0]!r}), "
          f"so AutoPeftModelForCausalLM loads it (logits {ad})")
    # Ours loads PEFT's trained adapter (load_adapter), learning rate 0 for one step, merged and saved.
    merged = os.path.join(tmp, "our_loads_peft")
    ours(fin, None, None, base, data, merged, 4, 1, 1, 0.0,
         lora_args[:-1] + [os.path.join(hf_out, "adapter"), "--save_merged"])
    m = AutoModelForCausalLM.from_pretrained(os.path.join(merged, "model"))
    md = (logits_of(theirs, tok, rows) - logits_of(m, tok, rows)).abs().max().item()
    return results, md


def full_row(fin, tmp, base, tok, data):
    """Full fine-tuning, accumulation 2: losses and the saved model."""
    model = AutoModelForCausalLM.from_pretrained(base)
    hf_out = os.path.join(tmp, "hf_full")
    ref = hf_train(model, tok, data, hf_out, 4, 2, FULL_STEPS, 1e-3)
    model.save_pretrained(os.path.join(hf_out, "model"))
    out = os.path.join(tmp, "our_full")
    ours(fin, None, None, base, data, out, 4, 2, FULL_STEPS, 1e-3, [])
    got = our_losses(out)
    d = max_diff(ref, got)
    check(d <= 1e-4, f"full accumulation 2: {FULL_STEPS} step losses equal SFTTrainer's (max |diff| {d:.2e} <= 1e-4; "
          f"first {ref[0]:.5f}, last {ref[-1]:.5f} / {got[-1]:.5f})")
    md = tensors_diff(our_model_tensors(os.path.join(hf_out, "model")),
                      our_model_tensors(os.path.join(out, "model")))
    check(md <= 1e-5, f"full: saved model has transformers' keys, tensors within 1e-5 (max |diff| {md:.2e})")
    bf16_row(fin, tmp, base, data, ref)
    return out


def bf16_row(fin, tmp, base, data, ref):
    """--bf16 true (mixed_precision bf16: CPU autocast over float32 master weights), full, 3 steps: the fused
    loss (the default) gives the unfused loss's steps (the first, before any update (warmup), to float32
    summation order; then bf16 rounding of the head's gradient products: 1e-3 for steps moving the loss ~1e-1),
    and its first loss is off the float32 one (SFTTrainer's) by bf16 rounding (autocast was on)."""
    got = {}
    for fused in ("true", "false"):
        out = os.path.join(tmp, f"our_full_bf16_{fused}")
        ours(fin, None, None, base, data, out, 4, 2, 3, 1e-3, ["--bf16", "true", "--fused_linear_cross_entropy", fused])
        got[fused] = our_losses(out)
    d0, d = abs(got["true"][0] - got["false"][0]), max_diff(got["true"], got["false"])
    off = abs(got["true"][0] - ref[0])
    check(d0 <= 1e-5 and d <= 1e-3 and 1e-5 < off <= 2e-2,
          f"full --bf16 true: fused loss's 3 steps equal the unfused loss's (first {d0:.2e} <= 1e-5, max |diff| "
          f"{d:.2e} <= 1e-3); first step off float32 by {off:.2e} (bf16 autocast, in (1e-5, 2e-2])")


def rank_rows(fin, launch, templates, tmp, base, data, lora, full):
    """2 ranks x half the batch on each backend row against one process of ours."""
    _, _, lora_one = lora[2]
    init = os.path.join(tmp, "adapter_init")
    lora_args = ["--model_config", model_config(tmp, "lora"), "--adapter_init", init]
    for cfg, kind in [("ddp_cpu", "lora"), ("zero_stage2", "full"), ("zero_stage3", "lora"),
                      ("fsdp_full_shard", "full")]:
        one = lora_one if kind == "lora" else full
        steps, lr = (8, 1e-2) if kind == "lora" else (FULL_STEPS, 1e-3)
        out = os.path.join(tmp, f"ranks_{cfg}")
        # ZeRO-3 + LoRA (-t minimal's layout) also writes the merged model: the parameters are sharded there, so
        # the merge cannot be done in place on a rank (it once wrote the unmerged base with the adapters' keys).
        merged = ["--save_merged"] if cfg == "zero_stage3" else []
        ours(fin, launch, os.path.join(templates, cfg + ".yaml"), base, data, out, 2, 2, steps, lr,
             (lora_args if kind == "lora" else []) + merged)
        d = max_diff(our_losses(one), our_losses(out))
        sub = "adapter" if kind == "lora" else "model"
        name = "adapter_model.safetensors" if kind == "lora" else "model.safetensors"
        td = tensors_diff(load_file(os.path.join(one, sub, name)), load_file(os.path.join(out, sub, name)))
        check(d <= 1e-5 and td <= 1e-6, f"ranks {cfg} ({kind}, 2 x batch 2, accumulation 2): losses equal one "
              f"process x batch 4 (max |diff| {d:.2e} <= 1e-5), saved {sub} (max |diff| {td:.2e} <= 1e-6)")
        # The logged rates too: under the ZeRO templates (no DeepSpeed JSON blocks) HF's Trainer steps its own
        # schedule and logs the rate each step used, as in one process (it once logged the next step's).
        lr_one, lr_ranks = our_rates(one), our_rates(out)
        check(lr_one == lr_ranks, f"ranks {cfg}: the logged learning rates equal one process's {lr_ranks[:3]}...")
        if merged:
            want = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base),
                                             os.path.join(one, "adapter")).merge_and_unload().state_dict()
            got = our_model_tensors(os.path.join(out, "model"))
            got.setdefault("lm_head.weight", got.get("model.embed_tokens.weight"))  # tied: written once
            md = tensors_diff(want, got)
            check(md <= 1e-5, f"ranks {cfg} --save_merged: model/ holds the merged weights under transformers' "
                  f"keys only, equal to PEFT's merge_and_unload of the one-process adapter (max |diff| {md:.2e} "
                  f"<= 1e-5)")
    bf16_merge_rows(fin, launch, templates, tmp, base, data)


def bf16_merge_rows(fin, launch, templates, tmp, base, data):
    """bf16 (issue 51 review): --save_merged under ZeRO-3 (LoraModel::merged_state of the gathered state) and in
    one process (LoraModel::merge, the same function) merges with PEFT's arithmetic
    (peft/tuners/lora/layer.py Linear.get_delta_weight + merge): bf16 adapters on the CPU, B @ A and
    the scaling in float32, rounded to bf16, then added to W (a second rounding). ZeRO-3 keeps bf16 adapters
    (TRL's autocast_adapter_dtype=False there): bit for bit against PEFT with that flag; one process makes them
    float32 (PEFT's default, holding the file's bf16 values; W + delta rounded once): bit for bit against PEFT's
    default. One step at learning rate 0 from an adapter with a random B (PEFT's init_lora_weights=False)."""
    bf16 = os.path.join(tmp, "base_bf16_merge")
    AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16).save_pretrained(bf16)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if os.path.exists(os.path.join(base, name)):
            shutil.copy(os.path.join(base, name), bf16)
    init_bf16 = os.path.join(tmp, "adapter_init_bf16")
    torch.manual_seed(5)
    get_peft_model(AutoModelForCausalLM.from_pretrained(bf16, dtype=torch.bfloat16),
                   LoraConfig(task_type="CAUSAL_LM", init_lora_weights=False, **LORA),
                   autocast_adapter_dtype=False).save_pretrained(init_bf16)
    base_sd = AutoModelForCausalLM.from_pretrained(bf16, dtype=torch.bfloat16).state_dict()
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(bf16, dtype=torch.bfloat16), init_bf16,
                                     autocast_adapter_dtype=False)
    want = peft.merge_and_unload().state_dict()
    want_fp32 = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(bf16, dtype=torch.bfloat16),
                                          init_bf16).merge_and_unload().state_dict()
    # How many merged entries one rounding (W + delta in float32, rounded once) would have got wrong: the
    # check can tell the two arithmetics apart only if some.
    a = load_file(os.path.join(init_bf16, "adapter_model.safetensors"))
    once = 0
    for k in want:
        if k.endswith("proj.weight") and f"base_model.model.{k[:-7]}.lora_A.weight" in a:
            A, B = (a[f"base_model.model.{k[:-7]}.lora_{x}.weight"].float() for x in "AB")
            one = (base_sd[k].float() + (B @ A) * (LORA["lora_alpha"] / LORA["r"])).to(torch.bfloat16)
            once += int((one != want[k]).sum())
    # ZeRO-3 (the gathered state's merge), and one process (the in-memory merge of merge_and_unload).
    for label, run in (("ranks zero_stage3", launch), ("one process", None)):
        out = os.path.join(tmp, f"merge_bf16_{'zero3' if run else 'one'}")
        ours(fin, run, os.path.join(templates, "zero_stage3.yaml"), bf16, data, out, 2 if run else 4, 1, 1, 0.0,
             ["--model_config", model_config(tmp, "lora"), "--adapter_init", init_bf16, "--dtype", "bfloat16",
              "--save_merged"])
        got = our_model_tensors(os.path.join(out, "model"))
        got.setdefault("lm_head.weight", got.get("model.embed_tokens.weight"))
        same = set(want) == set(got) and all(want[k].dtype == got[k].dtype == torch.bfloat16 for k in want)
        # ZeRO-3: TRL passes autocast_adapter_dtype=False (bf16 adapters, two roundings); one process: PEFT's
        # default (float32 adapters holding the file's bf16 values, W + delta rounded once).
        ref = want if run else want_fp32
        differ = sum(int((ref[k] != got[k]).sum()) for k in ref) if same else -1
        check(differ == 0 and once > 0, f"{label} --save_merged --dtype bfloat16: the merged model equals "
              f"PEFT's merge_and_unload (autocast_adapter_dtype {not run}) bit for bit ({len(want)} bf16 tensors, "
              f"{differ} entries differ; {once} merged entries differ between bf16 and float32 adapters)")
    bf16_lora_row(fin, launch, templates, tmp, bf16, data)
    modules_to_save_ranks_row(fin, launch, templates, tmp, bf16, data)



def modules_to_save_ranks_row(fin, launch, templates, tmp, bf16, data):
    """LoRA with modules_to_save [embed_tokens] on the tied model, on FULL_SHARD's template (which asks for
    fsdp_cpu_ram_efficient_loading) and on DDP, 2 ranks x batch 2 against one process x batch 4, 3 steps, in
    float32 (equal within 1e-5 / 1e-6) and in bf16 (`--dtype bfloat16`: float32 adapters beside the bf16 copy
    of the embedding, as PEFT leaves modules_to_save in the model's dtype; DDP buckets each dtype apart, the
    Trainer's groups are one dtype each; bf16's bounds: Adam moves an entry whose gradient is near zero by up
    to the learning rate either way, so 3 steps at 1e-3 bound the tensors by 3e-3 only, which is loose: the bf16
    half checks the dtypes, that both run, and the losses within 1e-3, measured 2e-5). The sharded loading falls
    back to a whole load (get_peft_model copies the loaded embedding). Before: FULL_SHARD failed reading an
    empty parameter; DDP refused the mixed dtypes."""
    cfg = os.path.join(tmp, "lora_mts.model.yaml")
    with open(model_config(tmp, "lora")) as f, open(cfg, "w") as g:
        g.write(f.read() + "lora_modules_to_save: [embed_tokens]\n")
    for dtype, loss_tol, tensor_tol in (("float32", 1e-5, 1e-6), ("bfloat16", 1e-3, 3e-3)):
        flags = ["--model_config", cfg, "--dtype", dtype]
        one = os.path.join(tmp, f"mts_one_{dtype}")
        ours(fin, None, None, bf16, data, one, 4, 1, 3, 1e-3, flags)
        A = load_file(os.path.join(one, "adapter", "adapter_model.safetensors"))
        want_dtypes = ["torch.float32"] if dtype == "float32" else ["torch.bfloat16", "torch.float32"]
        for name in ("fsdp_full_shard", "ddp_cpu"):
            out = os.path.join(tmp, f"mts_{name}_{dtype}")
            ours(fin, launch, os.path.join(templates, f"{name}.yaml"), bf16, data, out, 2, 1, 3, 1e-3, flags)
            B = load_file(os.path.join(out, "adapter", "adapter_model.safetensors"))
            dtypes = sorted({str(t.dtype) for t in B.values()})
            rd = max_diff(our_losses(one), our_losses(out))
            rt = tensors_diff(A, B) if set(A) == set(B) else float("inf")
            check(rd <= loss_tol and rt <= tensor_tol and dtypes == want_dtypes,
                  f"ranks {name} lora + modules_to_save [embed_tokens] --dtype {dtype}: 3 step losses equal one "
                  f"process (max |diff| {rd:.2e} <= {loss_tol:g}), adapter {dtypes} within {tensor_tol:g} ({rt:.2e})")


def bf16_lora_row(fin, launch, templates, tmp, bf16, data):
    """`finetune --dtype bfloat16` LoRA on a bf16 checkpoint against SFTTrainer + PEFT (bf16=False: no autocast;
    the base loaded in bf16): PEFT's default autocast_adapter_dtype makes the adapters float32, and so does
    ours (TRL keeps bf16 adapters only under ZeRO-3). 6 steps from the same float32 adapter (random B). The two
    bf16 forwards (transformers' and ours) round attention, norms and the head differently, so the bounds are
    bf16's: losses within 1e-3 and closer to PEFT's float32 adapters than to PEFT's bf16 ones
    (autocast_adapter_dtype=False, also run), the saved adapter float32, within 5e-3 and closer to PEFT's
    float32 adapter than to its bf16 one; PeftModel.from_pretrained of ours on the bf16 base: logits within 2
    bf16 ulps (of values 4-8) of PEFT's trained model. Then FULL_SHARD on 2 ranks (float32 adapters with the
    frozen bf16 base in each unit) equals our one process within bf16's bounds."""
    tok = PreTrainedTokenizerFast.from_pretrained(bf16)
    rows = [json.loads(l) for l in open(data)][:6]
    init = os.path.join(tmp, "adapter_init_fp32_randb")
    torch.manual_seed(6)
    get_peft_model(AutoModelForCausalLM.from_pretrained(bf16, dtype=torch.float32),
                   LoraConfig(task_type="CAUSAL_LM", init_lora_weights=False, **LORA)).save_pretrained(init)
    res = {}
    for autocast in (True, False):
        peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(bf16, dtype=torch.bfloat16), init,
                                         is_trainable=True, autocast_adapter_dtype=autocast)
        hf_out = os.path.join(tmp, f"hf_lora_bf16_{autocast}")
        res[autocast] = (hf_train(peft, tok, data, hf_out, 4, 1, 6, 1e-2), peft)
        peft.save_pretrained(os.path.join(hf_out, "adapter"))
    (ref, theirs), (ref16, _) = res[True], res[False]
    out = os.path.join(tmp, "our_lora_bf16")
    ours(fin, None, None, bf16, data, out, 4, 1, 6, 1e-2,
         ["--model_config", model_config(tmp, "lora"), "--adapter_init", init, "--dtype", "bfloat16"])
    got = our_losses(out)
    d, d16 = max_diff(ref, got), max_diff(ref16, got)
    A = load_file(os.path.join(tmp, "hf_lora_bf16_True", "adapter", "adapter_model.safetensors"))
    A16 = load_file(os.path.join(tmp, "hf_lora_bf16_False", "adapter", "adapter_model.safetensors"))
    B = load_file(os.path.join(out, "adapter", "adapter_model.safetensors"))
    dtypes = sorted({str(t.dtype) for t in B.values()})
    ad, ad16 = tensors_diff(A, B), tensors_diff(A16, B)
    mine = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(bf16, dtype=torch.bfloat16),
                                     os.path.join(out, "adapter"))
    ld = (logits_of(theirs.eval(), tok, rows).float() - logits_of(mine, tok, rows).float()).abs().max().item()
    check(d <= 1e-3 and d < d16 and dtypes == ["torch.float32"] and ad <= 5e-3 and ad < ad16 and ld <= 6.25e-2,
          f"lora --dtype bfloat16: 6 step losses equal SFTTrainer + PEFT's with float32 adapters (max |diff| "
          f"{d:.2e} <= 1e-3, and closer than to PEFT's with bf16 adapters: {d16:.2e}), adapter saved {dtypes} "
          f"within 5e-3 ({ad:.2e}; of PEFT's bf16 adapters {ad16:.2e}), PeftModel.from_pretrained of it: logits "
          f"within 2 bf16 ulps of PEFT's trained model ({ld:.2e} <= 6.25e-2)")
    # FULL_SHARD on 2 ranks: float32 adapters and the frozen bf16 base in one unit (flats per dtype).
    two = os.path.join(tmp, "our_lora_bf16_fsdp")
    ours(fin, launch, os.path.join(templates, "fsdp_full_shard.yaml"), bf16, data, two, 2, 1, 6, 1e-2,
         ["--model_config", model_config(tmp, "lora"), "--adapter_init", init, "--dtype", "bfloat16"])
    C = load_file(os.path.join(two, "adapter", "adapter_model.safetensors"))
    rd, rt = max_diff(got, our_losses(two)), tensors_diff(B, C)
    check(rd <= 1e-3 and rt <= 2e-3 and all(t.dtype == torch.float32 for t in C.values()),
          f"ranks fsdp_full_shard lora --dtype bfloat16 (float32 adapters, bf16 base, 2 x batch 2): losses equal "
          f"one process (max |diff| {rd:.2e} <= 1e-3: bf16 rows padded to other lengths), adapter float32 "
          f"within 2e-3 ({rt:.2e})")


def readme_row(fin, launch, tmp, base, data):
    """The README's command as a new user types it (accel-launch train -t full, the type's shipped files, which
    set eval_strategy: epoch and metric_for_best_model: accuracy), on a bfloat16 checkpoint as the Hub ships
    them: it trains without --eval_dataset; --dtype auto loads the checkpoint's dtype, as TRL passes "auto" to
    from_pretrained; the saved config.json names the saved tensors' dtype, as save_pretrained writes it (a
    float32 run of a bf16 base must not reload in transformers as bf16)."""
    bf16 = os.path.join(tmp, "base_bf16")
    AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16).save_pretrained(bf16)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if os.path.exists(os.path.join(base, name)):
            shutil.copy(os.path.join(base, name), bf16)
    ref = {d: AutoModelForCausalLM.from_pretrained(bf16, dtype=d if d == "auto" else getattr(torch, d)).dtype
           for d in ("auto", "float32")}
    # --max_length None: TRL's parser gives None (no truncation; these rows are shorter than 1024 anyway).
    for dtype, cmd in [("auto", [launch, "train", "-t", "full", fin]), ("float32", [fin, "--max_length", "None"])]:
        out = os.path.join(tmp, f"readme_{dtype}")
        cmd = cmd + ["--model_name_or_path", bf16, "--dataset", data, "--output_dir", out, "--max_steps", "1",
                     "--per_device_train_batch_size", "2", "--dtype", dtype, "--report_to", "none"]
        r = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
        if r.returncode != 0:
            check(False, f"readme: {' '.join(cmd[:5])} ... --dtype {dtype} runs (exit {r.returncode}: "
                  f"{[l for l in (r.stderr + r.stdout).splitlines() if 'error' in l][-1:]})")
            continue
        saved = {t.dtype for t in load_file(os.path.join(out, "model", "model.safetensors")).values()}
        loaded = AutoModelForCausalLM.from_pretrained(os.path.join(out, "model")).dtype
        if dtype == "auto" and os.path.exists(os.path.join(os.path.dirname(fin), "generate")):
            # generate's default dtype is transformers 5's from_pretrained default: the config's (bf16 here).
            g = subprocess.run([os.path.join(os.path.dirname(fin), "generate"), "--model_name_or_path", bf16,
                                "--prompt", "What is", "--max_new_tokens", "2"], capture_output=True, text=True)
            check(g.returncode == 0 and f"runs in {str(ref['auto']).split('.')[-1].replace('bfloat16', 'BFloat16')}"
                  in g.stderr, f"generate: a bf16 checkpoint runs in transformers' default dtype ({ref['auto']}): "
                  f"{g.stderr.strip()[:100]!r}")
        check(saved == {ref[dtype]} and loaded == ref[dtype],
              f"readme: finetune --dtype {dtype} on a bf16 checkpoint{' (accel-launch train -t full)' if launch in cmd else ''}"
              f" saves {sorted(map(str, saved))}, transformers reloads it as {loaded} (transformers' --dtype "
              f"{dtype}: {ref[dtype]})")
    seven_types_row(fin, launch, tmp, base, data)


def seven_types_row(fin, launch, tmp, base, data):
    """Issue 51's "Done when": each of the other six types with one command (`-t full` is the row above), the
    type's three shipped files as they are (but --warmup_ratio 0, so that the one step has a nonzero rate), on the
    float32 checkpoint: one step on 2 ranks, and what the type ships: the PEFT adapter (lora, qlora, minimal:
    every tensor a LoRA matrix, r as TYPE.model.yaml says, lora_B trained off zero, the tokenizer beside it) or the
    model (deepspeed, stage2_offload, stage3: every tensor of the checkpoint, changed by the step), with the
    model's own chat templates."""
    base_model = load_file(os.path.join(base, "model.safetensors"))
    names = set(base_model)
    templates = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.pardir,
                             "config_templates", "trainer")
    # The base with a template set as transformers 5 saves one (chat_template.jinja, TRL's qwen2_5.jinja without
    # {% generation %} markers, and additional_chat_templates/tool_use.jinja): each type must save the model's
    # own set beside what it writes, as HF Trainer's processing_class.save_pretrained does, and the lora run under
    # --assistant_only_loss must render its data with the variant SFTTrainer swaps in (never saved), warning
    # about the stop token only when TRL's is_chat_template_stop_token_trained is False.
    from transformers import AutoTokenizer
    from trl.chat_template_utils import get_training_chat_template, is_chat_template_stop_token_trained
    tbase = os.path.join(tmp, "types_base")
    shutil.copytree(base, tbase)
    os.makedirs(os.path.join(tbase, "additional_chat_templates"))
    with open(os.path.join(tbase, "additional_chat_templates", "tool_use.jinja"), "w") as f:
        f.write("{{- 'tools: ' ~ (tools | length) }}")
    ttok = AutoTokenizer.from_pretrained(tbase)
    training = get_training_chat_template(ttok)
    trl_dir = os.path.join(os.path.dirname(sys.modules["trl"].__file__), "chat_templates")
    training_name = [n for n in sorted(os.listdir(trl_dir))
                     if open(os.path.join(trl_dir, n), encoding="utf-8").read() == training]
    stop_warning = not is_chat_template_stop_token_trained(ttok, chat_template=training)
    for t in ("lora", "qlora", "minimal", "deepspeed", "stage2_offload", "stage3"):
        out = os.path.join(tmp, f"type_{t}")
        cmd = [launch, "train", "-t", t, fin, "--model_name_or_path", tbase, "--dataset", data, "--output_dir", out,
               "--max_steps", "1", "--report_to", "none", "--warmup_ratio", "0"] + \
            (["--assistant_only_loss"] if t == "lora" else [])
        r = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
        if r.returncode != 0:
            check(False, f"types: accel-launch train -t {t} finetune runs (exit {r.returncode}: "
                  f"{(r.stderr + r.stdout).strip().splitlines()[-1:]})")
            continue
        saved_dir = os.path.join(out, "adapter" if t in ("lora", "qlora", "minimal") else "model")
        saved = AutoTokenizer.from_pretrained(saved_dir).chat_template
        check(saved == ttok.chat_template, f"types: -t {t} saves the model's chat templates as transformers loads "
              f"them ({sorted(saved) if isinstance(saved, dict) else 'one template'}; the model's: "
              f"{sorted(ttok.chat_template)})")
        if t == "lora":
            log = r.stdout + r.stderr
            swapped = training_name and f"so the data is rendered with TRL's {training_name[0]}" in log
            warned = "does not include the assistant turn's end-of-turn token" in log
            check(bool(swapped) and warned == stop_warning,
                  f"types: -t lora --assistant_only_loss on TRL's qwen2_5.jinja renders with SFTTrainer's variant "
                  f"({training_name}: {'logged' if swapped else 'NOT logged'}), stop-token warning "
                  f"{warned} as TRL's check says ({stop_warning})")
        if t in ("lora", "qlora", "minimal"):
            d = os.path.join(out, "adapter")
            rank = json.load(open(os.path.join(d, "adapter_config.json")))["r"]
            want = [l.split(":")[1].strip() for l in open(os.path.join(templates, f"{t}.model.yaml"))
                    if l.startswith("lora_r:")]
            adapter = load_file(os.path.join(d, "adapter_model.safetensors"))
            keys = set(adapter)
            # lora_B starts at zero: a nonzero one is the step taken (--warmup_ratio 0: the shipped 0.05 makes the
            # one step a warmup step at rate 0, which would train nothing)
            trained = any(v.abs().max().item() > 0 for k, v in adapter.items() if ".lora_B." in k)
            ok = (keys and all(".lora_A." in k or ".lora_B." in k for k in keys) and [str(rank)] == want
                  and os.path.exists(os.path.join(d, "tokenizer.json")) and trained)
            what = f"a PEFT adapter of {len(keys)} LoRA tensors, r {rank} (model.yaml: {want}), lora_B " + \
                ("trained" if trained else "still zero")
        else:
            d = os.path.join(out, "model")
            saved_model = load_file(os.path.join(d, "model.safetensors"))
            keys = set(saved_model)
            trained = any(not torch.equal(saved_model[k], base_model[k]) for k in keys & names)
            ok = keys == names and os.path.exists(os.path.join(d, "tokenizer.json")) and trained
            what = f"the model, {len(keys)} of the checkpoint's {len(names)} tensors, " + \
                ("changed" if trained else "unchanged")
        check(ok, f"types: accel-launch train -t {t} finetune (the shipped files) trains a step and saves {what}, "
              f"the tokenizer beside it")


def vocab_row(fin, tmp, base, data):
    """A tokenizer with more tokens than the model's embedding (tokens added without resize_token_embeddings):
    transformers fails in the embedding lookup ("IndexError: index out of range in self", checked here); the
    recipe refuses before training, naming config.json's vocab_size, the id and its token, and the fix."""
    small = os.path.join(tmp, "base_small_vocab")
    shutil.copytree(base, small)
    cfg = json.load(open(os.path.join(small, "config.json")))
    cfg["vocab_size"] = 200
    json.dump(cfg, open(os.path.join(small, "config.json"), "w"))
    sd = load_file(os.path.join(small, "model.safetensors"))
    sd["model.embed_tokens.weight"] = sd["model.embed_tokens.weight"][:200].clone()
    save_file(sd, os.path.join(small, "model.safetensors"), metadata={"format": "pt"})
    tok = PreTrainedTokenizerFast.from_pretrained(small)
    ids = tok.apply_chat_template(json.loads(open(data).readline())["messages"], return_dict=True)["input_ids"]
    try:
        AutoModelForCausalLM.from_pretrained(small)(torch.tensor([ids]))
        python = "ran"
    except IndexError as e:
        python = f"IndexError: {e}"
    r = subprocess.run([fin, "--model_name_or_path", small, "--dataset", data, "--output_dir",
                        os.path.join(tmp, "small_out"), "--max_steps", "1"], capture_output=True, text=True)
    msg = (r.stderr.strip().splitlines() or [""])[-1]
    bad = subprocess.run([fin, "--model_name_or_path", base, "--dataset", data, "--max_length", "1k",
                          "--output_dir", os.path.join(tmp, "max_length_1k")],
                         capture_output=True, text=True).stderr
    check("--max_length" in bad and "'1k'" in bad, f"max_length: a value that is no number is named: {bad.strip()!r}")
    # max_length below every prompt of completion-only data: TRL drops every example; the recipe names why.
    pc = os.path.join(tmp, "pc.jsonl")
    with open(pc, "w") as f:
        for line in open(data):
            m = json.loads(line)["messages"]
            f.write(json.dumps({"prompt": m[:-1], "completion": m[-1:]}) + "\n")
    bad = subprocess.run([fin, "--model_name_or_path", base, "--dataset", pc, "--max_length", "4",
                          "--output_dir", os.path.join(tmp, "max_length_4")], capture_output=True, text=True).stderr
    check(pc in bad and "--max_length 4" in bad, f"max_length: data cut to no label names the file and the fix: "
          f"{bad.strip()[:200]!r}")
    gen = os.path.join(os.path.dirname(fin), "generate")  # build/examples/llm/generate, beside finetune
    if os.path.exists(gen):
        bad = subprocess.run([gen, "--model_name_or_path", base, "--prompt", "hi", "--max_new_tokens", "3x"],
                             capture_output=True, text=True)
        check(bad.returncode != 0 and "'3x'" in bad.stderr,
              f"generate: --max_new_tokens 3x is refused naming it (was read as 3): {bad.stderr.strip()[:120]!r}")
    check(python.startswith("IndexError") and r.returncode != 0 and "vocab_size 200" in msg and "config.json" in msg
          and "resize_token_embeddings" in msg,
          f"vocab: a tokenizer larger than the embedding: transformers {python[:60]!r}; finetune: {msg[:240]!r}")


def nearest_absmax_codes(qmodel, base):
    """bitsandbytes' 4-bit layers with the nearest 8-bit absmax codes (double quantisation), as accel::quant
    chooses them: bitsandbytes' CPU search sometimes takes the neighbour of the nearest code (a documented
    difference, tests/nn/quant4bit_test.cpp [.bnb]). Returns (codes changed, codes)."""
    import bitsandbytes as bnb
    full = AutoModelForCausalLM.from_pretrained(base)
    changed = total = 0
    for name, m in qmodel.named_modules():
        if not isinstance(m, bnb.nn.Linear4bit):
            continue
        st = m.weight.quant_state
        absmax = full.get_submodule(name).weight.detach().float().reshape(-1, st.blocksize).abs().amax(1)
        scale = st.state2.absmax.flatten().repeat_interleave(st.state2.blocksize)[:absmax.numel()]
        x = (absmax - st.offset) / scale
        code = st.state2.code.clone()
        code[0] = -1.0  # as both libraries' CPU search
        near = (x[:, None] - code[None, :]).abs().argmin(1).to(torch.uint8)
        changed += int((near != st.absmax.flatten()).sum())
        total += near.numel()
        st.absmax.copy_(near.view_as(st.absmax))
    return changed, total


def qlora_merged_check(base, tok, rows, out):
    """finetune --save_merged of a QLoRA run: transformers loads out/model as an ordinary model (no missing or
    unexpected keys, float32 tensors: the dtype the base was loaded in, as transformers' dequantize() gives),
    each projection equal to bitsandbytes' dequantize_4bit of the same NF4 base (nearest absmax codes) plus
    our adapter's scale * B @ A, and its logits equal PEFT + bitsandbytes' 4-bit model with our trained adapter
    (the model the run trained, unmerged)."""
    import bitsandbytes as bnb
    from transformers import BitsAndBytesConfig
    merged_dir = os.path.join(out, "model")
    m, info = AutoModelForCausalLM.from_pretrained(merged_dir, output_loading_info=True)
    bad_keys = sorted(info["missing_keys"]) + sorted(info["unexpected_keys"])
    tensors = our_model_tensors(merged_dir)
    dtypes = sorted({str(t.dtype) for t in tensors.values()})
    q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                           bnb_4bit_compute_dtype=torch.float32)
    qmodel = AutoModelForCausalLM.from_pretrained(base, quantization_config=q, device_map="cpu", dtype=torch.float32)
    nearest_absmax_codes(qmodel, base)
    adapter = load_file(os.path.join(out, "adapter", "adapter_model.safetensors"))
    scale = LORA["lora_alpha"] / LORA["r"]
    wd = 0.0
    for name, mod in qmodel.named_modules():
        if not isinstance(mod, bnb.nn.Linear4bit):
            continue
        w = bnb.functional.dequantize_4bit(mod.weight.data, mod.weight.quant_state).float()
        a = adapter.get(f"base_model.model.{name}.lora_A.weight")
        if a is not None:
            w = w + scale * (adapter[f"base_model.model.{name}.lora_B.weight"] @ a)
        got = tensors.get(name + ".weight")
        wd = max(wd, float("inf") if got is None else (got.float() - w).abs().max().item())
    peft = PeftModel.from_pretrained(qmodel, os.path.join(out, "adapter"))
    # Train mode (dropout 0): in eval mode bitsandbytes 0.50's CPU Linear4bit repacks the weight for its
    # AVX512-BF16 kernel, which moves these logits by ~5e-2 from its own dequantize_4bit's.
    peft.train()
    ld = (logits_of(peft, tok, rows) - logits_of(m, tok, rows)).abs().max().item()
    check(not bad_keys and dtypes == ["torch.float32"] and wd <= 1e-6 and ld <= 1e-4,
          f"qlora --save_merged: transformers loads an ordinary model ({len(tensors)} tensors, dtypes {dtypes}, "
          f"missing/unexpected keys {bad_keys[:4]}), projections = dequantize_4bit(NF4) + scale B A (max |diff| "
          f"{wd:.2e} <= 1e-6), logits equal PEFT + bitsandbytes' 4-bit model with our adapter (max |diff| "
          f"{ld:.2e} <= 1e-4)")


def qlora_row(fin, tmp, base, tok, data, rows):
    """QLoRA: NF4 (nested) base + LoRA against transformers' load_in_4bit + PEFT on bitsandbytes' CPU
    Linear4bit, with each library's own absmax codes and with the same (nearest) codes."""
    from transformers import BitsAndBytesConfig
    init = os.path.join(tmp, "adapter_init")
    out = os.path.join(tmp, "our_qlora")
    ours(fin, None, None, base, data, out, 4, 1, 8, 1e-2,
         ["--model_config", model_config(tmp, "qlora"), "--adapter_init", init, "--save_merged"])
    got = our_losses(out)
    qlora_merged_check(base, tok, rows, out)
    mine = load_file(os.path.join(out, "adapter", "adapter_model.safetensors"))
    print("  qlora losses, ours:                 ", " ".join(f"{v:.6f}" for v in got))
    for same in (False, True):
        q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=torch.float32)
        qmodel = AutoModelForCausalLM.from_pretrained(base, quantization_config=q, device_map="cpu",
                                                      dtype=torch.float32)
        changed, total = nearest_absmax_codes(qmodel, base) if same else (0, 0)
        peft = PeftModel.from_pretrained(qmodel, init, is_trainable=True)
        hf_out = os.path.join(tmp, f"hf_qlora_{int(same)}")
        ref = hf_train(peft, tok, data, hf_out, 4, 1, 8, 1e-2)
        peft.save_pretrained(os.path.join(hf_out, "adapter"))
        label = "same codes" if same else "own codes "
        print(f"  qlora losses, bitsandbytes {label}:", " ".join(f"{v:.6f}" for v in ref))
        d = max_diff(ref, got)
        first = abs(ref[0] - got[0])
        ad = tensors_diff(load_file(os.path.join(hf_out, "adapter", "adapter_model.safetensors")), mine)
        if same:
            check(d <= 1e-4 and ad <= 1e-5,
                  f"qlora (NF4, nested, fp32 compute), bitsandbytes given the nearest absmax codes ({changed} of "
                  f"{total} changed): 8 step losses equal PEFT + bitsandbytes' CPU Linear4bit (max |diff| "
                  f"{d:.2e} <= 1e-4), adapters within 1e-5 ({ad:.2e})")
        else:
            # Each library's own codes: they differ in a few blocks' absmax (bitsandbytes' CPU search), so the
            # 4-bit weights there differ by ~1e-4, which the first loss shows and training carries on.
            check(first <= 5e-5 and d <= 1e-4 and ad <= 1e-3,
                  f"qlora, each library's own absmax codes: first loss within 5e-5 ({first:.2e}), 8 step losses "
                  f"within 1e-4 (max |diff| {d:.2e}), adapters within 1e-3 ({ad:.2e})")


def config_keys_row(fin, tmp, base, data):
    """The files a TRL user brings: SFTConfig keys in the TrainingArguments file (`trl sft --config` reads them
    there) are refused naming the file, the key and the fix (TrainingArguments alone called them unknown), and
    booleans read as HfArgumentParser reads them: `--completion_only_loss True` was read as false."""
    for key, value, fix in [("max_length", "64", "--max_length VALUE"), ("padding_free", "true", "does not implement")]:
        yaml = os.path.join(tmp, f"sft_{key}.yaml")
        with open(yaml, "w") as f:
            f.write(f"output_dir: {os.path.join(tmp, 'sft_keys')}\nreport_to: none\n{key}: {value}\n")
        r = subprocess.run([fin, "--training_args", yaml, "--model_name_or_path", base, "--dataset", data],
                           capture_output=True, text=True)
        msg = r.stderr.strip()
        check(r.returncode != 0 and yaml in msg and f"'{key}'" in msg and fix in msg,
              f"config keys: SFTConfig's {key} in the TrainingArguments file names the file, key and fix: {msg[-160:]!r}")
    pc = os.path.join(tmp, "pc_flags.jsonl")
    with open(pc, "w") as f:
        for line in open(data):
            m = json.loads(line)["messages"]
            f.write(json.dumps({"prompt": m[:-1], "completion": m[-1:]}) + "\n")
    first = {}
    for v in ("True", "true", "false"):
        out = os.path.join(tmp, f"flag_{v}")
        ours(fin, None, None, base, pc, out, 2, 1, 1, 1e-3, ["--completion_only_loss", v])
        first[v] = our_losses(out)[0]
    check(first["True"] == first["true"] != first["false"],
          f"config keys: --completion_only_loss True is true, as HfArgumentParser reads it (first losses {first})")
    bad = subprocess.run([fin, "--model_name_or_path", base, "--dataset", pc, "--packing", "maybe"],
                         capture_output=True, text=True).stderr
    check("--packing" in bad and "'maybe'" in bad, f"config keys: --packing maybe is refused naming it: {bad.strip()!r}")


def options_row(fin, tmp, base, tok, data):
    """Full fine-tuning with the options a TRL recipe sets that the other rows leave at their defaults, against
    SFTTrainer: weight_decay 0.5 (HF's get_decay_parameter_names: none on the q/k/v biases and the norms),
    cosine_with_min_lr (min_lr_rate 0.1) with warmup_steps 0.2 (a ratio, transformers 5), packing (bfd,
    padding-free: position ids restart per document; transformers' masks keep attention inside documents on
    CPU too), accumulation 2 x batch 2, and eval_strategy steps every 3 of 8 steps on a packed eval set: the
    per-step losses, every eval_loss (transformers 5 also evaluates at the last step, 8) and the model.
    dataloader_drop_last true: HF drops the last short batch of the evaluation set too (10 packed rows in
    batches of 3: 3 batches)."""
    ev = os.path.join(tmp, "eval.jsonl")
    with open(data) as f, open(ev, "w") as g:
        g.writelines(f.readlines()[:10])
    extra = dict(weight_decay=0.5, lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs={"min_lr_rate": 0.1},
                 warmup_steps=0.2, packing=True, max_length=256, eval_strategy="steps", eval_steps=3,
                 per_device_eval_batch_size=3, dataloader_drop_last=True)
    model = AutoModelForCausalLM.from_pretrained(base)
    hf_out, history = os.path.join(tmp, "hf_options"), []
    ref = hf_train(model, tok, data, hf_out, 2, 2, 8, 3e-3, eval_data=ev, history=history, **extra)
    model.save_pretrained(os.path.join(hf_out, "model"))
    out = os.path.join(tmp, "our_options")
    ours(fin, None, None, base, data, out, 2, 2, 8, 3e-3,
         ["--weight_decay", "0.5", "--lr_scheduler_type", "cosine_with_min_lr", "--lr_scheduler_kwargs",
          '{"min_lr_rate": 0.1}', "--warmup_steps", "0.2", "--packing", "--max_length", "256", "--eval_strategy",
          "steps", "--eval_steps", "3", "--per_device_eval_batch_size", "3", "--eval_dataset", ev,
          "--dataloader_drop_last", "true"])
    with open(os.path.join(out, "runs", "trainer", "metrics.jsonl")) as f:
        metrics = [json.loads(l) for l in f]
    want = [(h["step"], h["eval_loss"]) for h in history if "eval_loss" in h]
    got = [(m["step"], m["eval/loss"]) for m in metrics if "eval/loss" in m]
    d, md = max_diff(ref, our_losses(out)), tensors_diff(our_model_tensors(os.path.join(hf_out, "model")),
                                                        our_model_tensors(os.path.join(out, "model")))
    ed = max_diff([v for _, v in want], [v for _, v in got]) if [k for k, _ in want] == [k for k, _ in got] \
        else float("inf")
    # The logged rate is the one the step used (transformers 5 reads it before lr_scheduler.step()).
    hf_lr = [h["learning_rate"] for h in history if "loss" in h]
    our_lr = [m["train/learning_rate"] for m in metrics if "train/loss" in m]
    lrd = max_diff(hf_lr, our_lr)
    check(lrd <= 1e-12, f"options: the logged learning_rate of each step equals SFTTrainer's (max |diff| {lrd:.2e}): "
          f"{[f'{v:.3g}' for v in our_lr]}")
    check(d <= 1e-4 and md <= 1e-5 and ed <= 1e-4,
          f"options (full, weight_decay 0.5, cosine_with_min_lr, warmup ratio 0.2, packing bfd, eval every 3 "
          f"steps): 8 step losses equal SFTTrainer's (max |diff| {d:.2e} <= 1e-4), model within 1e-5 ({md:.2e}), "
          f"eval_loss at steps {[k for k, _ in got]} (SFTTrainer's {[k for k, _ in want]}) within 1e-4 ({ed:.2e})")


def skewed_completions(tmp):
    """Prompt-completion chats whose completions are a number or 20-60 words: the ranks' label counts differ
    several-fold, so how the loss is normalised over the ranks shows in every step."""
    rng = random.Random(3)
    words = "the a cat dog sum of plus minus is what number tell me please quickly answer".split()
    path = os.path.join(tmp, "skewed.jsonl")
    with open(path, "w") as f:
        for _ in range(24):
            a, b = rng.randint(0, 99), rng.randint(0, 99)
            ask = " ".join(rng.choice(words) for _ in range(rng.randint(5, 40)))
            answer = str(a + b) if rng.random() < 0.5 else " ".join(rng.choice(words) for _ in range(rng.randint(20, 60)))
            f.write(json.dumps({"prompt": [{"role": "user", "content": f"{ask} What is {a} plus {b}?"}],
                                "completion": [{"role": "assistant", "content": answer}]}) + "\n")
    return path


def hf_ranks_worker(base, data, out):
    """Run on 2 ranks (fork_ranks, Gloo): SFTTrainer with average_tokens_across_devices true (transformers
    5's default) and false, 3 steps each; rank 0 writes the logged losses and saves each model."""
    tok = PreTrainedTokenizerFast.from_pretrained(base)
    result = {}
    for avg in (True, False):
        model = AutoModelForCausalLM.from_pretrained(base)
        run = os.path.join(out, f"hf_ranks_{avg}")
        result[str(avg)] = hf_train(model, tok, data, run, 2, 2, 3, 3e-3, ddp_backend="gloo",
                                    average_tokens_across_devices=avg)
        if int(os.environ.get("RANK", "0")) == 0:
            model.save_pretrained(os.path.join(run, "model"))
    if int(os.environ.get("RANK", "0")) == 0:
        with open(os.path.join(out, "hf_ranks.json"), "w") as f:
            json.dump(result, f)


def fork_ranks(fn, *args):
    """Runs fn(*args) on 2 ranks as torchrun would (RANK, WORLD_SIZE, MASTER_ADDR/PORT; transformers opens a Gloo
    group), in processes forked from this one: torch, transformers and TRL are imported already (a torchrun
    launch spent ~13 s of CPU importing them again). Accelerate's process state, made here by the one-process
    runs, is reset in each child. Returns the exit codes."""
    import multiprocessing
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    def child(rank):
        from accelerate.state import AcceleratorState, PartialState
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        AcceleratorState._reset_state(True)
        PartialState._reset_state()
        fn(*args)

    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=child, args=(r,)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
    return [p.exitcode for p in procs]


def hf_ranks_row(fin, launch, templates, tmp, base):
    """2 ranks against SFTTrainer on 2 ranks (2 processes forked as torchrun would start them, Gloo),
    completion-only data whose ranks hold very different label counts, accumulation 2: with
    average_tokens_across_devices true (every rank's label tokens
    divide the window's loss) and false (each rank's own; the ranks' gradients averaged), losses within 1e-4
    and the models within 1e-5 (false was read and ignored: 1.5e-2 off HF's model)."""
    data = skewed_completions(tmp)
    codes = fork_ranks(hf_ranks_worker, base, data, tmp)
    if codes != [0, 0]:
        check(False, f"ranks vs SFTTrainer: the 2 forked ranks of SFTTrainer exited {codes}")
        return
    with open(os.path.join(tmp, "hf_ranks.json")) as f:
        ref = json.load(f)
    for avg in (True, False):
        out = os.path.join(tmp, f"our_ranks_avg_{avg}")
        ours(fin, launch, os.path.join(templates, "ddp_cpu.yaml"), base, data, out, 2, 2, 3, 3e-3,
             ["--average_tokens_across_devices", str(avg).lower()])
        d = max_diff(ref[str(avg)], our_losses(out))
        md = tensors_diff(our_model_tensors(os.path.join(tmp, f"hf_ranks_{avg}", "model")),
                          our_model_tensors(os.path.join(out, "model")))
        check(d <= 1e-4 and md <= 1e-5, f"ranks ddp_cpu vs SFTTrainer on 2 ranks (Gloo), skewed "
              f"completion-only labels, average_tokens_across_devices {str(avg).lower()}: 3 step losses (max |diff| "
              f"{d:.2e} <= 1e-4), model (max |diff| {md:.2e} <= 1e-5)")


def main():
    fin, launch, templates, jinja = sys.argv[1:5]
    t0 = time.time()
    tmp = tempfile.mkdtemp(prefix="sft_equivalence_")
    try:
        base = os.path.join(tmp, "base")
        tok, data, lengths = make(base, jinja)
        rows = [json.loads(l) for l in open(data)][:6]
        print(f"made: tiny Qwen2 (hidden 64, 2 layers, tied, q/k/v biases), {len(lengths)} chats of {min(lengths)}-"
              f"{max(lengths)} tokens", flush=True)
        lora, md = lora_rows(fin, tmp, base, tok, data, rows)
        check(md <= 1e-4, f"lora: our load_adapter of PEFT's trained adapter, merged and saved, gives PEFT's "
              f"logits in transformers (max |diff| {md:.2e} <= 1e-4)")
        import lora_tied_embeddings  # modules_to_save [embed_tokens] on the tied model, both tying semantics
        lora_tied_embeddings.tied_rows(sys.modules[__name__], fin, tmp, base, tok, data, rows)
        full = full_row(fin, tmp, base, tok, data)
        qlora_row(fin, tmp, base, tok, data, rows)
        rank_rows(fin, launch, templates, tmp, base, data, lora, full)
        readme_row(fin, launch, tmp, base, data)
        vocab_row(fin, tmp, base, data)
        config_keys_row(fin, tmp, base, data)
        t1 = time.time()
        options_row(fin, tmp, base, tok, data)
        hf_ranks_row(fin, launch, templates, tmp, base)
        print(f"time {time.time() - t0:.1f} s (options and ranks vs SFTTrainer rows {time.time() - t1:.1f} s)")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if FAILED:
        print(f"sft equivalence: {len(FAILED)} checks failed")
        return 1
    print("sft equivalence: all equal")
    return 0


if __name__ == "__main__":
    sys.exit(main())
