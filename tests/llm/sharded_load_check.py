#!/usr/bin/env python3
"""Issue 50: under ZeRO-3 or FULL_SHARD a model larger than one rank's memory loads without any rank holding it
whole (DeepSpeed's zero3_init_flag, FSDP's fsdp_cpu_ram_efficient_loading).

  sharded_load_check.py SHARDED_LOAD_CHECK ACCEL_LAUNCH [tiny|large]

A tiny untied Qwen2 (8 blocks, ~2.3 M parameters) is made and saved by transformers (one model.safetensors,
and cut into shards with an index). For each row (ZeRO stage 3 + zero3_init_flag on the single file; FSDP
FULL_SHARD + fsdp_cpu_ram_efficient_loading on the shards), 2 ranks under accel-launch build the model empty
(accel::llm::from_pretrained_empty), prepare it with SGD and fill it with Accelerator::load_model; then, in the
same launch, the same with LoRA adapters (r 4 on q_proj and v_proj, added to the empty model, the optimizer over
them): the frozen base is sharded as the rest and loaded sharded, the adapters keep their values. Checks, for both:
  - every rank's logits equal transformers' within 1e-5 and the fully loaded one-process model's
    (accel::llm::from_pretrained, no Accelerator) within 1e-6; the losses too; after one SGD step on the
    batch, the logits equal the one-process model's after the same step within 1e-5;
  - no rank allocated the whole model: the peak of LibTorch's CPU allocations during build + prepare + load
    (CpuMemoryCounter) is at most model/2 + the largest tensor + 10% of the model, and below the model's size.
Each rank's resident figures (/proc/self/status: anonymous growth after building, prepare and load; the peak,
which counts the checkpoint pages read through the mapping) are printed for information, not checked.
Exit 77 when transformers is not importable.
"""
import os
import re
import subprocess
import sys
import tempfile

try:
    import torch
    from safetensors.torch import load_file
    from transformers import Qwen2Config, Qwen2ForCausalLM
except ImportError as e:  # pragma: no cover
    print(f"sharded load: skipped ({e})")
    sys.exit(77)

torch.set_num_threads(1)
FAILED = []


def check(ok, line):
    print(("ok    " if ok else "FAIL  ") + line, flush=True)
    if not ok:
        FAILED.append(line)


# "large" (by hand, not in the suite: sharded_load_check.py BIN LAUNCH large): ~155 M parameters, 620 MB in
# float32, for the resident-memory figure in docs/llm.md.
SIZES = {"tiny": dict(vocab_size=512, hidden_size=128, intermediate_size=512, num_attention_heads=4,
                      num_key_value_heads=2, shard="2MB"),
         "large": dict(vocab_size=16384, hidden_size=1024, intermediate_size=4096, num_attention_heads=16,
                       num_key_value_heads=8, shard="200MB")}


def make_model(root, size):
    torch.manual_seed(0)
    dims = dict(SIZES[size])
    shard = dims.pop("shard")
    cfg = Qwen2Config(num_hidden_layers=8, max_position_embeddings=128, tie_word_embeddings=False,
                      rope_theta=10000.0, **dims)
    model = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():  # weights of a visible scale (the default init gives near-uniform logits)
        for p in model.parameters():
            p.normal_(0.0, 0.05)
    single, shards = os.path.join(root, "single"), os.path.join(root, "shards")
    model.save_pretrained(single, safe_serialization=True)
    model.save_pretrained(shards, safe_serialization=True, max_shard_size=shard)
    return model, single, shards


def main():
    check_bin, launch = sys.argv[1], sys.argv[2]
    size = sys.argv[3] if len(sys.argv) > 3 else "tiny"
    with tempfile.TemporaryDirectory() as root:
        model, single, shards = make_model(root, size)
        n_files = len([f for f in os.listdir(shards) if f.endswith(".safetensors")])
        ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
        ids_file = os.path.join(root, "ids.txt")
        with open(ids_file, "w") as f:
            f.write(f"{ids.shape[0]} {ids.shape[1]}\n" + " ".join(str(int(i)) for i in ids.reshape(-1)) + "\n")
        with torch.no_grad():
            hf_logits = model(ids).logits
        env = dict(os.environ, OMP_NUM_THREADS="1", ACCEL_CONFIG_FILE="")
        whole_out = os.path.join(root, "whole.safetensors")
        subprocess.run([check_bin, "whole", single, ids_file, whole_out], check=True, env=env)
        whole = load_file(whole_out)
        d = (whole["logits"] - hf_logits).abs().max().item()
        check(d <= 1e-5, f"one process: from_pretrained's logits equal transformers' (max diff {d:.2e})")
        rows = [("zero_stage3", single, "1 file", "backend: zero\ndeepspeed_config:\n  zero_stage: 3\n"
                 "  zero3_init_flag: true\n"),
                ("fsdp_full_shard", shards, f"{n_files} shards",
                 "backend: fsdp\nfsdp_config:\n  fsdp_sharding_strategy: FULL_SHARD\n"
                 "  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n  fsdp_cpu_ram_efficient_loading: true\n")]
        for name, model_dir, files, section in rows:
            cfg = os.path.join(root, name + ".yaml")
            with open(cfg, "w") as f:
                f.write("config_version: 1\nuse_cpu: true\nnum_processes: 2\nmain_process_port: 0\n"
                        "mixed_precision: 'no'\n" + section)
            prefix = os.path.join(root, name + "_rank")
            r = subprocess.run([launch, "launch", "--config_file", cfg, check_bin, "sharded", model_dir, ids_file,
                                prefix], capture_output=True, text=True, env=env)
            if r.returncode != 0:
                print(r.stdout[-3000:], r.stderr[-3000:])
                check(False, f"{name}: 2 ranks ran")
                continue
            for rank in range(2):
                for lora in ("", "lora_"):
                    case = f"{name}{' LoRA' if lora else ''}"
                    m = re.search(rf"(?<!lora ){'lora ' if lora else ''}rank {rank}: load peak (\d+) bytes, held after "
                                  rf"load (\d+) bytes, model (\d+) bytes, largest tensor (\d+) bytes, frozen (\d+) "
                                  rf"bytes; resident: (.*)", r.stdout)
                    if not m:
                        print(r.stdout[-3000:])
                        check(False, f"{case} rank {rank}: reported its memory")
                        continue
                    peak, held, size, largest, frozen = map(int, m.groups()[:5])
                    print(f"      {case} rank {rank} resident (information only): {m.group(6)}")
                    # LoRA: the frozen base is most of the model, and sharded like the rest.
                    bound = size // 2 + largest + size // 10
                    check(peak <= bound and peak < size and (not lora or frozen > 0.95 * size),
                          f"{case} ({files}) rank {rank}: load peak {peak / 2**20:.2f} MiB <= model/2 + largest "
                          f"tensor + 10% = {bound / 2**20:.2f} MiB (model {size / 2**20:.2f} MiB, frozen "
                          f"{frozen / 2**20:.2f} MiB; held after load {held / 2**20:.2f} MiB)")
                    out = load_file(f"{prefix}{rank}.safetensors")
                    d_hf = (out[lora + "logits"] - hf_logits).abs().max().item()
                    d_whole = (out[lora + "logits"] - whole[lora + "logits"]).abs().max().item()
                    d_loss = abs(out[lora + "loss"].item() - whole[lora + "loss"].item())
                    d_step = (out[lora + "logits_after_step"] - whole[lora + "logits_after_step"]).abs().max().item()
                    # LoRA's B starts at zero: the logits are the base's until the step moves the adapters.
                    moved = (whole[lora + "logits_after_step"] - whole[lora + "logits"]).abs().max().item()
                    step_tol = 1e-6 if lora else 1e-5  # LoRA's step moves the logits less (1e-4)
                    check(d_hf <= 1e-5 and d_whole <= 1e-6 and d_loss <= 1e-6 and d_step <= step_tol and
                          moved > 10 * step_tol,
                          f"{case} rank {rank}: logits equal transformers' ({d_hf:.2e}) and one process's "
                          f"({d_whole:.2e}), loss ({d_loss:.2e}), logits after an SGD step ({d_step:.2e}; the "
                          f"step moved them {moved:.2e})")
        # A forward before load_model stops the rank with the parameter's name and the call to make.
        r = subprocess.run([launch, "launch", "--config_file", os.path.join(root, "zero_stage3.yaml"), check_bin,
                            "early", single, ids_file, "-"], capture_output=True, text=True, env=env)
        said = re.search(r"parameter '([^']+)' was built without memory \(empty weights\) and has not been loaded; "
                         r"a forward needs its values: call accelerator\.load_model\(model, dir\)",
                         r.stdout + r.stderr)
        check(r.returncode != 0 and said is not None and "ran a forward" not in r.stdout,
              f"zero_stage3: a forward before load_model stops, naming the parameter "
              f"({said.group(1) if said else None}) and load_model")
        if r.returncode == 0 or said is None:
            print(r.stdout[-2000:], r.stderr[-2000:])
        # DDP keeps parameters whole: it cannot take an empty model, and says why (naming the parameter).
        cfg = os.path.join(root, "ddp.yaml")
        with open(cfg, "w") as f:
            f.write("config_version: 1\nbackend: ddp\nuse_cpu: true\nnum_processes: 2\nmain_process_port: 0\n")
        r = subprocess.run([launch, "launch", "--config_file", cfg, check_bin, "refuse", single, ids_file, "-"],
                           capture_output=True, text=True, env=env)
        refused = re.findall(r"rank \d refused: .*parameter '([^']+)' was built empty \(from_pretrained_empty\).*"
                             r"accelerator\.load_model\(model, dir\)", r.stdout)
        check(r.returncode == 0 and len(refused) == 2,
              f"ddp: prepare refuses the empty model on both ranks, naming the parameter ({refused[:1]}) and "
              f"the fix")
        if r.returncode != 0 or len(refused) != 2:
            print(r.stdout[-2000:], r.stderr[-2000:])
    if FAILED:
        print(f"sharded load: {len(FAILED)} failed")
        return 1
    print("sharded load: no rank held the whole model, all equal")
    return 0


if __name__ == "__main__":
    sys.exit(main())
