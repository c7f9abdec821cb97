#!/usr/bin/env python3
"""The memory table of docs/llm.md (bench/llm/memory_table.py: `accel-launch estimate-memory --model_config
config.json --type TYPE --num_processes N`) against measured per-rank peaks, for the sizes this machine holds.

For each model size and training type: `accel-launch train -t TYPE build/examples/llm/finetune` (the type's
three files of config_templates/trainer/, 2 CPU ranks) for a few steps of tiny batches (one row of --seq
tokens per rank), each rank's VmHWM (peak RSS) and largest RssAnon (its anonymous memory: what the process
allocated, without the pages of mapped files such as the memory-mapped checkpoint) polled from /proc every
0.2 s and read when the last step's log line arrives. The recipe runs one step more than --steps, so that what
the ranks do while that line reaches this script is a training step, never the recipe's final save (which is
not included; read at the last step itself, the reading could catch the save's first allocations).

The estimate is the training state (parameters, gradients, optimizer state) plus the step's activations
(`estimate-memory --max_length SEQ --per_device_train_batch_size 1`, as the runs train: what autograd keeps for
backward and the fused loss's chunk; --state-only leaves them out, the comparison before they were modelled); a
process also holds the runtime (LibTorch, the allocator's caches, the data). It is taken from a baseline run:
the same type on a model of the same vocabulary and sequence length but hidden size 64 and 1 layer, whose
estimate (its activations included) is subtracted from its measured peak; what remains is subtracted from each
larger run:

    measured state = peak RssAnon - (peak RssAnon of the baseline - estimate of the baseline)

and compared with the estimate (% difference), the estimate including what it names beside the state as held
for a moment while training (`transient=`: autograd's gradient of a trained embedding beside its bucket or
shard, twice with a tied head; `gathered=`; `activations=`). The raw peaks are printed too. glibc's free heap
(pages malloc keeps after the activations are freed) is no part of the estimate: pin its mmap threshold
(MALLOC_MMAP_THRESHOLD_=131072 in the environment, inherited by the ranks) to keep it out of the peak, and say so.
Another allocator is measured the same way: LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2 (or
libtcmalloc_minimal.so.4) in the environment reaches the ranks too (not with --heap, which preloads its sampler of
glibc's counters); the first line prints LD_PRELOAD and the MALLOC_* settings.

  .venv/bin/python bench/llm/memory_check.py [--sizes 0.5B-8L,0.5B] [--types lora,full,deepspeed]
      [--seq 32] [--steps 3] [--max-gib 14] [--extra 'MORE RECIPE ARGS'] [--json FILE] [--state-only] [--heap]

Sizes: 0.5B (Qwen2.5-0.5B), 0.5B-8L / 0.5B-4L / 0.5B-2L (its width with fewer layers), 0.5B-2L-untied,
0.5B-2L-untied-v32k (the same with a 32,768-token vocabulary: what the blocks add, without the [vocab, hidden]
terms), 0.5B-8L-v4k (8 blocks, 4,096 tokens: the blocks' gradients dominate), 1.5B (Qwen2.5-1.5B; ~9 GB for
minimal's two ranks). A run whose estimate (x 1.2, both ranks, with the baseline) exceeds --max-gib or
MemAvailable - 3 GiB is SKIPPED and listed. MEMORY_CHECK_SERIES=FILE appends each run's RssAnon trace and
step-line times (JSON lines), to see where the peak is. --heap samples glibc's counters in each rank
(bench/llm/malloc_sampler.c, preloaded; every 20 ms) and prints the peak split into malloc's live bytes, glibc's
free heap and what lies outside malloc, with the same comparison made on live bytes (baseline: its live peak less
its estimate): what the allocator keeps free is then out of both sides.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import finetune_bench as fb  # noqa: E402  (the tokenizer, data, process watcher)

ROOT = fb.ROOT
SIZES = {  # name -> overrides of Qwen2-0.5B's shape
    "0.5B": {},
    "0.5B-8L": {"num_hidden_layers": 8},
    "0.5B-4L": {"num_hidden_layers": 4},
    "0.5B-2L": {"num_hidden_layers": 2},
    "0.5B-2L-untied": {"num_hidden_layers": 2, "tie_word_embeddings": False},
    # The untied cut with a 32,768-token vocabulary: the blocks' share of an untied ZeRO-2 row without the
    # [vocab, hidden] gradients' (under 2.5 GB for the two ranks).
    "0.5B-2L-untied-v32k": {"num_hidden_layers": 2, "tie_word_embeddings": False, "vocab_size": 32768},
    # 8 blocks of the 0.5B width with a 4,096-token vocabulary: the blocks' gradients in flight dominate the
    # step's peak (ZeRO-2's bucket order), not the [vocab, hidden] ones.
    "0.5B-8L-v4k": {"num_hidden_layers": 8, "vocab_size": 4096},
    # Qwen2.5-1.5B (1.54 B parameters, tied; 6.2 GB in float32): every key that differs from the 0.5B shape (vocab,
    # 2 KV heads, rms_norm_eps, rope_theta and the tied head are the same).
    "1.5B": {"hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28, "num_attention_heads": 12,
             "max_position_embeddings": 131072},
}


def make_model(out_dir, overrides):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tok = fb.make_tokenizer(out_dir)
    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    torch.manual_seed(0)
    shape = dict(fb.QWEN2_05B, **overrides)
    Qwen2ForCausalLM(Qwen2Config(**shape, bos_token_id=eos, eos_token_id=eos, pad_token_id=eos)).save_pretrained(
        out_dir)
    return shape


def estimate(build, model_dir, kind, ranks, seq=None):
    """The estimate's state (total=) and what it names beside it: units gathered (stage 3), autograd's gradient of
    a trained embedding beside its bucket or shard (transient=) and, with `seq`, the step's activations for one
    row of `seq` tokens per rank (activations=: --max_length, --per_device_train_batch_size 1, as run() trains)."""
    cmd = [os.path.join(build, "launcher", "accel-launch"), "estimate-memory", "--model_config",
           os.path.join(model_dir, "config.json"), "--type", kind, "--num_processes", str(ranks)]
    if seq:
        cmd += ["--max_length", str(seq), "--per_device_train_batch_size", "1"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT).stdout
    total = int(re.search(r"total=(\d+)", out).group(1))

    def term(name):
        found = re.search(name + r"=(\d+)", out)
        return int(found.group(1)) if found else 0
    # The embedding's transient gradient comes at the end of backward, when the blocks' activations are freed:
    # the larger of the two (as estimate-memory's "total with activations").
    act, transient = term("activations"), term("transient")
    return total, term("gathered") + max(transient, act) - act, act


def heap_split(sample_dir, until):
    """The ranks' malloc_sampler.c traces up to `until` (CLOCK_MONOTONIC s): the largest live bytes (malloc's
    heap and mmapped chunks in use), and at the largest RssAnon sample its split: live, free inside glibc's heap,
    outside malloc. The rank with the largest RssAnon."""
    best = None
    for name in os.listdir(sample_dir):
        rows = []
        with open(os.path.join(sample_dir, name)) as f:
            for line in f:
                v = line.split()
                if len(v) == 6 and float(v[0]) <= until:
                    rows.append([float(x) for x in v])
        if not rows:
            continue
        top = max(rows, key=lambda r: r[5])
        split = {"live_peak": max(r[1] + r[2] for r in rows), "at_peak_live": top[1] + top[2],
                 "at_peak_free": top[4], "at_peak_outside": top[5] - top[3] - top[2], "rss_anon": top[5]}
        if best is None or split["rss_anon"] > best["rss_anon"]:
            best = split
    return best


def run(build, model_dir, data, kind, seq, steps, work, extra=(), sampler=None):
    cmd = [os.path.join(build, "launcher", "accel-launch"), "train", "-t", kind,
           os.path.join(build, "examples", "llm", "finetune"), "--model_name_or_path", model_dir, "--dataset", data,
           "--max_length", str(seq), "--output_dir", os.path.join(work, "out"), "--per_device_train_batch_size", "1",
           "--max_steps", str(steps + 1), "--logging_steps", "1", "--save_strategy", "no", "--eval_strategy", "no",
           "--load_best_model_at_end", "false", "--report_to", "none", "--disable_tqdm", "true", *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    sample_dir = None
    if sampler:  # --heap: each rank samples glibc's counters (malloc_sampler.c); allocation is unchanged
        sample_dir = tempfile.mkdtemp(prefix=f"heap_{kind}_", dir=work)
        env.update(LD_PRELOAD=sampler, MALLOC_SAMPLER_DIR=sample_dir, MALLOC_SAMPLER_EXE="/finetune")
    start = time.perf_counter()  # CLOCK_MONOTONIC, as the sampler's clock
    r = fb.run_side(cmd, env, lambda c: bool(c) and c[0].endswith("/finetune"), re.compile(r"'step': (\d+)"),
                    steps, os.path.join(work, f"{kind}.log"))
    if os.environ.get("MEMORY_CHECK_SERIES"):  # the ranks' RssAnon over time and the step lines, for a look
        with open(os.environ["MEMORY_CHECK_SERIES"], "a") as f:
            f.write(json.dumps({"model": model_dir, "type": kind, "steps": r["times"], "series": r["series"]}) + "\n")
    peaks = list(r["peaks"].values())
    heap = heap_split(sample_dir, start + r["times"][steps - 1]) if sample_dir else None
    return max(p["hwm"] for p in peaks), max(p["anon"] for p in peaks), len(peaks), heap


def build_sampler(work):
    """Compiles malloc_sampler.c beside this script into `work`; the library's path."""
    out = os.path.join(work, "libmalloc_sampler.so")
    subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", out, os.path.join(HERE, "malloc_sampler.c"),
                    "-lpthread"], check=True)
    return out


def heap_text(h):
    return (f"live peak {h['live_peak'] / 1e9:.3f} GB; at the RssAnon peak {h['rss_anon'] / 1e9:.3f}: live "
            f"{h['at_peak_live'] / 1e9:.3f}, glibc's free heap {h['at_peak_free'] / 1e9:.3f}, outside malloc "
            f"{h['at_peak_outside'] / 1e9:.3f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--sizes", default="0.5B-8L,0.5B")
    ap.add_argument("--types", default="lora,full,deepspeed")
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--max-gib", type=float, default=14.0, help="the most both ranks may need")
    ap.add_argument("--json", help="write the rows here too")
    ap.add_argument("--extra", default="", help="more recipe arguments (one string, split on spaces)")
    ap.add_argument("--state-only", action="store_true",
                    help="compare the training state alone (no activations in either estimate)")
    ap.add_argument("--heap", action="store_true",
                    help="split each peak into malloc's live bytes, glibc's free heap and the rest "
                         "(LD_PRELOAD of malloc_sampler.c, built with cc)")
    a = ap.parse_args()
    ranks = 2
    malloc = {k: v for k, v in os.environ.items()
              if k.startswith("MALLOC_") or k in ("ACCEL_MALLOC_TRIM", "LD_PRELOAD")}
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {' '.join(sys.argv)}; malloc settings: "
          f"{malloc or 'none set (accel-launch train preloads tcmalloc where installed, else glibc defaults)'}",
          flush=True)
    rows, skipped = [], []
    with tempfile.TemporaryDirectory(prefix="memory_check_") as work:
        data = os.path.join(work, "data.jsonl")
        fb.write_data(data, a.seq, ranks * a.steps + 2)
        base_dir = os.path.join(work, "baseline")
        make_model(base_dir, {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
                              "num_attention_heads": 4, "num_key_value_heads": 2})
        baseline, base_live = {}, {}
        sampler = build_sampler(work) if a.heap else None
        for size in a.sizes.split(","):
            model_dir = os.path.join(work, size)
            make_model(model_dir, SIZES[size])
            for kind in a.types.split(","):
                if kind not in baseline:
                    b_est, b_extra, b_act = estimate(a.build, base_dir, kind, ranks,
                                                     None if a.state_only else a.seq)
                    b_hwm, b_anon, _, b_heap = run(a.build, base_dir, data, kind, a.seq, a.steps, work,
                                                   a.extra.split(), sampler)
                    b_est += b_extra + b_act  # its transient and activations too, as each run's counts its own
                    baseline[kind] = b_anon - b_est
                    if b_heap:
                        base_live[kind] = b_heap["live_peak"] - b_est
                        print(f"  baseline {kind} heap: {heap_text(b_heap)}", flush=True)
                    print(f"  baseline {kind}: peak RssAnon {b_anon / 1e9:.3f} GB (VmHWM {b_hwm / 1e9:.3f}), "
                          f"estimate {b_est / 1e9:.3f} GB (activations {b_act / 1e9:.3f}): runtime "
                          f"{baseline[kind] / 1e9:.3f} GB",
                          flush=True)
                est, gathered, act = estimate(a.build, model_dir, kind, ranks, None if a.state_only else a.seq)
                gathered += act
                need = ranks * (est + gathered + baseline[kind]) * 1.2 / fb.GIB
                limit = min(a.max_gib, fb.mem_available_gib() - 3)
                if need > limit:
                    msg = f"SKIPPED {size} {kind}: needs ~{need:.1f} GiB for {ranks} ranks, limit {limit:.1f} GiB"
                    print(msg, flush=True)
                    skipped.append(msg)
                    continue
                hwm, anon, seen, heap = run(a.build, model_dir, data, kind, a.seq, a.steps, work, a.extra.split(),
                                            sampler)
                measured = anon - baseline[kind]
                row = {"size": size, "type": kind, "ranks": ranks, "estimate": est, "gathered": gathered,
                       "activations": act,
                       "vmhwm": hwm, "rss_anon": anon, "baseline": baseline[kind], "measured_state": measured,
                       "diff": (est + gathered - measured) / measured, "ranks_seen": seen}
                if heap:
                    # The same comparison on malloc's live bytes: glibc's free heap and what lies outside
                    # malloc taken out on both sides (the baseline's live peak less its estimate).
                    live_state = heap["live_peak"] - base_live[kind]
                    row.update(heap=heap, live_state=live_state, live_diff=(est + gathered - live_state) / live_state)
                    print(f"  {size} {kind} heap: {heap_text(heap)}; live state {live_state / 1e9:.3f} GB, "
                          f"estimate {row['live_diff']:+.1%} of it", flush=True)
                rows.append(row)
                print(f"  {size} {kind}: estimate {est / 1e9:.3f} GB (+{gathered / 1e9:.3f}: gathered, transient above "
                      f"the activations, activations {act / 1e9:.3f}), "
                      f"peak VmHWM {hwm / 1e9:.3f} GB, RssAnon {anon / 1e9:.3f} GB, state measured "
                      f"{measured / 1e9:.3f} GB, estimate {row['diff']:+.1%}", flush=True)
    print(f"\n| model | type | ranks | estimate per rank | peak RSS (VmHWM) | peak RssAnon | runtime "
          f"(baseline) | measured state | estimate vs measured |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        beside = r["gathered"] - r["activations"]
        act = f" + {r['activations'] / 1e9:.2f} activations" if r["activations"] else ""
        est = f"{r['estimate'] / 1e9:.2f}{act}" + (f" (+{beside / 1e9:.2f})" if beside else "")
        print(f"| {r['size']} | {r['type']} | {r['ranks']} | {est} GB | {r['vmhwm'] / 1e9:.2f} GB | "
              f"{r['rss_anon'] / 1e9:.2f} GB | {r['baseline'] / 1e9:.2f} GB | {r['measured_state'] / 1e9:.2f} GB | "
              f"{r['diff']:+.1%} |")
    if any("heap" in r for r in rows):
        print("\n| model | type | live peak | at the RssAnon peak: live / glibc's free heap / outside malloc | "
              "live state | estimate vs live state |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            if "heap" in r:
                h = r["heap"]
                print(f"| {r['size']} | {r['type']} | {h['live_peak'] / 1e9:.2f} GB | {h['at_peak_live'] / 1e9:.2f} / "
                      f"{h['at_peak_free'] / 1e9:.2f} / {h['at_peak_outside'] / 1e9:.2f} GB | "
                      f"{r['live_state'] / 1e9:.2f} GB | {r['live_diff']:+.1%} |")
    for s in skipped:
        print(s)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"argv": sys.argv, "rows": rows, "skipped": skipped}, f, indent=1)


if __name__ == "__main__":
    main()
