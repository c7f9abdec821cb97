#!/usr/bin/env python3
"""The fused causal-LM loss (accel::llm::fused_linear_cross_entropy through sft_loss) against transformers:
makes tiny Qwen2 models (tied and untied, fp32 and bf16) and batches (right-padded with an attention mask,
packed documents with restarting position ids, ignored labels, mean and num_items_in_batch), computes
transformers' loss and every parameter's gradient, and runs fused_loss_test "[.hf]" on them.

  fused_loss_reference.py <accel_llm_fused_loss_tests>      (exit 77: transformers not importable)
"""
import os
import subprocess
import sys
import tempfile

try:
    import torch
    from safetensors.torch import save_file
    from transformers import Qwen2Config, Qwen2ForCausalLM
except ImportError as e:  # pragma: no cover
    print(f"fused_loss_reference.py: {e}; skipped")
    sys.exit(77)

torch.set_num_threads(1)
SMALL = dict(vocab_size=211, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6, eos_token_id=None,
             bos_token_id=None, pad_token_id=None)


def make_case(out, name, tied, dtype, batch):
    torch.manual_seed(len(name))
    model = Qwen2ForCausalLM(Qwen2Config(**SMALL, tie_word_embeddings=tied))
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.normal_(0.0, 0.2) if p.dim() > 1 else p.normal_(1.0, 0.3) if "norm" in n else p.normal_(0, 0.3)
    d = os.path.join(out, name)
    model.save_pretrained(os.path.join(d, "model"))
    if dtype != torch.float32:  # as a user loads it (model.to(dtype) would also round the rotary inv_freq)
        model = Qwen2ForCausalLM.from_pretrained(os.path.join(d, "model"), dtype=dtype)
    model.train()
    kwargs = {k: v for k, v in batch.items() if k in ("attention_mask", "position_ids")}
    if "num_items_in_batch" in batch:
        kwargs["num_items_in_batch"] = int(batch["num_items_in_batch"])
    loss = model(batch["input_ids"], labels=batch["labels"], use_cache=False, **kwargs).loss
    loss.backward()
    ref = dict(batch, loss=loss.detach().float().reshape(1))
    for n, p in model.named_parameters():
        ref["grad." + n] = p.grad.float()
    save_file({k: v.contiguous() for k, v in ref.items()}, os.path.join(d, "reference.safetensors"))


def batches():
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, SMALL["vocab_size"], (3, 30), generator=g)
    labels = ids.clone()
    labels[0, :6] = -100  # a prompt
    mask = torch.ones_like(ids)
    mask[1, 21:] = 0  # right padding, as the collator pads
    labels[1, 21:] = -100
    padded = dict(input_ids=ids, labels=labels, attention_mask=mask)
    packed_pos = torch.cat([torch.arange(11), torch.arange(19)]).unsqueeze(0).expand(3, -1).contiguous()
    packed_labels = ids.clone()
    packed_labels[:, 0] = -100
    packed_labels[:, 11] = -100  # each document's first token predicts nothing from the one before
    packed = dict(input_ids=ids, labels=packed_labels, position_ids=packed_pos)
    items = dict(padded, num_items_in_batch=torch.tensor([100]))
    return padded, packed, items


def main():
    tests = sys.argv[1]
    padded, packed, items = batches()
    with tempfile.TemporaryDirectory() as out:
        cases = [("tied_padded", True, torch.float32, padded), ("untied_padded", False, torch.float32, padded),
                 ("tied_packed", True, torch.float32, packed), ("untied_items", False, torch.float32, items),
                 ("untied_bf16", False, torch.bfloat16, padded)]
        for name, tied, dtype, batch in cases:
            make_case(out, name, tied, dtype, batch)
        with open(os.path.join(out, "cases.txt"), "w") as f:
            f.write("\n".join(c[0] for c in cases) + "\n")
        print(f"reference: {len(cases)} cases made with transformers", flush=True)
        r = subprocess.run([tests, "[.hf]", "--use-colour", "no"], env=dict(os.environ, ACCEL_LLM_FUSED_REF_DIR=out),
                           capture_output=True, text=True)
        print(r.stdout[-6000:], r.stderr[-3000:])
        return r.returncode


if __name__ == "__main__":
    sys.exit(main())
