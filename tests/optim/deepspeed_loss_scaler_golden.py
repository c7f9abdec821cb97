"""Prints the loss-scale sequences that tests/optim/grad_scaler_test.cpp expects, computed by DeepSpeed's own
DynamicLossScaler.update_scale. Needs DeepSpeed's deepspeed/runtime/fp16/loss_scaler.py (a DeepSpeed
checkout; no DeepSpeed install: its imports of deepspeed.comm, logger and DeepSpeedConfigObject are stubbed).

    python3 tests/optim/deepspeed_loss_scaler_golden.py path/to/DeepSpeed/deepspeed/runtime/fp16/loss_scaler.py

Pattern characters: '.' a clean step, 'x' an overflow; "raise" where DeepSpeed raises (overflow at the minimum).
"""
import importlib.util
import logging
import sys
import types

stub = types.ModuleType("deepspeed")
stub.comm = types.SimpleNamespace(get_rank=lambda: 0)
runtime = types.ModuleType("deepspeed.runtime")
config_utils = types.ModuleType("deepspeed.runtime.config_utils")
config_utils.DeepSpeedConfigObject = type("DeepSpeedConfigObject", (), {"__init__": lambda self: None})
utils = types.ModuleType("deepspeed.utils")
utils.logger = logging.getLogger("deepspeed")
sys.modules.update({"deepspeed": stub, "deepspeed.runtime": runtime, "deepspeed.runtime.config_utils": config_utils,
                    "deepspeed.utils": utils})
spec = importlib.util.spec_from_file_location("loss_scaler", sys.argv[1])
loss_scaler = importlib.util.module_from_spec(spec)
spec.loader.exec_module(loss_scaler)

CASES = [  # pattern, loss_scale_window, hysteresis, consecutive_hysteresis, min_loss_scale, initial scale
    ("....x.x....x.xx.......", 3, 2, False, 1, 2**4),
    ("..x.x.x.x...xx.x......", 2, 3, True, 1, 2**3),
    ("xxxxxxxx", 1, 1, False, 1, 2**3),
    ("x.x.x..x.........", 4, 2, False, 2, 2**2),
]
for pattern, window, hysteresis, consecutive, minimum, init in CASES:
    s = loss_scaler.DynamicLossScaler(init_scale=init, scale_window=window, min_scale=minimum,
                                      delayed_shift=hysteresis, consecutive_hysteresis=consecutive)
    out = []
    for step in pattern:
        try:
            s.update_scale(step == "x")
        except Exception:
            out.append("raise")
            break
        out.append(s.cur_scale)
    print(pattern, window, hysteresis, consecutive, minimum, init, out)
