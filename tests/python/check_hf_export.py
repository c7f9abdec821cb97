"""Reads an accelerate-cpp save_model export the way the Hugging Face ecosystem does and compares it with a
reference file: python check_hf_export.py <export dir> <reference.safetensors> <max shard bytes>.

With model.safetensors.index.json it loads shard by shard as transformers' sharded loading does (the index's
weight_map names each tensor's shard; every shard is a safetensors file with metadata format=pt); otherwise it
loads model.safetensors. Exits non-zero with a message on any difference."""
import json
import os
import sys

import torch
from safetensors import safe_open
from safetensors.torch import load_file


def fail(message):
    print(f"check_hf_export: {message}", file=sys.stderr)
    sys.exit(1)


def main():
    directory, reference_path, max_bytes = sys.argv[1], sys.argv[2], int(sys.argv[3])
    index_path = os.path.join(directory, "model.safetensors.index.json")
    state = {}
    shards = 1
    if os.path.exists(index_path):
        with open(index_path) as f:
            index = json.load(f)
        weight_map = index["weight_map"]
        files = sorted(set(weight_map.values()))
        shards = len(files)
        want = [f"model-{k:05d}-of-{shards:05d}.safetensors" for k in range(1, shards + 1)]
        if files != want:
            fail(f"shard names {files}, want {want}")
        total = 0
        for name in files:
            with safe_open(os.path.join(directory, name), framework="pt") as shard:
                if (shard.metadata() or {}).get("format") != "pt":
                    fail(f"{name}: metadata format is not 'pt' (transformers refuses such files)")
                keys = list(shard.keys())
                size = 0
                for key in keys:
                    if weight_map.get(key) != name:
                        fail(f"{key} is in {name} but the index says {weight_map.get(key)}")
                    tensor = shard.get_tensor(key)
                    state[key] = tensor
                    size += tensor.numel() * tensor.element_size()
                if size > max_bytes and len(keys) > 1:
                    fail(f"{name} holds {size} bytes in {len(keys)} tensors, more than max_shard_size {max_bytes}")
                total += size
        if set(weight_map) != set(state):
            fail(f"the index lists {sorted(set(weight_map) - set(state))} that no shard holds")
        if index["metadata"]["total_size"] != total:
            fail(f"metadata.total_size {index['metadata']['total_size']}, the shards hold {total}")
    else:
        state = load_file(os.path.join(directory, "model.safetensors"))
    reference = load_file(reference_path)
    if set(reference) != set(state):
        fail(f"tensors {sorted(state)}, want {sorted(reference)}")
    for key, tensor in reference.items():
        if not torch.equal(tensor, state[key]):
            fail(f"{key} differs from the reference")
    print(f"check_hf_export: {len(state)} tensors in {shards} shard(s) read back bitwise by Python")


if __name__ == "__main__":
    main()
