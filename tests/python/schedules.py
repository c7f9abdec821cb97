"""Learning rates of PyTorch's schedulers, which tests/optim/schedulers_test.cpp compares with accel::sched.

transformers' warmup schedules are LambdaLR with the lambdas of transformers/optimization.py (copied here,
from before transformers was in the venv; cosine_with_min_lr calls transformers itself); OneCycleLR and ReduceLROnPlateau are PyTorch's own. One line per case: its
name, then the rate of group 0 at steps 0..N (and for OneCycleLR the momentum after them).

  schedules.py                 prints them (regenerate: schedules.py > tests/data/pytorch_schedules.txt)
  schedules.py --check FILE    exits 1 unless FILE holds exactly what this PyTorch computes (run by
                               python_crosschecks.py, so the checked-in rates stay PyTorch's)
"""
import math
import sys

import torch
from torch.optim.lr_scheduler import LambdaLR, OneCycleLR, ReduceLROnPlateau


def constant_with_warmup(w):
    return lambda s: float(s) / float(max(1.0, w)) if s < w else 1.0


def linear_with_warmup(w, total):
    def f(s):
        if s < w:
            return float(s) / float(max(1, w))
        return max(0.0, float(total - s) / float(max(1, total - w)))
    return f


def cosine_with_warmup(w, total, cycles=0.5):
    def f(s):
        if s < w:
            return float(s) / float(max(1, w))
        progress = float(s - w) / float(max(1, total - w))
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * float(cycles) * 2.0 * progress)))
    return f


def polynomial_with_warmup(lr_init, w, total, lr_end, power):
    def f(s):
        if s < w:
            return float(s) / float(max(1, w))
        if s > total:
            return lr_end / lr_init
        pct_remaining = 1 - (s - w) / (total - w)
        return ((lr_init - lr_end) * pct_remaining**power + lr_end) / lr_init
    return f


def params():
    return [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))]


def groups(p):
    return [{"params": [p[0]], "lr": 0.1}, {"params": [p[1]], "lr": 0.02}]


def lambda_case(name, factor, steps):
    opt = torch.optim.SGD(groups(params()), lr=0.1)
    sched = LambdaLR(opt, factor)
    rates = [opt.param_groups[1]["lr"]]
    for _ in range(steps):
        opt.step()
        sched.step()
        rates.append(opt.param_groups[1]["lr"])
    emit(name, rates)


LINES = []


def emit(name, values):
    LINES.append(" ".join([name, *[repr(v) for v in values]]))


lambda_case("constant_with_warmup", constant_with_warmup(5), 12)
lambda_case("linear_with_warmup", linear_with_warmup(3, 10), 12)
lambda_case("cosine_with_warmup", cosine_with_warmup(3, 10, 0.5), 12)
lambda_case("cosine_with_warmup_2cycles", cosine_with_warmup(2, 12, 2.0), 14)
lambda_case("polynomial_with_warmup", polynomial_with_warmup(0.1, 2, 10, 1e-3, 2.0), 12)


# transformers' own cosine_with_min_lr (the Trainer's lr_scheduler_type cosine_with_min_lr with lr_scheduler_kwargs
# min_lr or min_lr_rate), called as the Trainer calls it: min_lr is divided by optimizer.defaults["lr"] (0.1).
def transformers_case(name, make, steps):
    opt = torch.optim.SGD(groups(params()), lr=0.1)
    sched = make(opt)
    rates = [opt.param_groups[1]["lr"]]
    for _ in range(steps):
        opt.step()
        sched.step()
        rates.append(opt.param_groups[1]["lr"])
    emit(name, rates)


try:
    from transformers.optimization import get_cosine_with_min_lr_schedule_with_warmup
except ImportError as e:  # pragma: no cover
    print(f"schedules.py: skipped, transformers is not importable ({e})")
    sys.exit(77)
transformers_case("cosine_with_min_lr_rate",
                  lambda o: get_cosine_with_min_lr_schedule_with_warmup(o, 3, 10, min_lr_rate=0.1), 12)
transformers_case("cosine_with_min_lr_2cycles",
                  lambda o: get_cosine_with_min_lr_schedule_with_warmup(o, 2, 12, num_cycles=1.5, min_lr=0.01), 14)


def one_cycle(name, opt, momentum_of, **kwargs):
    sched = OneCycleLR(opt, **kwargs)
    rates, momenta = [opt.param_groups[0]["lr"]], [momentum_of(opt.param_groups[0])]
    for _ in range(kwargs["total_steps"]):
        opt.step()
        sched.step()
        rates.append(opt.param_groups[0]["lr"])
        momenta.append(momentum_of(opt.param_groups[0]))
    emit(name, rates)
    emit(name + "_momentum", momenta)


one_cycle("one_cycle_sgd", torch.optim.SGD(params(), lr=0.1, momentum=0.9), lambda g: g["momentum"],
          max_lr=0.5, total_steps=20)
one_cycle("one_cycle_adam_three_phase_linear", torch.optim.Adam(params(), lr=0.1), lambda g: g["betas"][0],
          max_lr=0.01, total_steps=15, pct_start=0.4, anneal_strategy="linear", three_phase=True,
          div_factor=10.0, final_div_factor=100.0)

opt = torch.optim.SGD(params(), lr=0.1)
plateau = ReduceLROnPlateau(opt, mode="min", factor=0.5, patience=2, threshold=0.1, cooldown=1, min_lr=0.004)
rates = []
for metric in [1.0, 0.95, 0.99, 0.98, 0.97, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.1, 1.2, 1.3, 1.4, 1.5]:
    plateau.step(metric)
    rates.append(opt.param_groups[0]["lr"])
emit("plateau", rates)

TEXT = "\n".join(LINES) + "\n"
if len(sys.argv) == 3 and sys.argv[1] == "--check":
    with open(sys.argv[2], encoding="utf-8") as f:
        stored = f.read()
    if stored != TEXT:
        for want, got in zip(stored.splitlines(), LINES):
            if want != got:
                print(f"schedules.py: {sys.argv[2]} has\n  {want}\nwhere this PyTorch computes\n  {got}")
        print(f"schedules.py: {sys.argv[2]} is not PyTorch {torch.__version__}'s rates; regenerate it with "
              f"python tests/python/schedules.py > {sys.argv[2]} and review the diff")
        sys.exit(1)
    print(f"schedules.py: {sys.argv[2]} holds PyTorch {torch.__version__}'s rates ({len(LINES)} cases)")
elif len(sys.argv) == 1:
    sys.stdout.write(TEXT)
else:
    sys.exit("usage: schedules.py [--check FILE]")
