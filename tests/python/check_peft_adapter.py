"""Python's PEFT reads an adapter accelerate-cpp wrote and computes what the C++ model computed.

    check_peft_adapter.py <dir>   (dir written by accel_torch_tests "[.peft_export]")
Exits 77 (CTest: skipped) when the peft package is not importable.
"""
import sys

try:
    import peft  # noqa: F401
    from peft import PeftModel
except Exception as e:  # pragma: no cover
    print(f"check_peft_adapter: peft is not importable ({e}); skipped")
    sys.exit(77)
import torch
from safetensors.torch import load_file
from torch import nn


class Block(nn.Module):  # tests/nn/lora_test.cpp's Block
    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(6, 6)
        self.v_proj = nn.Linear(6, 6)
        self.norm = nn.LayerNorm(6)
        self.out = nn.Linear(6, 2)

    def forward(self, x):
        return self.out(self.norm(torch.relu(self.q_proj(x)) + self.v_proj(x)))


d = sys.argv[1]
base = load_file(d + "/base.safetensors")
x, want = base.pop("__input__"), base.pop("__output__")
model = Block()
model.load_state_dict(base)
model = PeftModel.from_pretrained(model, d + "/adapter")
model.eval()
with torch.no_grad():
    got = model(x)
err = (got - want).abs().max().item()
assert err < 1e-5, err
names = sorted(n for n, _ in model.named_parameters() if "lora_" in n or "modules_to_save" in n)
print(f"check_peft_adapter: peft {peft.__version__} loaded {len(names)} adapter tensors "
      f"({names[0]} ...); max |PEFT - accelerate-cpp| = {err:.2e}")
# The other way: PEFT writes changed adapters and the output they give, for the C++ side to load.
with torch.no_grad():
    for n, p in model.named_parameters():
        if "lora_" in n or "modules_to_save" in n:  # the adapters and PEFT's trained copy of norm
            p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(d + "/from_peft")
    y2 = model(x)
from safetensors.torch import save_file
save_file({"__input__": x, "__output__": y2}, d + "/peft_probe.safetensors")
