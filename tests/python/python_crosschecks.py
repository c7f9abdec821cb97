#!/usr/bin/env python3
"""Runs schedules.py --check, check_peft_adapter.py and bnb_4bit.py in one Python process: importing peft (with transformers) and
bitsandbytes (with torch's compiler stack) takes ~25 s here, which two processes paid twice.

  python_crosschecks.py PEFT_DIR BNB_DIR

Each script runs as its own __main__ with its own argv. Exit 77 (CTest: skipped) when either reports it
cannot run here (its package not importable): the whole check is then reported skipped, never half of it.
"""
import pathlib
import runpy
import sys

HERE = pathlib.Path(__file__).resolve().parent


def run(script, *args):
    sys.argv = [str(HERE / script), *args]
    try:
        runpy.run_path(str(HERE / script), run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if code != 0:
            if code != 77:
                print(f"python_crosschecks: {script} failed with exit code {code}")
            sys.exit(code)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python_crosschecks.py PEFT_DIR BNB_DIR")
    peft_dir, bnb_dir = sys.argv[1], sys.argv[2]
    # PyTorch's scheduler rates that tests/optim/schedulers_test.cpp reads from the checked-in file.
    run("schedules.py", "--check", str(HERE.parent / "data" / "pytorch_schedules.txt"))
    run("check_peft_adapter.py", peft_dir)
    run("peft_all_linear.py", peft_dir)
    run("bnb_4bit.py", bnb_dir)
    run("bnb_adamw8bit.py", bnb_dir)
    run("hf_trainer_order.py", str(pathlib.Path(bnb_dir) / "hf_order.txt"))
    run("hf_deepspeed_config.py", str(pathlib.Path(bnb_dir) / "hf_deepspeed"))
