#!/usr/bin/env python3
"""The LLM demo learns: runs `scripts/llm_demo.sh --quick` (tiny sizes) in a temporary directory and checks what
it shows: more held-out chat replies in the answer's form ("X plus Y is N.") after LoRA fine-tuning (plain LoRA,
no modules_to_save) than before, and both training runs' losses (trainer_state.json log_history) going down. The
right sums (in prose before, in the chat after) are printed, not required: the tiny run is too short to learn
them (the README run does).

  demo_check.py DEMO_SH BUILD_DIR
"""
import glob
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "scripts"))

try:
    import tokenizers  # noqa: F401
    import transformers  # noqa: F401
except ImportError as e:  # pragma: no cover
    print(f"SKIP: the demo needs tokenizers and transformers ({e})")
    sys.exit(77)

import llm_demo  # noqa: E402


def read_jsonl(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def losses(run_dir):
    states = [os.path.join(run_dir, "trainer_state.json")]
    states += sorted(glob.glob(os.path.join(run_dir, "checkpoint-*", "trainer_state.json")),
                     key=lambda p: int(p.split("checkpoint-")[-1].split(os.sep)[0]))
    states = [p for p in states if os.path.exists(p)]
    if not states:
        sys.exit(f"FAIL: no trainer_state.json in {run_dir}")
    return [v for _, v in llm_demo.losses(states[-1])]


def main():
    demo_sh, build = sys.argv[1], os.path.abspath(sys.argv[2])
    work = tempfile.mkdtemp(prefix="accel_llm_demo_")
    env = dict(os.environ, ACCEL_DEMO_SKIP_SETUP="1", ACCEL_DEMO_BUILD=build, ACCEL_DEMO_PYTHON=sys.executable)
    run = subprocess.run([demo_sh, "--quick", work], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True)
    print(run.stdout)
    if run.returncode != 0:
        sys.exit(f"FAIL: {demo_sh} --quick exited {run.returncode}")
    held = read_jsonl(os.path.join(work, "heldout.jsonl"))
    before = llm_demo.score(held, read_jsonl(os.path.join(work, "answers_before.jsonl")))
    after = llm_demo.score(held, read_jsonl(os.path.join(work, "answers_after.jsonl")))
    prose = llm_demo.score(held, read_jsonl(os.path.join(work, "answers_prose.jsonl")))
    pre, lora = losses(os.path.join(work, "pretrain")), losses(os.path.join(work, "lora"))
    print(f"demo: held-out right sums {prose[1]}/{prose[4]} in prose before (the base), chat: {before[1]}/{before[4]} "
          f"before, {after[1]}/{after[4]} after; replies "
          f"'a plus b is N.' {before[2]} before, {after[2]} after; in the form 'X plus Y is N.' {before[3]} before, "
          f"{after[3]} after; pretraining loss {pre[0]:.3f} -> {pre[-1]:.3f}, LoRA loss "
          f"{lora[0]:.3f} -> {lora[-1]:.3f}")
    failures = []
    # The tiny run (30 s) learns the chat reply's form; repeating the question's numbers and right sums need the
    # README run's longer pretraining, so they are printed, not required.
    if not after[3] > before[3]:
        failures.append("no more held-out replies in the form 'X plus Y is N.' after fine-tuning than before")
    if not (pre[-1] < pre[0] and lora[-1] < lora[0]):
        failures.append("a loss did not go down")
    if failures:
        sys.exit("FAIL: " + "; ".join(failures))
    subprocess.run(["rm", "-rf", work], check=False)
    print("demo: learns (the reply form after fine-tuning, losses down)")


if __name__ == "__main__":
    main()
