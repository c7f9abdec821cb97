"""accel-launch estimate-memory --model_config: the parameter counts it reads from a config.json equal
transformers' (sum of p.numel() over the model built on the meta device, no weights) for the shapes users fine-tune
(Qwen2.5 0.5B / 1.5B / 7B, Qwen3 0.6B, Llama 3.1 8B, a tied and an untied case), and the LoRA adapters' trainable
count equals PEFT's on the same model (r 16 on q/k/v/o and on all-linear). With a training type that trains the
embedding (full, deepspeed) the estimate names its transient (autograd's [vocab, hidden] fp32 gradient beside its
bucket or shard, twice with a tied head: transformers' tie_word_embeddings); none where the embedding is frozen
(lora) or the layout counts it among its gathered units (stage3). With qlora (load_in_4bit) the elements it
counts as 4-bit are the blocks' nn.Linear weights (what transformers' bitsandbytes integration replaces: every
Linear but the output head), and the rest (embedding, norms, biases, an untied head) stay full precision.
With minimal (ZeRO-3, LoRA on every projection, a float32 base) the units it counts gathered at once are
the largest module's own parameters (DeepSpeed's unit: transformers' embedding, or an untied head) and a
block's largest nn.Linear (weight and bias), with two gradient buffers of PEFT's largest lora_A / lora_B.

    python estimate_memory_check.py build/launcher/accel-launch
"""
import json
import os
import re
import subprocess
import sys
import tempfile

try:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config
except ImportError as e:  # the venv lacks a peer: skipped, and counted as such
    print(f"estimate_memory_check: skipped ({e})")
    sys.exit(77)

SHAPES = {
    "qwen2.5-0.5b": Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True),
    "qwen2.5-1.5b": Qwen2Config(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                                num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True),
    "qwen2.5-7b": Qwen2Config(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                              num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False),
    "qwen3-0.6b": Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                              num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "llama-3.1-8b": LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False),
}


def ours(launch, config_path, extra):
    out = subprocess.run([launch, "estimate-memory", "--model_config", config_path, *extra], capture_output=True,
                         text=True)
    if out.returncode != 0:
        raise SystemExit(f"estimate-memory failed: {out.stderr}")
    return out.stdout


def check_activation_options(launch, path):
    """--max_length adds the activations (their values are checked against CpuMemoryCounter by
    accel_llm_models_tests' "activation estimate" case); here the options' wiring: none without it, the type's
    batch and gradient checkpointing unless given, and the total with them."""
    failures = 0

    def case(what, ok):
        nonlocal failures
        failures += not ok
        print(f"activations: {what} {'ok' if ok else 'DIFFERENT'}")

    plain = ours(launch, path, ["--type", "lora"])
    case("excluded without --max_length, and said so",
         "activations=" not in plain and "Activations are not included" in plain)
    def parse(text):
        found = re.search(r"activations: (\d+) row\(s\) of (\d+) tokens.*gradient checkpointing (on|off)", text)
        return (found.groups() if found else None), int(re.search(r"activations=(\d+)", text).group(1))
    shape, _ = parse(ours(launch, path, ["--type", "lora", "--max_length", "128"]))
    case(f"lora.yaml's per_device_train_batch_size and checkpointing {shape}", shape == ("64", "128", "off"))
    shape, on = parse(ours(launch, path, ["--type", "minimal", "--max_length", "128",
                                          "--per_device_train_batch_size", "2"]))
    case(f"minimal.yaml's gradient_checkpointing {shape}", shape == ("2", "128", "on"))
    text = ours(launch, path, ["--type", "minimal", "--max_length", "128", "--per_device_train_batch_size", "2",
                               "--gradient_checkpointing=false"])
    shape, off = parse(text)
    case(f"--gradient_checkpointing=false {shape}, {off} bytes against {on}", shape == ("2", "128", "off") and off > on)
    state = sum(int(v) for v in re.findall(r"(?:total|gathered)=(\d+)", text))
    total = float(re.search(r"total with activations.*: ([0-9.]+) MiB", text).group(1))
    case(f"total with activations {total} MiB", abs(total - (state + off) / 2**20) < 0.01)
    return failures


def main():
    launch = sys.argv[1]
    failures = 0
    with tempfile.TemporaryDirectory() as work:
        for name, config in SHAPES.items():
            path = os.path.join(work, name + ".json")
            config.to_json_file(path)
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(config)
            expected = sum(p.numel() for p in model.parameters())
            text = ours(launch, path, ["--num_processes", "1"])
            got = int(re.search(r"(\d+) parameters:", text).group(1))
            ok = got == expected
            failures += not ok
            print(f"{name}: transformers {expected}, estimate-memory {got} {'ok' if ok else 'DIFFERENT'}")
            tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
            embedding = model.get_input_embeddings().weight.numel()
            trained = 4 * embedding * (2 if tied else 1)
            for kind, want in (("full", trained), ("deepspeed", trained), ("lora", 0), ("stage3", 0)):
                found = re.search(r"transient=(\d+)", ours(launch, path, ["--type", kind]))
                got = int(found.group(1)) if found else 0
                ok = got == want
                failures += not ok
                print(f"{name} {kind}: transient {got}, want {want} ({'tied' if tied else 'untied'} head) "
                      f"{'ok' if ok else 'DIFFERENT'}")
            quantised = sum(m.weight.numel() for n, m in model.named_modules()
                            if isinstance(m, torch.nn.Linear) and m is not model.get_output_embeddings())
            text = ours(launch, path, ["--type", "qlora"])
            found = re.search(r"\((\d+) projection weights; the other (\d+) elements", text)
            got = (int(found.group(1)), int(found.group(2))) if found else None
            ok = got == (quantised, expected - quantised)
            failures += not ok
            print(f"{name} qlora: 4-bit and full-precision elements {got}, transformers' Linear4bit would "
                  f"take {quantised} of {expected} {'ok' if ok else 'DIFFERENT'}")
            own = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
            block_linear = max(m.weight.numel() + (m.bias.numel() if m.bias is not None else 0)
                               for m in model.model.layers.modules() if isinstance(m, torch.nn.Linear))
            with torch.device("meta"):
                peft_model = get_peft_model(model, LoraConfig(
                    r=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                          "down_proj"]))
            lora_matrix = max(p.numel() for n, p in peft_model.named_parameters() if "lora_" in n)
            peft_model.unload()
            text = ours(launch, path, ["--type", "minimal", "--num_processes", "2"])
            found = re.search(r"the largest unit \((\d+) elements\) and a block's largest Linear \((\d+)\).*"
                              r"at most (\d+) elements", text)
            got = tuple(int(g) for g in found.groups()) if found else None
            gathered = int(re.search(r"gathered=(\d+)", text).group(1))
            want = 4 * (own + block_linear) + 8 * lora_matrix
            ok = got == (own, block_linear, lora_matrix) and gathered == want
            failures += not ok
            print(f"{name} minimal: gathered units {got}, transformers / PEFT {(own, block_linear, lora_matrix)}, "
                  f"bytes {gathered} (want {want}) {'ok' if ok else 'DIFFERENT'}")
            for targets in (["q_proj", "k_proj", "v_proj", "o_proj"], "all-linear"):
                # On the meta device too: the adapters' shapes are all that is counted (allocating and
                # initialising an 8B model's adapters in memory cost ~10 s of CPU).
                with torch.device("meta"):
                    peft_model = get_peft_model(model, LoraConfig(r=16, target_modules=targets))
                trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
                peft_model.unload()
                model_file = os.path.join(work, "lora.model.yaml")
                flat = targets if isinstance(targets, str) else "[" + ", ".join(targets) + "]"
                with open(model_file, "w") as f:
                    f.write(f"use_peft: true\nlora_r: 16\nlora_target_modules: {flat}\n")
                templates = os.path.join(work, "templates", "trainer")
                os.makedirs(templates, exist_ok=True)
                os.replace(model_file, os.path.join(templates, "lora.model.yaml"))
                for suffix in ("accelerate.yaml", "yaml"):
                    src = os.path.join(os.path.dirname(__file__), "..", "..", "config_templates", "trainer",
                                       "lora." + suffix)
                    with open(src) as s, open(os.path.join(templates, "lora." + suffix), "w") as d:
                        d.write(s.read())
                text = ours(launch, path, ["--type", "lora", "--templates", os.path.join(work, "templates")])
                got = int(re.search(r"(\d+) trainable", text).group(1))
                ok = got == trainable
                failures += not ok
                print(f"{name} LoRA r 16 on {flat}: PEFT {trainable}, estimate-memory {got} "
                      f"{'ok' if ok else 'DIFFERENT'}")
        failures += check_activation_options(launch, os.path.join(work, "qwen2.5-0.5b.json"))
    print(f"estimate_memory_check: {len(SHAPES)} models, {failures} different")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
