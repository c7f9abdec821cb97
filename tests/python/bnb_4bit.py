#!/usr/bin/env python3
"""bitsandbytes' 4-bit quantisation (quantize_4bit / dequantize_4bit on the CPU) of seeded tensors, written as
raw little-endian files for the hidden Catch2 case "[.bnb]" of accel_torch_tests to compare with accel::quant.

  bnb_4bit.py OUTDIR      exit 77 when bitsandbytes cannot be imported (the test is then skipped)
"""
import os
import sys

try:
    import torch
    import bitsandbytes.functional as F
except Exception as e:  # noqa: BLE001 - any import failure means: cannot cross-check here
    print(f"SKIPPED: bitsandbytes is not importable here ({e})")
    sys.exit(77)


def main():
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    torch.manual_seed(0)
    cases = []
    # (name, shape, quant type, blocksize, double quantisation, scale): odd sizes, a short last block, real-ish
    # weight scales, a large tensor with several 256-blocks of absmax values.
    for name, shape, qt, bs, nested, scale in [
        ("nf4_small", (33, 70), "nf4", 64, False, 0.02),
        ("fp4_small", (33, 70), "fp4", 64, False, 0.02),
        ("nf4_dq", (512, 384), "nf4", 64, True, 0.05),
        ("fp4_dq", (512, 384), "fp4", 64, True, 0.05),
        ("nf4_odd", (7, 9), "nf4", 32, False, 1.0),
        ("nf4_dq_128", (300, 257), "nf4", 128, True, 3.0),
    ]:
        w = torch.randn(shape) * scale
        packed, state = F.quantize_4bit(w, blocksize=bs, quant_type=qt, compress_statistics=nested)
        deq = F.dequantize_4bit(packed, state)
        _, plain = F.quantize_4bit(w, blocksize=bs, quant_type=qt, compress_statistics=False)
        w.contiguous().numpy().tofile(f"{out}/{name}.input")
        packed.reshape(-1).numpy().tofile(f"{out}/{name}.packed")
        state.absmax.reshape(-1).numpy().tofile(f"{out}/{name}.absmax")
        deq.reshape(-1).float().numpy().tofile(f"{out}/{name}.deq")
        plain.absmax.float().numpy().tofile(f"{out}/{name}.absmax_true")
        if nested:
            state.state2.absmax.float().numpy().tofile(f"{out}/{name}.state2")
            state.offset.float().reshape(1).numpy().tofile(f"{out}/{name}.offset")
        cases.append(f"{name} {qt} {bs} {int(nested)} {w.numel()}")
    with open(f"{out}/cases.txt", "w") as f:
        f.write("\n".join(cases) + "\n")
    print(f"bitsandbytes {__import__('bitsandbytes').__version__}: wrote {len(cases)} cases to {out}")


if __name__ == "__main__":
    main()
