#!/usr/bin/env python3
"""LoRA with modules_to_save [embed_tokens] on a model with tied embeddings (tie_word_embeddings true, as every
small Qwen2 / Qwen2.5), against PEFT 0.21's two semantics (peft/tuners/tuners_utils.py _check_tied_modules,
peft/utils/other.py set_additional_trainable_modules):

  ensure_weight_tying false (PEFT's default): the embedding's lookup trains a copy (ModulesToSaveWrapper); the
      head keeps the original, frozen weight; the adapter holds model.embed_tokens.weight; merge_and_unload +
      save_pretrained writes an untied model (tie_word_embeddings false, lm_head.weight written).
  ensure_weight_tying true: the head stays tied to the trained copy; the adapter holds lm_head.weight too; the
      merged model stays tied.
  modules_to_save [lm_head] (the tied head; PEFT's EMBEDDING_LAYER_NAMES hold it too): ensure_weight_tying
      false: the head trains a copy, the embedding keeps the original weight, frozen; true: PEFT takes lm_head
      out of modules_to_save and trains the embedding with the head tied to it (modules_to_save
      [model.embed_tokens]).

Rows (one each): examples/llm/finetune (TRL ModelConfig keys in a file; ensure_weight_tying: PEFT's LoraConfig
name, TRL's ModelConfig has none) from PEFT's initial adapter against SFTTrainer + PEFT, a few steps: per-step
losses within 1e-4, the adapter's tensors within 1e-5 with PEFT's keys, adapter_config.json's
ensure_weight_tying / modules_to_save as PEFT writes them, PeftModel.from_pretrained of our adapter gives the
trained PEFT model's logits (1e-4); our --save_merged model: the tie_word_embeddings PEFT + save_pretrained give
and, loaded in transformers, PEFT's logits (1e-4); our load_adapter of PEFT's trained adapter (--adapter_init,
learning rate 0, --save_merged) gives PEFT's logits (1e-4); generate --adapter of our adapter gives PEFT's greedy
tokens.

Called by sft_equivalence.py (its tiny model, data and helpers); alone:
  lora_tied_embeddings.py FINETUNE QWEN2_5_JINJA
"""
import json
import os
import subprocess
import sys

STEPS = 6


def _model_config(tmp, lora, ensure, module="embed_tokens"):
    path = os.path.join(tmp, f"tied_{module.replace(', ', '_')}_{int(ensure)}.model.yaml")
    with open(path, "w") as f:
        f.write(f"use_peft: true\nlora_r: {lora['r']}\nlora_alpha: {lora['lora_alpha']}\nlora_dropout: 0.0\n"
                f"lora_target_modules: [{', '.join(lora['target_modules'])}]\n"
                f"lora_modules_to_save: [{module}]\n" + ("ensure_weight_tying: true\n" if ensure else ""))
    return path


def _greedy_ids(model, tok, prompt, n):
    import torch
    enc = tok(prompt, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=n, do_sample=False)
    return out[0, enc["input_ids"].shape[1]:].tolist()


def tied_rows(S, fin, tmp, base, tok, data, rows):
    """S: sft_equivalence's module (check, hf_train, ours, our_losses, max_diff, tensors_diff, logits_of)."""
    import torch
    from peft import LoraConfig, PeftModel, get_peft_model
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    gen = os.path.join(os.path.dirname(fin), "generate")
    # The tied head named instead of the embedding (PEFT's EMBEDDING_LAYER_NAMES hold both).
    for module, ensure in (("embed_tokens", False), ("embed_tokens", True), ("lm_head", False), ("lm_head", True)):
        tag = f"lora tied {module} ensure_weight_tying {str(ensure).lower()}"
        key = f"{module}_{int(ensure)}"
        init = os.path.join(tmp, f"tied_init_{key}")
        torch.manual_seed(3)
        get_peft_model(AutoModelForCausalLM.from_pretrained(base),
                       LoraConfig(task_type="CAUSAL_LM", modules_to_save=[module],
                                  ensure_weight_tying=ensure, **S.LORA)).save_pretrained(init)
        peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), init, is_trainable=True)
        hf_out = os.path.join(tmp, f"hf_tied_{key}")
        ref = S.hf_train(peft, tok, data, hf_out, 4, 1, STEPS, 1e-2)
        peft.save_pretrained(os.path.join(hf_out, "adapter"))
        out = os.path.join(tmp, f"our_tied_{key}")
        S.ours(fin, None, None, base, data, out, 4, 1, STEPS, 1e-2,
               ["--model_config", _model_config(tmp, S.LORA, ensure, module), "--adapter_init", init,
                "--save_merged"])
        d = S.max_diff(ref, S.our_losses(out))
        theirs_files = load_file(os.path.join(hf_out, "adapter", "adapter_model.safetensors"))
        mine_files = load_file(os.path.join(out, "adapter", "adapter_model.safetensors"))
        ad = S.tensors_diff(theirs_files, mine_files)
        saved = {k: v for k, v in mine_files.items() if "lora_" not in k}
        ed = S.tensors_diff({k: theirs_files.get(k, v + float("inf")) for k, v in saved.items()}, saved)
        # The trained modules within 1e-5; the LoRA tensors within 1e-4: Adam divides by the gradient's running
        # size, so an entry whose gradient is near zero moves by lr-sized steps either way (measured: one entry
        # of q_proj's A 1.96e-05 apart, 0.15% of its move; the other 511 within 4e-7).
        S.check(d <= 1e-4 and ed <= 1e-5 and ad <= 1e-4, f"{tag}: {STEPS} step losses equal SFTTrainer + PEFT's "
                f"(max |diff| {d:.2e} <= 1e-4), adapter {sorted(k.split('.')[-2] for k in saved)} within 1e-5 "
                f"({ed:.2e}), LoRA tensors within 1e-4 ({ad:.2e})")
        cfgs = [json.load(open(os.path.join(x, "adapter", "adapter_config.json"))) for x in (hf_out, out)]
        keys = ("ensure_weight_tying", "modules_to_save")
        S.check(all(cfgs[0].get(k) == cfgs[1].get(k) for k in keys),
                f"{tag}: adapter_config.json {[cfgs[1].get(k) for k in keys]} as PEFT writes it "
                f"{[cfgs[0].get(k) for k in keys]}")
        mine = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), os.path.join(out, "adapter"))
        ld = (S.logits_of(peft.eval(), tok, rows) - S.logits_of(mine, tok, rows)).abs().max().item()
        S.check(ld <= 1e-4, f"{tag}: PeftModel.from_pretrained loads our adapter, logits within 1e-4 of PEFT's "
                f"trained model (max |diff| {ld:.2e})")
        # The merged model, as PEFT's merge_and_unload + save_pretrained write it.
        want_dir = os.path.join(hf_out, "merged")
        PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), os.path.join(hf_out, "adapter")) \
            .merge_and_unload().save_pretrained(want_dir)
        tie = [json.load(open(os.path.join(x, "config.json"))).get("tie_word_embeddings")
               for x in (want_dir, os.path.join(out, "model"))]
        heads = ["lm_head.weight" in load_file(os.path.join(x, "model.safetensors"))
                 for x in (want_dir, os.path.join(out, "model"))]
        merged = AutoModelForCausalLM.from_pretrained(os.path.join(out, "model"))
        md = (S.logits_of(peft, tok, rows) - S.logits_of(merged, tok, rows)).abs().max().item()
        S.check(tie[0] == tie[1] and heads[0] == heads[1] and md <= 1e-4,
                f"{tag}: --save_merged writes tie_word_embeddings {tie[1]}, lm_head.weight {heads[1]} (PEFT + "
                f"save_pretrained: {tie[0]}, {heads[0]}); transformers' logits within 1e-4 of PEFT's ({md:.2e})")
        # Ours loads PEFT's trained adapter (load_adapter: PEFT's keys, the head's too when tied), learning rate
        # 0 for one step, merged and saved: PEFT's logits in transformers.
        loads = os.path.join(tmp, f"our_loads_tied_{key}")
        S.ours(fin, None, None, base, data, loads, 4, 1, 1, 0.0,
               ["--model_config", _model_config(tmp, S.LORA, ensure, module), "--adapter_init",
                os.path.join(hf_out, "adapter"), "--save_merged"])
        m = AutoModelForCausalLM.from_pretrained(os.path.join(loads, "model"))
        md = (S.logits_of(peft, tok, rows) - S.logits_of(m, tok, rows)).abs().max().item()
        S.check(md <= 1e-4, f"{tag}: our load_adapter of PEFT's trained adapter, merged and saved, gives PEFT's "
                f"logits in transformers (max |diff| {md:.2e} <= 1e-4)")
        if os.path.exists(gen):
            prompt = tok.apply_chat_template(rows[0]["messages"][:1], tokenize=False, add_generation_prompt=True)
            want = _greedy_ids(peft, tok, prompt, 8)
            g = subprocess.run([gen, "--model_name_or_path", base, "--adapter", os.path.join(out, "adapter"),
                                "--prompt", prompt, "--max_new_tokens", "8", "--print_ids", "--dtype", "float32"],
                               capture_output=True, text=True)
            line = [l for l in g.stdout.splitlines() if l.startswith("completion_ids:")]
            got = [int(x) for x in line[0].split(":", 1)[1].replace(",", " ").split()] if line else []
            # Both stop at the end-of-turn token; PEFT's list may hold it, ours ends there too.
            S.check(g.returncode == 0 and len(got) >= 1 and got == want[:len(got)],
                    f"{tag}: generate --adapter (our load_adapter) gives PEFT's greedy tokens ({got} / {want}"
                    f"{'' if g.returncode == 0 else ': ' + g.stderr.strip()[-200:]})")
    untied_row(S, fin, tmp, base, tok, data, rows)


def untied_row(S, fin, tmp, base, tok, data, rows):
    """An untied model (tie_word_embeddings false, as Llama's) with modules_to_save [embed_tokens, lm_head] and
    an adapter PEFT made with ensure_weight_tying true: PEFT only warns (nothing is tied: tuners_utils.py
    _check_tied_modules) and loads it as any adapter, the key mattering only where the embeddings are tied. Our
    load_adapter (finetune --adapter_init, whose model config leaves ensure_weight_tying false; it refused the
    file before) at learning rate 0, merged and saved, gives PeftModel.from_pretrained's logits in transformers
    (1e-4). The saved copies and B are perturbed, so that every tensor of the adapter moves the logits."""
    import shutil
    import torch
    from peft import LoraConfig, PeftModel, get_peft_model
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM
    untied = os.path.join(tmp, "base_untied")
    m = AutoModelForCausalLM.from_pretrained(base, tie_word_embeddings=False)
    torch.manual_seed(11)
    with torch.no_grad():
        m.lm_head.weight.copy_(m.model.embed_tokens.weight + 0.05 * torch.randn_like(m.lm_head.weight))
    m.save_pretrained(untied)
    for name in os.listdir(base):
        if name not in ("config.json", "model.safetensors") and os.path.isfile(os.path.join(base, name)):
            shutil.copy(os.path.join(base, name), untied)
    init = os.path.join(tmp, "untied_init")
    get_peft_model(AutoModelForCausalLM.from_pretrained(untied),
                   LoraConfig(task_type="CAUSAL_LM", modules_to_save=["embed_tokens", "lm_head"],
                              ensure_weight_tying=True, init_lora_weights=False, **S.LORA)).save_pretrained(init)
    f = os.path.join(init, "adapter_model.safetensors")
    sd = {k: (v + 0.05 * torch.randn_like(v) if "lora_" not in k else v) for k, v in load_file(f).items()}
    save_file(sd, f, metadata={"format": "pt"})
    out = os.path.join(tmp, "our_loads_untied")
    ok = True
    try:
        S.ours(fin, None, None, untied, data, out, 4, 1, 1, 0.0,
               ["--model_config", _model_config(tmp, S.LORA, False, "embed_tokens, lm_head"), "--adapter_init",
                init, "--save_merged"])
    except RuntimeError:
        ok = False
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(untied), init).eval()
    md = float("inf")
    if ok:
        merged = AutoModelForCausalLM.from_pretrained(os.path.join(out, "model"))
        md = (S.logits_of(peft, tok, rows) - S.logits_of(merged, tok, rows)).abs().max().item()
    plain = (S.logits_of(peft, tok, rows) -
             S.logits_of(AutoModelForCausalLM.from_pretrained(untied), tok, rows)).abs().max().item()
    S.check(ok and md <= 1e-4, f"lora untied modules_to_save [embed_tokens, lm_head]: our load_adapter takes "
            f"PEFT's adapter made with ensure_weight_tying true on the untied model (ours false), merged and "
            f"saved: PEFT's logits in transformers (max |diff| {md:.2e} <= 1e-4; the adapter moves them "
            f"{plain:.2e})")


def main():
    import tempfile
    import shutil
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import sft_equivalence as S
    fin, jinja = sys.argv[1:3]
    tmp = tempfile.mkdtemp(prefix="lora_tied_")
    try:
        base = os.path.join(tmp, "base")
        tok, data, _ = S.make(base, jinja)
        rows = [json.loads(l) for l in open(data)][:6]
        tied_rows(S, fin, tmp, base, tok, data, rows)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print("lora tied: " + ("all equal" if not S.FAILED else f"{len(S.FAILED)} checks failed"))
    return 1 if S.FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
