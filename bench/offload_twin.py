"""W8 twin of bench/offload.cpp with plain PyTorch: the same 16 Linear(1024,1024)+tanh model
(same seed, so the same weights), batch 64, forward in memory, and forward with every weight
offloaded to the disk the way upstream Accelerate's disk offload reads it: one raw `.dat` file
per tensor, memory-mapped with NumPy and turned into a tensor just before its layer runs, then
dropped. Prints one JSON object per variant, as the C++ side does.
Usage: /usr/bin/python3 bench/offload_twin.py DIR [--quick]"""
import json
import os
import shutil
import sys
import time

import numpy as np
import torch

LAYERS, WIDTH, BATCH = 16, 1024, 64


def make_model():
    layers = []
    for _ in range(LAYERS):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers)


def report(variant, seconds, iters, checksum):
    seconds = sorted(seconds)
    median = seconds[len(seconds) // 2]
    print(json.dumps({"workload": "offload", "variant": variant, "side": "python",
                      "samples_per_s": iters * BATCH / median, "min_samples_per_s": iters * BATCH / seconds[-1],
                      "max_samples_per_s": iters * BATCH / seconds[0], "checksum": checksum}), flush=True)


def measure(variant, forward, x, iters, reps):
    seconds, checksum = [], 0.0
    for r in range(reps + 1):
        start = time.perf_counter()
        for _ in range(iters):
            checksum = forward(x).sum().item()
        if r > 0:
            seconds.append(time.perf_counter() - start)
    report(variant, seconds, iters, checksum)


def main():
    folder = sys.argv[1]
    quick = "--quick" in sys.argv[2:]
    iters, reps = (5, 3) if quick else (20, 5)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = make_model()
    x = torch.randn(BATCH, WIDTH)
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(folder)
    index = {}
    for name, tensor in model.state_dict().items():
        array = tensor.numpy()
        index[name] = {"dtype": str(array.dtype), "shape": list(array.shape)}
        mapped = np.memmap(os.path.join(folder, f"{name}.dat"), dtype=array.dtype, mode="w+", shape=array.shape)
        mapped[:] = array[:]
        mapped.flush()

    def load(name):
        info = index[name]
        return torch.tensor(np.memmap(os.path.join(folder, f"{name}.dat"), dtype=info["dtype"],
                                      shape=tuple(info["shape"]), mode="r"))

    def offloaded_forward(h):
        for i in range(0, 2 * LAYERS, 2):
            h = torch.tanh(torch.nn.functional.linear(h, load(f"{i}.weight"), load(f"{i}.bias")))
        return h

    with torch.no_grad():
        measure("in_memory", model, x, iters, reps)
        measure("disk_offload", offloaded_forward, x, iters, reps)


if __name__ == "__main__":
    main()
