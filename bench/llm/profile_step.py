#!/usr/bin/env python3
"""One LoRA training step of a Qwen2-0.5B-shaped model (random weights, fp32, one thread, one row of SEQ tokens:
what each of finetune_bench.py's 2 ranks does), profiled op by op on both sides, and the per-op-class table of
issue 51 ("Performance and memory"): where each side's step time goes, and how close to the fp32 GEMM roofline.

  ours:   build/bench/llm/profile_step (RecordFunction callbacks, op_recorder.hpp: self time per ATen op and
          autograd node in thread CPU time, which others' load does not inflate)
  theirs: transformers + PEFT, timed by the same recorder (build/bench/llm/libop_recorder.so through ctypes),
          the step the Trainer runs:
          model(input_ids, labels, num_items_in_batch).loss.backward(), clip_grad_norm_(1.0), AdamW, zero_grad

Both: LoRA r 8, alpha 16, dropout 0 on q_proj and v_proj; AdamW lr 1e-4 (ours ChunkedAdamW, bitwise
torch's); --warmup steps unprofiled, then --steps profiled (figures per step). The GEMM roofline: every GEMM
shape the two steps run is timed alone (torch.mm / addmm, one thread, best of a few) and the step's
GEMM FLOPs / that rate is the time the step's GEMMs would take at the standalone rate.
Classes: GEMM (mm, addmm, bmm, matmul, linear, and oneDNN's mkldnn::_linear_pointwise behind accel's
detail::linear, timed against torch.mm's MKL rate for its shape: self time, so composite ops count only their
own overhead),
SDPA (the flash-attention kernels, forward and backward), loss (cross-entropy ops; ours: the fused loss's
non-GEMM ops), optimizer (clip + AdamW + zero_grad), elementwise (other ATen compute ops), views/alloc,
autograd (autograd nodes' own time outside ATen ops). DDP's all-reduce is not in a one-process step: compare
the step's CPU time with finetune_bench.py's per-rank CPU per step.

  flock /tmp/accel-bigmem.lock .venv/bin/python bench/llm/profile_step.py --keep /tmp/prof_model
  .venv/bin/python bench/llm/profile_step.py --keep /tmp/prof_model --layers 4   # 4 of 24 layers, quick

It is a program, not a test: CI never runs it.
"""
import argparse
import collections
import json
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

GEMM = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::linear", "aten::addmv",
        "aten::mv", "aten::_addmm_activation", "mkldnn::_linear_pointwise"}
LOSS = {"aten::log_softmax", "aten::_log_softmax", "aten::_log_softmax_backward_data", "aten::nll_loss",
        "aten::nll_loss_forward", "aten::nll_loss_backward", "aten::nll_loss_nd", "aten::cross_entropy_loss",
        "aten::logsumexp"}
VIEWS = {"aten::view", "aten::reshape", "aten::transpose", "aten::t", "aten::expand", "aten::slice",
         "aten::select", "aten::unsqueeze", "aten::squeeze", "aten::as_strided", "aten::permute", "aten::detach",
         "aten::alias", "aten::_unsafe_view", "aten::empty", "aten::empty_strided", "aten::resize_",
         "aten::empty_like", "aten::narrow", "aten::split", "aten::chunk", "aten::contiguous", "aten::_reshape_alias",
         "aten::lift_fresh", "aten::detach_", "aten::result_type", "aten::numpy_T", "aten::expand_as",
         "aten::view_as", "aten::unbind", "aten::zeros", "aten::zeros_like", "aten::ones", "aten::ones_like",
         "aten::full", "aten::new_empty", "aten::new_zeros", "aten::new_empty_strided", "aten::is_nonzero",
         "aten::_has_compatible_shallow_copy_type", "aten::to", "aten::_to_copy"}


def parse_shapes(text):
    try:
        return json.loads(text) if isinstance(text, str) else text
    except ValueError:
        return []


def gemm_flops(name, shapes):
    """2 m k n of a GEMM op from its input shapes (0 for the composite ops, whose inner mm is counted)."""
    s = [x for x in shapes if isinstance(x, list)]
    try:
        if name == "aten::mm":
            (m, k), (_, n) = s[0], s[1]
            return 2 * m * k * n, (m, k, n)
        if name == "aten::addmm":
            (m, k), (_, n) = s[1], s[2]
            return 2 * m * k * n, (m, k, n)
        if name == "mkldnn::_linear_pointwise":  # oneDNN's x W^T: x [..., k], W [n, k] (accel's detail::linear)
            x, w = s[0], s[1]
            m = 1
            for d in x[:-1]:
                m *= d
            return 2 * m * x[-1] * w[0], (m, x[-1], w[0])
        if name == "aten::bmm":
            (b, m, k), (_, _, n) = s[0], s[1]
            return 2 * b * m * k * n, (m, k, n, b)
    except (ValueError, IndexError):
        pass
    return 0, None


def classify(phase, name):
    if phase == "optimizer":
        return "optimizer"
    if name in GEMM:
        return "GEMM"
    if "scaled_dot_product" in name or "flash_attention" in name or "FlashAttention" in name:
        return "SDPA"
    if name in LOSS or phase == "loss":
        return "loss"
    if name in VIEWS:
        return "views/alloc"
    if name.startswith("aten::"):
        return "elementwise"
    return "autograd"


# ---- transformers' side ---------------------------------------------------------------------------------
def hf_profile(model_dir, seq, warmup, steps, out, lib):
    import ctypes

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    rec = ctypes.CDLL(lib)  # after torch: its callbacks join this process's libtorch
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                             target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.0)
    ids = torch.randint(model.config.vocab_size, (1, seq))
    items = torch.tensor(seq - 1)

    def step():
        rec.op_recorder_phase(b"forward")
        loss = model(input_ids=ids, labels=ids, num_items_in_batch=items).loss
        rec.op_recorder_phase(b"backward")
        loss.backward()
        rec.op_recorder_phase(b"optimizer")
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        rec.op_recorder_phase(b"other")

    for _ in range(warmup):
        step()
    rec.op_recorder_start()
    c0, t0 = time.process_time(), time.perf_counter()
    for _ in range(steps):
        step()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    rec.op_recorder_stop()
    ops_path = out + ".ops"
    if rec.op_recorder_write(ops_path.encode()) != 0:
        raise RuntimeError(f"op_recorder_write {ops_path} failed")
    with open(ops_path) as f:
        ops = json.load(f)
    with open(out, "w") as f:
        json.dump({"side": "theirs", "steps": steps, "seq": seq, "step_s": wall / steps, "cpu_s": cpu / steps,
                   "ops": ops}, f)


# ---- the standalone GEMM rate per shape ---------------------------------------------------------------------
def gemm_rates(shapes, repeats=5):
    """{(m, k, n[, b]): GFLOP/s} of torch.mm / bmm alone on one thread, best of `repeats`, in thread CPU time."""
    import torch
    torch.set_num_threads(1)
    rates = {}
    for sh in shapes:
        m, k, n = sh[:3]
        b = sh[3] if len(sh) > 3 else None
        x = torch.randn((b, m, k) if b else (m, k))
        w = torch.randn((b, k, n) if b else (k, n))
        fn = (lambda: torch.bmm(x, w)) if b else (lambda: torch.mm(x, w))
        fn()
        flops = 2 * m * k * n * (b or 1)
        n_rep = max(1, int(2e9 / flops))
        best = float("inf")
        for _ in range(repeats):
            t = time.thread_time()  # CPU time: others' load does not count
            for _ in range(n_rep):
                fn()
            best = min(best, (time.thread_time() - t) / n_rep)
        rates[sh] = flops / best / 1e9
    return rates


def table(results, model_flops, rates):
    classes = ["GEMM", "SDPA", "elementwise", "loss", "optimizer", "views/alloc", "autograd"]
    rows = {}
    for side, r in results.items():
        per = collections.defaultdict(float)
        gemm_f, gemm_roof_s = 0.0, 0.0
        for o in r["ops"]:
            per[classify(o["phase"], o["name"])] += o["self_us"] / r["steps"] / 1e3
            f, sh = gemm_flops(o["name"], parse_shapes(o["shapes"]))
            if f:
                cnt = o["count"] / r["steps"]
                gemm_f += f * cnt
                gemm_roof_s += f * cnt / (rates[sh] * 1e9)
        rows[side] = (per, gemm_f, gemm_roof_s)
    print(f"\n| class (CPU ms per step, one rank) | " + " | ".join(results) + " |")
    print("|---|" + "---:|" * len(results))
    for c in classes:
        print(f"| {c} | " + " | ".join(f"{rows[s][0][c]:.0f} ({100 * rows[s][0][c] / sum(rows[s][0].values()):.1f}%)"
                                       for s in results) + " |")
    print("| sum of self times | " + " | ".join(f"{sum(rows[s][0].values()):.0f}" for s in results) + " |")
    print("| step wall / CPU (profiled) | " + " | ".join(
        f"{1e3 * results[s]['step_s']:.0f} / {1e3 * results[s]['cpu_s']:.0f}" for s in results) + " |")
    print("| GEMM GFLOP per step | " + " | ".join(f"{rows[s][1] / 1e9:.1f}" for s in results) + " |")
    print("| GEMM time at the standalone rate (ms) | " + " | ".join(f"{1e3 * rows[s][2]:.0f}" for s in results) + " |")
    print("| GEMM in-step GFLOP/s (GEMM FLOPs / GEMM self time) | " + " | ".join(
        f"{rows[s][1] / (rows[s][0]['GEMM'] / 1e3) / 1e9:.1f}" for s in results) + " |")
    big = max(rates, key=lambda sh: sh[0] * sh[1] * sh[2] * (sh[3] if len(sh) > 3 else 1))
    print(f"| model FLOPs / step CPU time / GEMM rate ({big[0]}x{big[1]}x{big[2]}: {rates[big]:.1f} GFLOP/s) | "
          + " | ".join(f"{model_flops / results[s]['cpu_s'] / 1e9 / rates[big]:.2f}" for s in results) + " |")
    print("| step's GEMM time at the standalone rates / step CPU time | " + " | ".join(
        f"{rows[s][2] / results[s]['cpu_s']:.2f}" for s in results) + " |")
    print("| GEMM self time / GEMM time at the standalone rates | " + " | ".join(
        f"{rows[s][0]['GEMM'] / 1e3 / rows[s][2]:.2f}" for s in results) + " |")
    print("\nlargest non-GEMM ops (ms per step: " + ", ".join(results) + ")")
    keyed = collections.defaultdict(lambda: {s: 0.0 for s in results})
    for side, r in results.items():
        for o in r["ops"]:
            c = classify(o["phase"], o["name"])
            if c in ("GEMM",):
                continue
            keyed[(c, o["name"], o["shapes"])][side] += o["self_us"] / r["steps"] / 1e3
    for key, v in sorted(keyed.items(), key=lambda kv: -max(kv[1].values()))[:40]:
        print(f"  {key[0]:<12} {key[1]:<55} {key[2][:60]:<60} " + " ".join(f"{v[s]:8.1f}" for s in results))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--build", default=os.path.join(ROOT, "build"))
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--keep", default="/tmp/profile_step_model", help="model directory (made once, reused)")
    p.add_argument("--sides", default="ours,theirs")
    p.add_argument("--hf-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--lib", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.hf_worker:
        hf_profile(a.keep, a.seq, a.warmup, a.steps, a.out, a.lib)
        return
    import finetune_bench
    marker = os.path.join(a.keep, f"layers{a.layers}")
    if not os.path.exists(marker):
        os.makedirs(a.keep, exist_ok=True)
        finetune_bench.make_model(a.keep, a.layers)
        open(marker, "w").close()
    shape = dict(finetune_bench.QWEN2_05B, num_hidden_layers=a.layers)
    model_flops = finetune_bench.flops_per_step(shape, a.seq, "lora") / finetune_bench.RANKS
    env = dict(os.environ, OMP_NUM_THREADS="1")
    results = {}
    for side in a.sides.split(","):
        out = os.path.join(a.keep, f"{side}_ops.json")
        if side == "ours":
            cmd = [os.path.join(a.build, "bench", "llm", "profile_step"), "--model", a.keep, "--seq", str(a.seq),
                   "--warmup", str(a.warmup), "--steps", str(a.steps), "--out", out]
        else:
            cmd = [sys.executable, os.path.abspath(__file__), "--hf-worker", "--keep", a.keep, "--seq", str(a.seq),
                   "--warmup", str(a.warmup), "--steps", str(a.steps), "--out", out,
                   "--lib", os.path.join(a.build, "bench", "llm", "libop_recorder.so")]
        subprocess.run(cmd, check=True, env=env)
        with open(out) as f:
            results[side] = json.load(f)
    shapes = set()
    for r in results.values():
        for o in r["ops"]:
            f, sh = gemm_flops(o["name"], parse_shapes(o["shapes"]))
            if f:
                shapes.add(sh)
    rates = gemm_rates(sorted(shapes))
    print("standalone GEMM rates (GFLOP/s, one thread): " +
          ", ".join(f"{'x'.join(map(str, sh))}: {r:.1f}" for sh, r in sorted(rates.items())))
    print(f"model FLOPs per step per rank (finetune_bench.py's count): {model_flops / 1e9:.1f} GFLOP")
    table(results, model_flops, rates)


if __name__ == "__main__":
    main()
