"""Twin of bench/checkpoint.cpp with plain PyTorch: torch.save (then fsync, the same durability
as the C++ side) and torch.load of the same ~200 MB state dict, copied into preallocated tensors;
and the files upstream Accelerate's save_state writes for a small transformer trained one step
with AdamW (model, optimizer and generator states through torch.save, each fsynced) and their
loading. Usage: /usr/bin/python3 bench/checkpoint_twin.py DIR [--quick]"""
import json
import os
import shutil
import statistics
import sys
import time

import torch


def fsynced_save(obj, path):
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def folder_bytes(folder):
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(folder) for f in files)


def report(workload, nbytes, save, load):
    s, l = statistics.median(save), statistics.median(load)
    print(json.dumps({"workload": workload, "side": "python", "bytes": nbytes, "save_mb_per_s": nbytes / 1e6 / s,
                      "load_mb_per_s": nbytes / 1e6 / l, "save_s": s, "load_s": l}), flush=True)


def state_dict_200mb(folder, reps):
    gen = torch.Generator().manual_seed(0)
    tensors = {f"layer.{i}.weight": torch.randn(1024, 1024, generator=gen) for i in range(50)}
    targets = {k: torch.empty(1024, 1024) for k in tensors}
    path = os.path.join(folder, "state.pt")
    save, load = [], []
    for r in range(reps + 1):
        start = time.perf_counter()
        fsynced_save(tensors, path)
        s = time.perf_counter() - start
        start = time.perf_counter()
        loaded = torch.load(path)
        with torch.no_grad():
            for k, t in targets.items():
                t.copy_(loaded[k])
        l = time.perf_counter() - start
        if r > 0:
            save.append(s)
            load.append(l)
    report("state_dict_200mb", os.path.getsize(path), save, load)


def transformer_save_state(folder, reps):
    torch.manual_seed(0)
    encoder = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(256, 4), 2)
    adamw = torch.optim.AdamW(encoder.parameters(), 1e-3)
    encoder(torch.randn(64, 16, 256)).pow(2).mean().backward()
    adamw.step()
    save, load = [], []
    nbytes = 0
    for r in range(reps + 1):
        out = os.path.join(folder, f"state_{r}")
        start = time.perf_counter()
        os.makedirs(out)
        fsynced_save(encoder.state_dict(), os.path.join(out, "pytorch_model.bin"))
        fsynced_save(adamw.state_dict(), os.path.join(out, "optimizer.bin"))
        fsynced_save({"step": 0, "torch_manual_seed": torch.get_rng_state()}, os.path.join(out, "random_states_0.pkl"))
        s = time.perf_counter() - start
        start = time.perf_counter()
        encoder.load_state_dict(torch.load(os.path.join(out, "pytorch_model.bin")))
        adamw.load_state_dict(torch.load(os.path.join(out, "optimizer.bin")))
        torch.set_rng_state(torch.load(os.path.join(out, "random_states_0.pkl"))["torch_manual_seed"])
        l = time.perf_counter() - start
        nbytes = folder_bytes(out)
        shutil.rmtree(out)
        if r > 0:
            save.append(s)
            load.append(l)
    report("transformer_save_state", nbytes, save, load)


def main():
    folder = sys.argv[1]
    quick = "--quick" in sys.argv
    os.makedirs(folder, exist_ok=True)
    torch.set_num_threads(1)
    state_dict_200mb(folder, 2 if quick else 5)
    transformer_save_state(folder, 3 if quick else 10)


if __name__ == "__main__":
    main()
