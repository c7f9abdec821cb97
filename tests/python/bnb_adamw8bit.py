"""bitsandbytes' AdamW with 8-bit state on the CPU (the optimizer of HF's optim adamw_bnb_8bit / paged_adamw_8bit),
which tests/optim/adamw_8bit_test.cpp ([.bnb_adamw8bit]) compares with accel::optim::AdamW8bit.

  bnb_adamw8bit.py DIR   writes DIR/adamw8bit.safetensors: the dynamic maps, a tensor quantised blockwise by
                         bitsandbytes' reference kernel (backends/default) and by the CPU kernel, and three
                         steps of bnb.optim.AdamW(optim_bits=8) on a 5,000-element parameter (8-bit state) and a
                         300-element one (fp32 state below min_8bit_size): initial values, gradients, and the
                         parameters, codes and absmax after each step; then the same with bitsandbytes' reference
                         (de)quantisation kernels patched into its CPU optimizer (keys ref_*). Exit 77 when
                         bitsandbytes is missing.
"""
import pathlib
import sys

try:
    import torch
    import bitsandbytes as bnb
    import bitsandbytes.functional as F
    from bitsandbytes.backends.cpu import ops as cpu_ops
    from safetensors.torch import save_file
except ImportError as e:  # pragma: no cover
    print(f"bnb_adamw8bit: skipped ({e})")
    sys.exit(77)


# bitsandbytes 0.50.2's reference kernels (backends/default/ops.py, registered for devices without a compiled
# library), copied: the registered functions are not importable by name. The compiled CPU kernel quantises
# differently for a few values (see adamw_8bit_test.cpp).
def ref_quantize(A, code, blocksize):
    A_flat = A.reshape(-1).float()
    n = A_flat.numel()
    rem = n % blocksize
    full = n - rem
    blocks = full // blocksize
    A_com = A_flat[:full].reshape(blocks, blocksize)
    absmax = A_com.abs().max(dim=-1)[0]
    scaled = torch.clamp(A_com * (1.0 / absmax.clamp(min=1e-38).view(-1, 1)), -1, 1).reshape(-1)
    if rem:
        am = A_flat[full:].abs().max().clamp(min=1e-38)
        absmax = torch.cat([absmax, am.unsqueeze(0)])
        scaled = torch.cat([scaled, torch.clamp(A_flat[full:] / am, -1, 1)])
    bounds = (code[:-1] + code[1:]) / 2
    q = torch.bucketize(scaled, bounds, out_int32=True).to(torch.uint8)
    return q.reshape(A.shape), absmax


def ref_dequantize(A, absmax, code, blocksize):
    A_flat = A.reshape(-1)
    n = A_flat.numel()
    out = code[A_flat.to(torch.int64)]
    rem = n % blocksize
    full = n - rem
    blocks = full // blocksize
    if rem == 0:
        out = (out.reshape(-1, blocksize) * absmax.view(-1, 1)).reshape(n)
    else:
        out = torch.cat([(out[:full].reshape(blocks, blocksize) * absmax[:blocks].view(-1, 1)).reshape(full),
                         out[full:] * absmax[blocks]])
    return out.to(torch.float32).reshape(A.shape)


def run(t, prefix, init_big, init_small, grads):
    big = torch.nn.Parameter(init_big.clone())
    small = torch.nn.Parameter(init_small.clone())
    opt = bnb.optim.AdamW([big, small], lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, optim_bits=8)
    for step, (gb, gs) in enumerate(grads):
        big.grad, small.grad = gb.clone(), gs.clone()
        opt.step()
        st = opt.state[big]
        assert st["state1"].dtype == torch.uint8 and opt.state[small]["state1"].dtype == torch.float32
        t[f"{prefix}big_{step}"], t[f"{prefix}small_{step}"] = big.detach().clone(), small.detach().clone()
        t[f"{prefix}big_state1_{step}"], t[f"{prefix}big_state2_{step}"] = st["state1"].clone(), st["state2"].clone()
        t[f"{prefix}big_absmax1_{step}"] = st["absmax1"].clone()
        t[f"{prefix}big_absmax2_{step}"] = st["absmax2"].clone()


def main():
    out = pathlib.Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    t = {}
    t["map_signed"] = F.create_dynamic_map(signed=True)
    t["map_unsigned"] = F.create_dynamic_map(signed=False)
    g = torch.Generator().manual_seed(11)
    x = torch.randn(3 * 256 + 77, generator=g) * 0.03
    t["quant_input"] = x
    # bitsandbytes' reference (pure PyTorch) kernel, backends/default/ops.py, whose formulas ref_quantize copies.
    ref_codes, ref_absmax = ref_quantize(x, t["map_signed"], 256)
    t["quant_ref_codes"], t["quant_ref_absmax"] = ref_codes, ref_absmax
    cpu_codes, cpu_state = F.quantize_blockwise(x, code=t["map_signed"], blocksize=256)
    t["quant_cpu_codes"], t["quant_cpu_absmax"] = cpu_codes, cpu_state.absmax

    init_big = torch.randn(5000, generator=g)
    init_small = torch.randn(300, generator=g)
    t["big_init"], t["small_init"] = init_big, init_small
    grads = [(torch.randn(5000, generator=g) * 0.1, torch.randn(300, generator=g) * 0.1) for _ in range(3)]
    for step, (gb, gs) in enumerate(grads):
        t[f"big_grad_{step}"], t[f"small_grad_{step}"] = gb, gs
    run(t, "", init_big, init_small, grads)
    # The same optimizer code (bitsandbytes' _optimizer_update_8bit_blockwise_cpu) with its reference
    # (de)quantisation kernels in place of the compiled CPU ones: nearest codes.
    saved = cpu_ops._dequant_blockwise_fp32_direct, cpu_ops._quant_blockwise_fp32_direct

    def dequant_ref(a, absmax, code, blocksize):
        return ref_dequantize(a, absmax, code, blocksize)

    def quant_ref(a, code, absmax_out, out_uint8, blocksize):
        out, absmax = ref_quantize(a, code, blocksize)
        out_uint8.copy_(out)
        absmax_out.copy_(absmax)

    cpu_ops._dequant_blockwise_fp32_direct, cpu_ops._quant_blockwise_fp32_direct = dequant_ref, quant_ref
    try:
        run(t, "ref_", init_big, init_small, grads)
    finally:
        cpu_ops._dequant_blockwise_fp32_direct, cpu_ops._quant_blockwise_fp32_direct = saved
    save_file({k: v.contiguous() for k, v in t.items()}, str(out / "adamw8bit.safetensors"))
    print(f"bnb_adamw8bit: bitsandbytes {bnb.__version__} AdamW8bit, 3 CPU steps written")


if __name__ == "__main__":
    main()
