#!/usr/bin/python3
"""Opens every safetensors file under FOLDER with Debian's python3-safetensors (Debian 13 and
later) and prints, as one JSON object keyed by the file's path relative to FOLDER, its metadata
and each tensor's dtype, shape and values (as float64, flattened). Index files
(*.safetensors.index.json) are checked too: every file they name opens, and holds the tensors the
index says. tests/python_safetensors_test.cpp compares the output with the project's own reading.

  python_safetensors_check.py FOLDER
"""
import json
import os
import sys

import torch
from safetensors import safe_open
from safetensors.torch import load_file


def main():
    folder = sys.argv[1]
    found = {}
    for root, _, files in os.walk(folder):
        for name in sorted(files):
            path = os.path.join(root, name)
            relative = os.path.relpath(path, folder)
            if name.endswith(".safetensors"):
                with safe_open(path, framework="pt") as f:
                    metadata = f.metadata()
                tensors = load_file(path)
                found[relative] = {
                    "metadata": metadata,
                    "tensors": {k: {"dtype": str(v.dtype), "shape": list(v.shape),
                                    "values": v.to(torch.float64).flatten().tolist()} for k, v in tensors.items()},
                }
            elif name.endswith(".safetensors.index.json"):
                with open(path) as f:
                    index = json.load(f)
                for tensor, file in index["weight_map"].items():
                    with safe_open(os.path.join(root, file), framework="pt") as f:
                        if tensor not in f.keys():
                            raise SystemExit("%s names %s in %s, which lacks it" % (relative, tensor, file))
                found[relative] = {"weight_map": index["weight_map"]}
    print(json.dumps(found))


if __name__ == "__main__":
    main()
