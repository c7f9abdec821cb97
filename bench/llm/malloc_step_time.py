#!/usr/bin/env python3
"""CPU seconds a training step takes per rank under glibc malloc settings, side by side (BENCHMARKS.md, the memory
table's tenth update): the recipe (`accel-launch train -t TYPE build/examples/llm/finetune`, 2 CPU ranks, one row
of --seq tokens per rank, as memory_check.py trains) on Qwen2.5-0.5B's shape, each setting run for 3 and --steps
steps, settings interleaved with the order reversed every other round. (cpu(steps) - cpu(3)) / (steps - 3) / 2 is
the CPU of a step per rank (user + sys of both ranks, getrusage of the children: loading and start-up cancel);
cpu(3) itself shows what a setting costs the loading.

    .venv/bin/python bench/llm/malloc_step_time.py [--build build] [--type qlora] [--seq 32] [--steps 18]
        [--rounds 2] [--settings default,mmap128k]

Settings: default (glibc's), mmap128k (MALLOC_MMAP_THRESHOLD_=131072: glibc's initial threshold, pinned),
jemalloc / tcmalloc (LD_PRELOAD of Debian's libjemalloc.so.2 / libtcmalloc_minimal.so.4, jemalloc with its own
defaults), jemalloc-runcpu (jemalloc with the MALLOC_CONF that torch.backends.xeon.run_cpu sets:
oversize_threshold:1,background_thread:true,metadata_thp:auto), or NAME=VAR=VALUE for any other environment
variable. Needs ~3 GB for the two ranks (qlora); run it under
flock /tmp/accel-bigmem.lock on a shared machine.
"""
import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import finetune_bench as fb  # noqa: E402
import memory_check as mc  # noqa: E402

JEMALLOC = "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"  # apt-get install libjemalloc2
TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"  # apt-get install libtcmalloc-minimal4
RUN_CPU_JEMALLOC_CONF = "oversize_threshold:1,background_thread:true,metadata_thp:auto"  # run_cpu's
KNOWN = {"default": {}, "mmap128k": {"MALLOC_MMAP_THRESHOLD_": "131072"},
         "jemalloc": {"LD_PRELOAD": JEMALLOC}, "tcmalloc": {"LD_PRELOAD": TCMALLOC},
         "jemalloc-runcpu": {"LD_PRELOAD": JEMALLOC, "MALLOC_CONF": RUN_CPU_JEMALLOC_CONF}}


def setting(text):
    if text in KNOWN:
        for var, value in KNOWN[text].items():
            if var == "LD_PRELOAD" and not os.path.exists(value):
                sys.exit(f"setting {text}: {value} is missing (apt-get install libjemalloc2 libtcmalloc-minimal4)")
        return text, KNOWN[text]
    name, var, value = text.split("=", 2)
    return name, {var: value}


def children_cpu():
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", default=os.path.join(fb.ROOT, "build"))
    ap.add_argument("--type", default="qlora")
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--steps", type=int, default=18)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--settings", default="default,mmap128k")
    a = ap.parse_args()
    settings = dict(setting(s) for s in a.settings.split(","))
    names = list(settings)
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {' '.join(sys.argv)}", flush=True)
    per_step = {n: [] for n in names}
    with tempfile.TemporaryDirectory(prefix="malloc_step_time_") as work:
        model = os.path.join(work, "0.5B")
        mc.make_model(model, {})
        data = os.path.join(work, "data.jsonl")
        fb.write_data(data, a.seq, 2 * a.steps + 4)
        for r in range(a.rounds):
            for name in names if r % 2 == 0 else names[::-1]:
                cpu = {}
                for steps in (3, a.steps):
                    cmd = [os.path.join(a.build, "launcher", "accel-launch"), "train", "-t", a.type,
                           os.path.join(a.build, "examples", "llm", "finetune"), "--model_name_or_path", model,
                           "--dataset", data, "--max_length", str(a.seq), "--output_dir", os.path.join(work, "out"),
                           "--per_device_train_batch_size", "1", "--max_steps", str(steps), "--logging_steps", "1",
                           "--save_strategy", "no", "--eval_strategy", "no", "--load_best_model_at_end", "false",
                           "--report_to", "none", "--disable_tqdm", "true"]
                    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", **settings[name])
                    before = children_cpu()
                    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                   cwd=fb.ROOT)
                    cpu[steps] = children_cpu() - before
                step = (cpu[a.steps] - cpu[3]) / (a.steps - 3) / 2
                per_step[name].append(step)
                print(f"round {r} {name}: {step:.3f} s CPU a step per rank; the 3-step run {cpu[3]:.1f} s CPU "
                      f"(both ranks); load {os.getloadavg()[0]:.1f}", flush=True)
    for name in names:
        v = per_step[name]
        print(f"{name}: mean {sum(v) / len(v):.3f} s CPU a step per rank ({', '.join(f'{x:.3f}' for x in v)})")


if __name__ == "__main__":
    main()
