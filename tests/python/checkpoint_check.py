#!/usr/bin/python3
"""Reads a checkpoint folder written by Accelerator::save_state with the standard library only
(json and struct), as a Python user without accelerate-cpp would, and prints what it found as
one JSON object: every safetensors file's tensors (flat values) and metadata (the "json" entry
parsed), and every JSON file. The C++ tests (tests/checkpointing_test.cpp) compare it with the
state they saved.

  checkpoint_check.py FOLDER
"""
import json
import os
import struct
import sys

from safetensors_check import DTYPES, decode


def read_safetensors(path):
    with open(path, "rb") as f:
        blob = f.read()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n].decode("utf-8"))
    metadata = header.pop("__metadata__", {})
    if "json" in metadata:
        metadata["json"] = json.loads(metadata["json"])
    data = blob[8 + n:]
    tensors = {}
    for name, info in header.items():
        begin, end = info["data_offsets"]
        if info["dtype"] not in DTYPES:
            raise SystemExit("checkpoint_check: %s has dtype %s" % (name, info["dtype"]))
        tensors[name] = {"dtype": info["dtype"], "shape": info["shape"],
                         "values": decode(info["dtype"], data[begin:end]) if info["dtype"] != "U8" else end - begin}
    return {"metadata": metadata, "tensors": tensors}


def main():
    folder = sys.argv[1]
    found = {}
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if name.endswith(".safetensors"):
            found[name] = read_safetensors(path)
        elif name.endswith(".json"):
            with open(path) as f:
                found[name] = json.load(f)
    print(json.dumps(found))


if __name__ == "__main__":
    main()
