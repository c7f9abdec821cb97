#!/usr/bin/env python3
"""accel::fp8's scaling arithmetic against torchao's float8 training functions (torchao.float8.float8_utils):
tensor-wise and row-wise scales (tensor_to_scale, with and without the "rowwise" recipe's power-of-two
rounding) and saturated casts (to_fp8_saturated) on the CPU, for random tensors over a wide range of
magnitudes. Exit 77 (skipped) when torchao is not importable.

  fp8_scaling_check.py FP8_SCALING_DUMP
"""
import subprocess
import sys

try:
    import torch
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_utils import tensor_to_scale, to_fp8_saturated
except ImportError as e:  # the package is missing: skipped, not passed
    print(f"fp8_scaling_check: torchao is not importable ({e}); skipped")
    sys.exit(77)

DTYPES = {"E4M3": torch.float8_e4m3fn, "E5M2": torch.float8_e5m2}


def fmt(values):
    return " ".join(repr(float(v)) for v in values)


def cases():
    gen = torch.Generator().manual_seed(52)
    for name in DTYPES:
        for rnd in (0, 1):
            for rows, cols in ((1, 64), (7, 33), (16, 5)):
                for log_scale in (-12, -3, 0, 4, 15):
                    x = torch.randn(rows, cols, generator=gen) * (2.0 ** log_scale)
                    yield ("rows", name, rnd, x)
        x = torch.randn(4096, generator=gen) * torch.exp2(torch.randint(-22, 20, (4096,), generator=gen).float())
        yield ("cast", name, None, x)


def main():
    requests, expected = [], []
    for kind, name, rnd, x in cases():
        dtype = DTYPES[name]
        if kind == "rows":
            rows, cols = x.shape
            requests.append(f"rows {name} {rnd} {rows} {cols} {fmt(x.flatten())}")
            want = tensor_to_scale(x, dtype, scaling_granularity=ScalingGranularity.AXISWISE, axiswise_dim=-1,
                                   round_scales_to_power_of_2=bool(rnd)).flatten()
        else:
            requests.append(f"cast {name} {fmt(x)}")
            want = to_fp8_saturated(x, dtype).float()
        expected.append((requests[-1][:40], want.tolist()))
    out = subprocess.run([sys.argv[1]], input="\n".join(requests) + "\n", capture_output=True, text=True,
                         check=True).stdout.splitlines()
    assert len(out) == len(expected), (len(out), len(expected))
    bad, values = 0, 0
    for line, (what, want) in zip(out, expected):
        got = [float.fromhex(t) for t in line.split()]
        assert len(got) == len(want), what
        for g, w in zip(got, want):
            values += 1
            if g != w:
                bad += 1
                if bad <= 10:
                    print(f"MISMATCH {what}...: accel-cpp {g!r}, torchao {w!r}")
    print(f"fp8_scaling_check: {len(out)} cases, {values} values, {bad} differ from torchao "
          f"(torchao {__import__('torchao').__version__})")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
