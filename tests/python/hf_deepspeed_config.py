"""What Hugging Face's Trainer makes of a DeepSpeed JSON file, for tests/trainer/deepspeed_trainer_test.cpp
([.hf_deepspeed]), which compares accel::deepspeed_trainer_config and the Trainer's DeepSpeed schedules with it.

- Filling and checking: transformers' own HfTrainerDeepSpeedConfig.trainer_config_process and
  trainer_config_finalize (transformers/integrations/deepspeed.py), run unchanged on accelerate's
  HfDeepSpeedConfig (transformers only subclasses it when deepspeed is installed; its methods are taken from
  the class as they are), for DeepSpeed files with "auto" everywhere, matching numbers and mismatching numbers:
  the filled keys and the mismatch list its ValueError raises.
- Schedules: DeepSpeed's WarmupLR, WarmupDecayLR and WarmupCosineLR, ported line by line below from DeepSpeed
  0.19.6 deepspeed/runtime/lr_schedules.py (WarmupLR lines 678-763, WarmupDecayLR 766-814, WarmupCosineLR
  817-928; deepspeed is not needed here), stepped as DeepSpeed's engine steps them (once after each applied
  optimizer step; the first step's rate set when constructed): the rate of each optimizer step.

  hf_deepspeed_config.py OUT_DIR   writes OUT_DIR/cases.json and the DeepSpeed files it names (exit 77 when
                                   transformers or accelerate is not importable)
"""
import json
import math
import os
import sys
import tempfile
import types

try:
    from accelerate.utils.deepspeed import HfDeepSpeedConfig
    from transformers import TrainingArguments
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig
except ImportError as e:  # pragma: no cover
    print(f"hf_deepspeed_config: skipped ({e})")
    sys.exit(77)


class TrainerDeepSpeedConfig(HfDeepSpeedConfig):
    """HfTrainerDeepSpeedConfig's own methods on accelerate's HfDeepSpeedConfig (its base when deepspeed is
    installed); __init__ as HfTrainerDeepSpeedConfig.__init__ minus the deepspeed import checks."""

    def __init__(self, config):
        super().__init__(config)
        self._dtype = None
        self.mismatches = []


for _name in ("dtype", "is_auto", "fill_match", "fill_only", "trainer_config_process", "trainer_config_finalize"):
    setattr(TrainerDeepSpeedConfig, _name, HfTrainerDeepSpeedConfig.__dict__[_name])


def training_args(world_size, **kw):
    class Args(TrainingArguments):
        pass

    Args.world_size = property(lambda self: world_size)
    return Args(output_dir=tempfile.gettempdir(), use_cpu=True, report_to="none", save_strategy="no", **kw)


TRAINER_KEYS = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size",
                "gradient_clipping", "optimizer", "scheduler")


def trainer_keys(config):
    """The keys accel-cpp keeps for the Trainer (Config::zero.trainer_keys), from a filled config."""
    out = {k: config[k] for k in TRAINER_KEYS if k in config}
    for block in ("fp16", "bf16"):
        if isinstance(config.get(block), dict) and "enabled" in config[block]:
            out[block] = {"enabled": config[block]["enabled"]}
    return out


ARGS = dict(per_device_train_batch_size=4, gradient_accumulation_steps=2, learning_rate=3e-4, adam_beta1=0.8,
            adam_beta2=0.95, adam_epsilon=1e-6, weight_decay=0.05, max_grad_norm=0.5, warmup_steps=5)


def ds_files():
    auto = {
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "train_batch_size": "auto",
        "gradient_clipping": "auto", "fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                  "weight_decay": "auto"}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                          "warmup_num_steps": "auto", "total_num_steps": "auto"}},
        "zero_optimization": {"stage": 2},
    }
    match = {
        "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "train_batch_size": 16,
        "gradient_clipping": 0.5, "bf16": {"enabled": True},
        "optimizer": {"type": "Adam", "params": {"lr": 3e-4, "betas": [0.8, 0.95], "eps": 1e-6,
                                                 "weight_decay": 0.05, "adam_w_mode": False}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.0003,
                                                     "warmup_num_steps": 5, "warmup_type": "linear"}},
        "zero_optimization": {"stage": 2},
    }
    mismatch = {
        "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 4, "train_batch_size": 64,
        "gradient_clipping": 1.0, "fp16": {"enabled": True}, "bf16": {"enabled": False},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8,
                                                  "weight_decay": 0.0}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 1e-5, "warmup_max_lr": 1e-3,
                                                          "warmup_num_steps": 10, "total_num_steps": 100}},
        "zero_optimization": {"stage": 1},
    }
    # Integers where TrainingArguments has floats (Python's 1 == 1.0), a partly given block, no warmup.
    partial = {
        "train_micro_batch_size_per_gpu": "auto", "gradient_clipping": 1, "train_batch_size": "auto",
        "optimizer": {"type": "adamw"},
        "scheduler": {"type": "WarmupCosineLR", "params": {"warmup_num_steps": "auto", "total_num_steps": "auto",
                                                           "cos_min_ratio": 0.1}},
        "zero_optimization": {"stage": 3},
    }
    return [("auto", auto, 1, dict(bf16=True)), ("match", match, 2, dict(bf16=True)),
            ("mismatch", mismatch, 2, {}), ("partial", partial, 2, dict(max_grad_norm=1.0, warmup_steps=0))]


def hf_case(name, ds, world, extra, steps, out_dir):
    path = os.path.join(out_dir, f"{name}.json")
    with open(path, "w") as f:
        json.dump(ds, f, indent=1)
    kw = dict(ARGS)
    kw.update(extra)
    args = training_args(world, **kw)
    hf = TrainerDeepSpeedConfig(json.loads(json.dumps(ds)))
    hf.trainer_config_process(args)
    model = types.SimpleNamespace(config=types.SimpleNamespace(hidden_size=16))
    message = ""
    try:
        hf.trainer_config_finalize(args, model, steps)
    except ValueError as e:
        message = str(e)
    mismatched = [line[len("- ds "):].split("=", 1)[0] for line in message.splitlines() if line.startswith("- ds ")]
    assert bool(message) == bool(mismatched), message
    return {"name": name, "file": path, "world_size": world, "num_training_steps": steps,
            "args": {**{k: getattr(args, k) for k in ARGS}, "fp16": args.fp16, "bf16": args.bf16},
            "warmup": args.get_warmup_steps(steps), "filled": trainer_keys(hf.config),
            "mismatched_keys": mismatched, "message": message}


# --- DeepSpeed 0.19.6 deepspeed/runtime/lr_schedules.py, ported (constructors' checks and logging left out) ---

class WarmupLR:  # lines 678-763
    def __init__(self, lr, warmup_min_lr=0.0, warmup_max_lr=None, warmup_num_steps=1000, warmup_type="log"):
        if warmup_max_lr is None:
            warmup_max_lr = lr  # [group['lr'] for group in self.optimizer.param_groups]
        self.min_lr = warmup_min_lr
        self.delta_lr = warmup_max_lr - warmup_min_lr
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = warmup_type if warmup_type in ("log", "linear") else "log"
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
        self.last_batch_iteration = -1
        self.lr = self.get_lr()

    def get_lr(self):
        if self.last_batch_iteration < 0:
            return self.min_lr
        gamma = self._get_gamma()
        return self.min_lr + (self.delta_lr * gamma)

    def step(self):
        self.last_batch_iteration = self.last_batch_iteration + 1
        self.lr = self.get_lr()

    def _get_gamma(self):
        if self.last_batch_iteration < self.warmup_num_steps:
            if self.warmup_type == "log":
                return self.inverse_log_warm_up * math.log(self.last_batch_iteration + 1)
            elif self.warmup_type == "linear":
                return self.last_batch_iteration / self.warmup_num_steps
        return 1.0


class WarmupDecayLR(WarmupLR):  # lines 766-814
    def __init__(self, lr, total_num_steps, warmup_min_lr=0.0, warmup_max_lr=0.001, warmup_num_steps=1000,
                 warmup_type="log"):
        self.total_num_steps = total_num_steps
        super().__init__(lr, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type)

    def _get_gamma(self):
        if self.last_batch_iteration < self.warmup_num_steps:
            if self.warmup_type == "log":
                return self.inverse_log_warm_up * math.log(self.last_batch_iteration + 1)
            elif self.warmup_type == "linear":
                return self.last_batch_iteration / self.warmup_num_steps
        return max(0.0, float(self.total_num_steps - self.last_batch_iteration) /
                   float(max(1.0, self.total_num_steps - self.warmup_num_steps)))


class WarmupCosineLR:  # lines 817-928
    def __init__(self, lr, total_num_steps, warmup_min_ratio=0.0, warmup_num_steps=1000, cos_min_ratio=0.0001,
                 warmup_type="log"):
        self.total_num_steps = total_num_steps
        self.last_batch_iteration = -1
        self.cos_min_ratio = cos_min_ratio
        self.warmup_type = warmup_type if warmup_type in ("log", "linear") else "log"
        self.warmup_min_ratio = warmup_min_ratio
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
        self.org_lr = lr
        self.lr = self.get_lr()

    def get_lr_ratio(self):
        if self.last_batch_iteration < 0:
            return 0.0
        if self.last_batch_iteration < self.warmup_num_steps:
            if self.warmup_type == "log":
                ratio = self.inverse_log_warm_up * math.log(self.last_batch_iteration + 1)
            elif self.warmup_type == "linear":
                ratio = self.last_batch_iteration / self.warmup_num_steps
            ratio_delta = 1. - self.warmup_min_ratio
            ratio = self.warmup_min_ratio + ratio * ratio_delta
            return ratio
        real_last_step = self.last_batch_iteration - self.warmup_num_steps + 1
        real_total_steps = max(1, self.total_num_steps - self.warmup_num_steps)
        cosine_progress = min(1.0, real_last_step / real_total_steps)
        ratio_delta = 1. - self.cos_min_ratio
        ratio = (1 + math.cos(math.pi * cosine_progress)) / 2
        ratio = max(0.0, self.cos_min_ratio + ratio_delta * ratio)
        return ratio

    def step(self):
        self.last_batch_iteration = self.last_batch_iteration + 1
        self.lr = self.get_lr()

    def get_lr(self):
        if self.last_batch_iteration < 0:
            return 0.0
        return self.org_lr * self.get_lr_ratio()


SCHEDULES = [
    ("WarmupLR", {"warmup_min_lr": 1e-5, "warmup_max_lr": 3e-3, "warmup_num_steps": 7}),  # log warmup
    ("WarmupLR", {"warmup_num_steps": 4, "warmup_type": "linear"}),  # max: the optimizer's rate
    ("WarmupLR", {"warmup_num_steps": 1}),  # DeepSpeed warms up over max(2, 1) steps
    ("WarmupDecayLR", {"warmup_min_lr": 0, "warmup_max_lr": 2e-3, "warmup_num_steps": 5, "total_num_steps": 20}),
    ("WarmupDecayLR", {"warmup_num_steps": 3, "total_num_steps": 12, "warmup_type": "linear"}),
    ("WarmupCosineLR", {"warmup_num_steps": 5, "total_num_steps": 20}),
    ("WarmupCosineLR", {"warmup_min_ratio": 0.1, "warmup_num_steps": 4, "total_num_steps": 16,
                        "cos_min_ratio": 0.05, "warmup_type": "linear"}),
    ("WarmupCosineLR", {"warmup_num_steps": 10, "total_num_steps": 6}),  # total below warmup
]


def schedule_rates(kind, params, lr, steps):
    s = {"WarmupLR": WarmupLR, "WarmupDecayLR": WarmupDecayLR, "WarmupCosineLR": WarmupCosineLR}[kind](lr, **params)
    rates = []
    for _ in range(steps):
        rates.append(s.lr)  # the rate this optimizer step uses
        s.step()  # the engine steps the schedule after the step
    return rates


def trainer_schedule():
    """The schedule tests/trainer/deepspeed_trainer_test.cpp's Trainer run fills: WarmupDecayLR, "auto" filled
    by HfTrainerDeepSpeedConfig from learning_rate 1e-2, warmup_steps 3 and 12 optimizer steps."""
    ds = {"scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                            "warmup_num_steps": "auto", "total_num_steps": "auto"}}}
    args = training_args(1, learning_rate=1e-2, warmup_steps=3)
    hf = TrainerDeepSpeedConfig(ds)
    hf.trainer_config_process(args)
    hf.trainer_config_finalize(args, None, 12)
    params = hf.config["scheduler"]["params"]
    return {"type": "WarmupDecayLR", "params": params, "lr": 1e-2,
            "rates": schedule_rates("WarmupDecayLR", params, 1e-2, 12)}


def main():
    out_dir = sys.argv[1]
    os.makedirs(out_dir, exist_ok=True)
    cases = [hf_case(name, ds, world, extra, 50, out_dir) for name, ds, world, extra in ds_files()]
    schedules = [{"type": kind, "params": params, "lr": 4e-4, "rates": schedule_rates(kind, params, 4e-4, 24)}
                 for kind, params in SCHEDULES] + [trainer_schedule()]
    with open(os.path.join(out_dir, "cases.json"), "w") as f:
        json.dump({"cases": cases, "schedules": schedules}, f, indent=1)
    print(f"hf_deepspeed_config: {len(cases)} DeepSpeed files through transformers' HfTrainerDeepSpeedConfig "
          f"({sum(len(c['mismatched_keys']) for c in cases)} mismatches), {len(schedules)} DeepSpeed schedules")


if __name__ == "__main__":
    main()
