#!/usr/bin/env python3
"""Prints every tensor of a safetensors file with the Python reference implementation.

Usage: read_safetensors.py PATH

One line per tensor, sorted by name: `name dtype shape sum`, where dtype is the numpy dtype name, shape is
`[d0,d1,...]` (`[]` for a 0-d scalar) and sum is the exact sum of the elements (an integer for integer and bool
tensors, Python's repr of a float for floating-point tensors). Then one line `__metadata__ key=value` per
metadata entry, sorted by key. Used by CTest to check that files written by accelerate-cpp are readable by Python.
"""

import math
import sys

import numpy as np
from safetensors import safe_open
from safetensors.numpy import load_file


def describe(name, array):
    shape = "[" + ",".join(str(d) for d in array.shape) + "]"
    if np.issubdtype(array.dtype, np.floating):
        total = repr(math.fsum(float(x) for x in array.flat))
    else:
        total = str(sum(int(x) for x in array.flat))
    return f"{name} {array.dtype} {shape} {total}"


def main(argv):
    if len(argv) != 2:
        print("usage: read_safetensors.py PATH", file=sys.stderr)
        return 2
    path = argv[1]
    tensors = load_file(path)
    for name in sorted(tensors):
        print(describe(name, tensors[name]))
    with safe_open(path, framework="numpy") as f:
        metadata = f.metadata() or {}
    for key in sorted(metadata):
        print(f"__metadata__ {key}={metadata[key]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
