#!/usr/bin/env python3
"""Writes a known safetensors file with the Python reference implementation.

Usage: write_safetensors.py PATH

The C++ test "safetensors: read the file written by tests/python/write_safetensors.py" (hidden tag [crosscheck],
path in ACCEL_SAFETENSORS_CROSSCHECK_IN) checks every value below; keep the two in sync.
"""

import sys

import numpy as np
from safetensors.numpy import save_file


def main(argv):
    if len(argv) != 2:
        print("usage: write_safetensors.py PATH", file=sys.stderr)
        return 2
    tensors = {
        "weight": (np.arange(6, dtype=np.float32) * 0.5).reshape(2, 3),
        "bias": np.array([1.0, -1.0, 0.5], dtype=np.float16),
        "step": np.array(42, dtype=np.int64),
        "mask": np.array([True, False, False, True]),
        "ids": np.zeros((0,), dtype=np.int32),
        "bytes": np.array([[1, 2], [3, 250]], dtype=np.uint8),
        "i8": np.array([-5, 7], dtype=np.int8),
        "d": np.array([1e-3, 2.0], dtype=np.float64),
        "u16": np.array([65535], dtype=np.uint16),
    }
    save_file(tensors, argv[1], metadata={"format": "np", "source": "write_safetensors.py"})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
