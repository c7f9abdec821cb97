#!/usr/bin/env python3
"""Forward and full training step (AdamW) tokens/s of a Qwen2-0.5B-shaped model with random weights, fp32:
accel::llm (build/bench/llm/bench_models) against transformers on the same machine, threads and shape, run
interleaved (C++, Python, C++, Python, ...), each run in its own process (peak RSS is per process). Also the
measured fp32 GEMM rate, and each one's roofline ratio: FLOPs per step / step time / GEMM rate.

  bench/llm/models_bench.py build/bench/llm/bench_models [--rounds 2] [--seq 512] [--threads 2] [--steps 2]
      [--layers N] [--phases] [--modes forward,train]

Each round line also gives the process's CPU seconds (user + system) per timed step. --modes forward runs
the forward only. --layers N cuts the model to N layers (same vocabulary and width). --phases runs the
training step only and prints, for both sides, each phase's resident MB at its end and peak within it (VmHWM
reset through /proc/self/clear_refs at each mark) and a line as each layer's down_proj and the embedding get
their gradient: where the peak is, side by side (the peak then is the largest phase peak).

accel-cpp's linears run oneDNN's fp32 GEMM (accelerate_cpp/src/llm/models/fused_layer_ops.hpp); run the
bench with ACCEL_ONEDNN_LINEAR=0 in the environment for LibTorch's at::linear (MKL), transformers' kernels.

FLOPs per step: forward = 2 * tokens * (matmul parameters, lm_head included) + 4 * layers * tokens^2 * hidden
(attention scores and values, the causal half counted as computed); a training step = 3 x forward.
"""
import argparse
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time

QWEN2_05B = dict(model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                 num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, rms_norm_eps=1e-6,
                 max_position_embeddings=32768, tie_word_embeddings=True, hidden_act="silu",
                 rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})


def flops_per_forward(c, tokens):
    h, i, L, v = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]
    kv = c["num_key_value_heads"] * h // c["num_attention_heads"]
    per_layer = h * (2 * h + 2 * kv) + 3 * h * i
    return 2 * tokens * (L * per_layer + h * v) + 4 * L * tokens * tokens * h


class PhaseMarks:
    """--phases: the resident and peak MB since the last mark (bench_models prints the same lines)."""

    def __init__(self, on):
        self.on, self.step, self.max_peak = on, "", 0.0

    def mark(self, name):
        if not self.on:
            return
        with open("/proc/self/status") as f:
            kb = {line.split(":")[0]: float(line.split()[1]) for line in f if line.startswith(("VmRSS", "VmHWM"))}
        self.max_peak = max(self.max_peak, kb["VmHWM"] / 1024)
        print(f"phase {self.step} {name} rss_mb={kb['VmRSS'] / 1024:g} peak_mb={kb['VmHWM'] / 1024:g}", flush=True)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")


def python_worker(mode, seq, steps, threads, layers=0, phases=False):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    shape = {k: v for k, v in QWEN2_05B.items() if k != "model_type"}
    if layers:
        shape["num_hidden_layers"] = layers
    config = Qwen2Config(**shape)
    model = Qwen2ForCausalLM(config)
    ids = torch.randint(0, config.vocab_size, (1, seq))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    marks = PhaseMarks(phases and mode == "train")
    if marks.on:
        for name, p in model.named_parameters():
            if "down_proj" in name or "embed_tokens" in name:
                p.register_hook(lambda g, name=name: marks.mark("grad:" + name))

    def step():
        if mode == "train":
            model.train()
            marks.mark("start")
            opt.zero_grad()
            marks.mark("zero_grad")
            out = model(ids, labels=ids)
            loss = out.loss
            del out
            marks.mark("forward+loss")
            loss.backward()
            marks.mark("backward")
            opt.step()
            marks.mark("optimizer_step")
        else:
            model.eval()
            with torch.no_grad():
                model(ids)
    marks.step = "warmup0"
    step()
    start, cpu_start = time.perf_counter(), time.process_time()
    for i in range(steps):
        marks.step = f"step{i}"
        step()
    per_step = (time.perf_counter() - start) / steps
    cpu_per_step = (time.process_time() - cpu_start) / steps
    rss = marks.max_peak if marks.on else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"result mode={mode} tokens_per_s={seq / per_step} step_s={per_step} cpu_s={cpu_per_step} "
          f"peak_rss_mb={rss}")


def parse(line_text):
    m = re.search(r"result (.*)", line_text)
    if not m:
        raise RuntimeError(f"no result line in: {line_text[-2000:]}")
    return {k: (float(v) if k != "mode" else v) for k, v in (kv.split("=") for kv in m.group(1).split())}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("bench_models")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--layers", type=int, default=0, help="cut the model to this many layers (0: all 24)")
    ap.add_argument("--phases", action="store_true", help="training step only, with each phase's memory")
    ap.add_argument("--modes", default="forward,train", help="forward, train or both (comma-separated)")
    args = ap.parse_args()
    modes = ("train",) if args.phases else tuple(args.modes.split(","))
    if args.layers:
        QWEN2_05B["num_hidden_layers"] = args.layers
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), TRANSFORMERS_VERBOSITY="error")
    with tempfile.TemporaryDirectory() as d:
        config_path = os.path.join(d, "config.json")
        with open(config_path, "w") as f:
            json.dump(QWEN2_05B, f)
        results = {}
        gemm = parse(subprocess.run([args.bench_models, "--config", config_path, "--mode", "gemm", "--seq",
                                     str(args.seq), "--threads", str(args.threads)], env=env, check=True,
                                    capture_output=True, text=True).stdout)["gflops"]
        for r in range(args.rounds):
            for mode in modes:
                for who in ("accel-cpp", "transformers"):
                    cmd = ([args.bench_models, "--config", config_path, "--mode", mode, "--seq", str(args.seq),
                            "--steps", str(args.steps), "--threads", str(args.threads), "--phases",
                            str(int(args.phases))] if who == "accel-cpp" else
                           [sys.executable, __file__, "--worker", mode, str(args.seq), str(args.steps),
                            str(args.threads), str(args.layers), str(int(args.phases))])
                    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
                    for line in out.splitlines():
                        if line.startswith("phase "):
                            print(f"  {who} {line}", flush=True)
                    res = parse(out)
                    results.setdefault((mode, who), []).append(res)
                    print(f"round {r} {mode:8s} {who:13s} {res['tokens_per_s']:8.1f} tokens/s "
                          f"{res['step_s']:7.2f} s/step {res.get('cpu_s', 0):7.2f} CPU s/step "
                          f"peak RSS {res['peak_rss_mb']:7.0f} MB", flush=True)
        print(f"\nfp32 GEMM rate ({args.seq} x {QWEN2_05B['hidden_size']} x {QWEN2_05B['intermediate_size']}, "
              f"{args.threads} threads): {gemm:.1f} GFLOP/s\n")
        print("| step | accel-cpp tokens/s | transformers tokens/s | ratio | roofline accel-cpp | roofline "
              "transformers | peak RSS accel-cpp | peak RSS transformers |")
        print("|---|---|---|---|---|---|---|---|")
        for mode in modes:
            best = {who: max(results[(mode, who)], key=lambda x: x["tokens_per_s"]) for who in
                    ("accel-cpp", "transformers")}
            flops = flops_per_forward(QWEN2_05B, args.seq) * (3 if mode == "train" else 1)
            roof = {who: flops / best[who]["step_s"] / 1e9 / gemm for who in best}
            print(f"| {mode} | {best['accel-cpp']['tokens_per_s']:.1f} | {best['transformers']['tokens_per_s']:.1f} | "
                  f"{best['accel-cpp']['tokens_per_s'] / best['transformers']['tokens_per_s']:.2f}x | "
                  f"{roof['accel-cpp']:.0%} | {roof['transformers']:.0%} | "
                  f"{max(x['peak_rss_mb'] for x in results[(mode, 'accel-cpp')]):.0f} MB | "
                  f"{max(x['peak_rss_mb'] for x in results[(mode, 'transformers')]):.0f} MB |")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        python_worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]),
                      int(sys.argv[6]) if len(sys.argv) > 6 else 0, len(sys.argv) > 7 and sys.argv[7] == "1")
    else:
        main()
