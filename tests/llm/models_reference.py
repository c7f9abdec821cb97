#!/usr/bin/env python3
"""Reference side of the accel::llm model checks (tests/llm/models_crosscheck.sh runs it).

  models_reference.py make OUT [GENERATE]
                                  makes tiny random Llama / Qwen2 / Qwen3 models with transformers, saves them
                                  (one also sharded, one with an old-style config.json), and writes what
                                  transformers computes on them: logits (fp32, bf16), a padded batch, the loss,
                                  greedy generation (one prompt, and two left-padded prompts), 32 tokens each;
                                  on the sliding-window models also three left-padded prompts and the positions
                                  each layer's KV cache keeps after a prefill and one step.
  models_reference.py check OUT   loads with transformers what accel::llm::save_pretrained wrote
                                  (OUT/<name>/cpp_saved) and compares its logits with the reference.
  models_reference.py all OUT TESTS FUSED_TESTS ACCEL_LAUNCH [GENERATE]
                                  make, then TESTS "[.hf]" (accel_llm_models_tests: compares and writes
                                  cpp_saved), then check, then fused_loss_reference.py FUSED_TESTS (the fused
                                  loss against transformers' loss and gradients) and estimate_memory_check.py
                                  ACCEL_LAUNCH (parameter counts against transformers and PEFT): one Python
                                  start (importing torch and transformers costs ~5 s of CPU a time). Exit 77
                                  (skipped) when one of them cannot run here, never half of it.
  With GENERATE, make also runs build/examples/llm/generate --print_ids on a tiny Qwen2 with a tokenizer
                                  trained here and compares ids and text with transformers' generate.
Exit 77 when transformers or safetensors is not importable (reported as skipped).
"""
import json
import os
import sys

try:
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config
    from transformers import LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM
except ImportError as e:  # pragma: no cover
    print(f"models_reference.py: {e}; skipped")
    sys.exit(77)

from transformers.utils import logging as hf_logging

hf_logging.disable_progress_bar()
NEW_TOKENS = 32
SMALL = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=128, rms_norm_eps=1e-6, eos_token_id=None, bos_token_id=None,
             pad_token_id=None)


def models():
    """name -> (model class, config). Every family, tied and untied, GQA, biases, q/k norms, rope scalings."""
    return {
        "qwen2_tied": (Qwen2ForCausalLM, Qwen2Config(**SMALL, num_key_value_heads=2, tie_word_embeddings=True)),
        "qwen2_untied": (Qwen2ForCausalLM, Qwen2Config(**SMALL, num_key_value_heads=2, tie_word_embeddings=False)),
        "qwen2_yarn": (Qwen2ForCausalLM, Qwen2Config(
            **SMALL, num_key_value_heads=1, tie_word_embeddings=True,
            rope_parameters={"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0,
                             "original_max_position_embeddings": 32})),
        "llama3": (LlamaForCausalLM, LlamaConfig(
            **SMALL, num_key_value_heads=2, tie_word_embeddings=False, attention_bias=True, mlp_bias=True,
            rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 16})),
        "llama_linear_oldconfig": (LlamaForCausalLM, LlamaConfig(
            **SMALL, num_key_value_heads=4, tie_word_embeddings=False,
            rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0})),
        "qwen3": (Qwen3ForCausalLM, Qwen3Config(**SMALL, num_key_value_heads=2, head_dim=32,
                                                tie_word_embeddings=True)),
        # Sliding-window attention (issue 50), windows shorter than the 24 positions, the prompts and the 39
        # positions of greedy generation: Qwen2's layers >= max_window_layers slide (layer 0 full, 1 and 2
        # sliding); Qwen3's layer_types given explicitly (sliding, full, sliding).
        "qwen2_sliding": (Qwen2ForCausalLM, Qwen2Config(
            **dict(SMALL, num_hidden_layers=3), num_key_value_heads=2, tie_word_embeddings=False,
            use_sliding_window=True, sliding_window=5, max_window_layers=1)),
        "qwen3_sliding": (Qwen3ForCausalLM, Qwen3Config(
            **dict(SMALL, num_hidden_layers=3), num_key_value_heads=2, tie_word_embeddings=True,
            use_sliding_window=True, sliding_window=6,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
    }


def old_style_config(path):
    """Rewrites a config.json as transformers 4 wrote it: rope_theta + rope_scaling {"type"}, torch_dtype."""
    with open(path) as f:
        config = json.load(f)
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    rope["type"] = rope.pop("rope_type")
    config["rope_scaling"] = rope
    config["torch_dtype"] = config.pop("dtype", "float32")
    with open(path, "w") as f:
        json.dump(config, f, indent=2)


def make(out):
    torch.manual_seed(0)
    names = []
    for name, (cls, config) in models().items():
        model = cls(config).eval()
        # Random weights with some spread (the default init gives near-uniform logits, a weak check).
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, 0.2 if p.dim() > 1 else 0.5)
                if p.dim() == 1 and "norm" in [n for n, q in model.named_parameters() if q is p][0]:
                    p.add_(1.0)
        d = os.path.join(out, name)
        model.save_pretrained(os.path.join(d, "model"))
        if name.endswith("oldconfig"):
            old_style_config(os.path.join(d, "model", "config.json"))
        if name == "qwen2_untied":
            model.save_pretrained(os.path.join(d, "sharded"), max_shard_size=20000)
        g = torch.Generator().manual_seed(len(names) + 1)
        ids = torch.randint(1, config.vocab_size, (2, 24), generator=g)
        ref = {"input_ids": ids}
        with torch.no_grad():
            ref["logits"] = model(ids).logits
            # A left-padded batch: row 1 has 5 pads, positions counted from its first real token.
            mask = torch.ones_like(ids)
            mask[1, :5] = 0
            padded = ids.masked_fill(mask == 0, 0)
            positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
            ref["padded_ids"], ref["padded_mask"], ref["padded_positions"] = padded, mask, positions
            ref["padded_logits"] = model(padded, attention_mask=mask, position_ids=positions).logits
            # Packed documents (TRL's padding-free rows): positions restart, no mask, no cache.
            packed = torch.cat([torch.arange(10), torch.arange(14)]).unsqueeze(0).expand(2, -1).contiguous()
            ref["packed_positions"] = packed
            ref["packed_logits"] = model(ids, position_ids=packed, use_cache=False).logits
            labels = ids.clone()
            labels[0, :3] = -100
            labels[1, 10:] = -100
            ref["labels"] = labels
            ref["loss"] = model(ids, labels=labels).loss.reshape(1)
            gen = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
                       eos_token_id=None)
            ref["greedy"] = model.generate(ids[:1, :7], attention_mask=torch.ones(1, 7, dtype=torch.long), **gen)[0, 7:]
            batch = torch.zeros(2, 7, dtype=torch.long)
            batch_mask = torch.zeros(2, 7, dtype=torch.long)
            batch[0], batch_mask[0] = ids[0, :7], 1
            batch[1, 3:], batch_mask[1, 3:] = ids[1, :4], 1
            ref["batch_greedy"] = model.generate(batch, attention_mask=batch_mask, **gen)[:, 7:]
            if "sliding" in name:
                # Three prompts (12, 2, 7 tokens) as one batch: a row's padding reaches past the window.
                lengths = [12, 2, 7]
                batch3 = torch.zeros(3, 12, dtype=torch.long)
                mask3 = torch.zeros(3, 12, dtype=torch.long)
                for row, n in enumerate(lengths):
                    batch3[row, 12 - n:], mask3[row, 12 - n:] = ids[row % 2, :n], 1
                ref["batch3_greedy"] = model.generate(batch3, attention_mask=mask3, **gen)[:, 12:]
                # transformers' cache (DynamicCache(config): DynamicSlidingWindowLayer on sliding layers) after
                # a prefill of the 24 positions and one decoding step: the positions each layer keeps.
                prefill = model(ids, use_cache=True)
                step = prefill.logits[:, -1:].argmax(-1)
                decoded = model(step, cache=prefill.cache, use_cache=True)
                ref["cache_step"] = step
                ref["cache_step_logits"] = decoded.logits
                ref["cache_lengths"] = torch.tensor([layer.keys.shape[-2] for layer in decoded.cache.layers])
            if name == "qwen2_untied":
                # As a user loads a bf16 model (model.to(bfloat16) would also round the rotary inv_freq buffer).
                bf16 = AutoModelForCausalLM.from_pretrained(os.path.join(d, "model"), dtype=torch.bfloat16).eval()
                ref["logits_bf16"] = bf16(ids).logits.float()
        save_file({k: v.contiguous() for k, v in ref.items()}, os.path.join(d, "reference.safetensors"))
        names.append(name)
    with open(os.path.join(out, "models.txt"), "w") as f:
        f.write("\n".join(names) + "\n")
    print(f"reference: {len(names)} models made with transformers ({', '.join(names)})")


def check(out):
    with open(os.path.join(out, "models.txt")) as f:
        names = f.read().split()
    worst = 0.0
    for name in names:
        d = os.path.join(out, name)
        ref = load_file(os.path.join(d, "reference.safetensors"))
        model = AutoModelForCausalLM.from_pretrained(os.path.join(d, "cpp_saved"), dtype=torch.float32).eval()
        with torch.no_grad():
            logits = model(ref["input_ids"]).logits
        diff = (logits - ref["logits"]).abs().max().item()
        worst = max(worst, diff)
        if diff > 1e-5:
            print(f"check: {name}: transformers' logits of accel-cpp's save_pretrained differ by {diff}")
            sys.exit(1)
    print(f"check: {len(names)} models saved by accel::llm::save_pretrained load in transformers, "
          f"max |logits - reference| = {worst:.3g}")


def program(out, generate_bin):
    """build/examples/llm/generate on a tiny Qwen2 with a byte-level BPE trained here: its prompt_ids, completion_ids
    and text equal the tokenizer's and transformers' greedy generate."""
    import subprocess
    from tokenizers import Tokenizer, decoders, models as tok_models, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    text = ["The quick brown fox jumps over the lazy dog. " * 3, "Once upon a time there was a tiny model.",
            "accelerate-cpp trains language models from C++; 12345 tokens, café, naïve, 東京."]
    tok = Tokenizer(tok_models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(text * 20, trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                                           initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    d = os.path.join(out, "program_model")
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(d)
    torch.manual_seed(5)
    config = Qwen2Config(**dict(SMALL, vocab_size=tok.get_vocab_size()), num_key_value_heads=2,
                         tie_word_embeddings=True)
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    model.save_pretrained(d)
    prompt = "Once upon a time"
    hf_tok = AutoTokenizer.from_pretrained(d)
    prompt_ids = hf_tok(prompt)["input_ids"]
    eos = hf_tok.eos_token_id
    with torch.no_grad():
        ids = model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                             max_new_tokens=16, do_sample=False, eos_token_id=eos, pad_token_id=eos)
    completion = ids[0, len(prompt_ids):].tolist()
    run = subprocess.run([generate_bin, "--model_name_or_path", d, "--prompt", prompt, "--max_new_tokens", "16",
                          "--print_ids"], capture_output=True, text=True, check=False)
    if run.returncode != 0:
        print(f"program: generate failed ({run.returncode}): {run.stderr}")
        sys.exit(1)
    lines = run.stdout.split("\n")
    got_prompt = [int(x) for x in lines[0].removeprefix("prompt_ids:").split()]
    got_completion = [int(x) for x in lines[1].removeprefix("completion_ids:").split()]
    got_text = "\n".join(lines[2:]).rstrip("\n")
    want_text = hf_tok.decode(completion, skip_special_tokens=True)
    if (got_prompt, got_completion, got_text) != (prompt_ids, completion, want_text):
        print(f"program: generate printed {run.stdout!r}; transformers: prompt_ids {prompt_ids}, "
              f"completion_ids {completion}, text {want_text!r}")
        sys.exit(1)
    print(f"program: generate --print_ids equals transformers ({len(prompt_ids)} prompt ids, {len(completion)} "
          f"new ids, the same text)")


def run_script(name, *args):
    """Runs tests/llm/NAME as its own __main__ with its own argv in this process; exits with its code when that
    is not 0 (77: it cannot run here)."""
    import runpy
    sys.argv = [os.path.join(os.path.dirname(os.path.abspath(__file__)), name), *args]
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if code != 0:
            print(f"models_reference: {name} exited with code {code}")
            sys.exit(code)
    sys.stdout.flush()


def cpp_side(out, tests):
    """accel_llm_models_tests "[.hf]" on the models made in OUT: prints its summary lines; its whole log and exit
    1 when it fails."""
    import subprocess
    run = subprocess.run([tests, "[.hf]", "--use-colour", "no"], env=dict(os.environ, ACCEL_LLM_REF_DIR=out),
                         capture_output=True, text=True, check=False)
    log = run.stdout + run.stderr
    if run.returncode != 0:
        print(log)
        sys.exit(1)
    print("\n".join(line for line in log.splitlines() if line.startswith("hf:") or "passed" in line), flush=True)


if __name__ == "__main__":
    if sys.argv[1] in ("make", "all"):
        out, extra = sys.argv[2], sys.argv[3:]
        tests, fused_tests, launch = (extra.pop(0), extra.pop(0), extra.pop(0)) if sys.argv[1] == "all" \
            else (None, None, None)
        make(out)
        if extra:  # the program's check too, in the same Python start (imports cost seconds)
            program(out, extra[0])
        if tests is not None:
            cpp_side(out, tests)
            check(out)
            # The fused loss against transformers and estimate-memory's counts against transformers and PEFT:
            # their own scripts, in this process.
            run_script("fused_loss_reference.py", fused_tests)
            run_script("estimate_memory_check.py", launch)
    else:
        {"check": check}[sys.argv[1]](sys.argv[2])
