#!/usr/bin/python3
"""The Python side of the checkpoint interop tests (tests/multiprocess/python_checkpoint_test.cpp),
with Debian's python3-torch only (no accelerate, no transformers).

It runs the training that tests/multiprocess/programs/python_interop.cpp runs in C++: an MLP
whose weights and data are formulas of their indices, AdamW, and transformers' linear warm-up
schedule (a LambdaLR over functools.partial, as transformers builds it). With P processes,
Accelerate's DDP averages the gradients of P equal shards of the batch, which is the gradient of
the whole batch's mean loss, and steps the scheduler P times per step (split_batches=False): both
are done here in one process.

It saves and loads a folder the way Python Accelerate's save_state / load_state do (as of
accelerate 1.x: accelerate/checkpointing.py), with plain torch.save / torch.load of the same
objects under the same names: model.safetensors when the safetensors package is there (else
pytorch_model.bin, as with safe_serialization=False), optimizer.bin, scheduler.bin,
random_states_<p>.pkl (step, Python's random, numpy's, torch's CPU and CUDA generator states).
It also loads what upstream's FSDP writes for FULL_STATE_DICT: pytorch_model_fsdp.bin, and an
optimizer.bin whose parameters are named (tests/packages/fsdp_check.py checks both against
upstream Accelerate itself).

  upstream_checkpoint.py --steps-to N [--steps-from K --load DIR] [--save-at K --save DIR]
                         --processes P --out RESULT.json
"""
import argparse
import functools
import json
import math
import os
import random
import struct

import numpy as np
import torch

try:
    import safetensors.torch as safetensors_torch
except ImportError:
    safetensors_torch = None

BATCH = 8
WARMUP, TOTAL = 3, 20


def model():
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    with torch.no_grad():
        for k, (_, p) in enumerate(net.named_parameters()):
            i = torch.arange(p.numel(), dtype=torch.float64)
            p.copy_((0.3 * torch.sin(0.7 * i + k)).reshape(p.shape).to(torch.float32))
    return net


def batch(step):
    n = torch.arange(BATCH, dtype=torch.float64).unsqueeze(1) + step * BATCH
    x = torch.cos(0.1 * n + 0.37 * torch.arange(4, dtype=torch.float64)).to(torch.float32)
    y = torch.sin(0.2 * n + torch.arange(3, dtype=torch.float64)).to(torch.float32)
    return x, y


def linear_with_warmup(current_step, *, num_warmup_steps, num_training_steps):
    if current_step < num_warmup_steps:
        return float(current_step) / float(max(1, num_warmup_steps))
    return max(0.0, float(num_training_steps - current_step) / float(max(1, num_training_steps - num_warmup_steps)))


def read_safetensors(path):
    with open(path, "rb") as f:
        blob = f.read()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n])
    header.pop("__metadata__", None)
    dtypes = {"F32": torch.float32, "F64": torch.float64, "I64": torch.int64}
    out = {}
    for name, info in header.items():
        begin, end = info["data_offsets"]
        data = bytearray(blob[8 + n + begin:8 + n + end])
        out[name] = torch.frombuffer(data, dtype=dtypes[info["dtype"]]).reshape(info["shape"]).clone()
    return out


def load(path):
    # Under PyTorch 2.x with weights_only, as torch.load defaults to since 2.6; PyTorch 1.13's
    # weights-only reader lacks opcodes its own pickler writes (BINFLOAT), so there plainly, as
    # Accelerate did on 1.13.
    if int(torch.__version__.split(".")[0]) >= 2:
        return torch.load(path, map_location="cpu", weights_only=True)
    return torch.load(path, map_location="cpu")


def save_state(folder, net, optimizer, scheduler, step, processes):
    os.makedirs(folder, exist_ok=True)
    state = net.state_dict()
    if safetensors_torch is not None:
        safetensors_torch.save_file({k: v.contiguous() for k, v in state.items()},
                                    os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    else:
        torch.save(state, os.path.join(folder, "pytorch_model.bin"))
    torch.save(optimizer.state_dict(), os.path.join(folder, "optimizer.bin"))
    torch.save(scheduler.state_dict(), os.path.join(folder, "scheduler.bin"))
    for p in range(processes):
        torch.manual_seed(100 + p)  # each process's generator
        states = {
            "step": step,
            "random_state": random.getstate(),
            "numpy_random_seed": np.random.get_state(),
            "torch_manual_seed": torch.get_rng_state(),
            "torch_cuda_manual_seed": [],
        }
        torch.save(states, os.path.join(folder, "random_states_%d.pkl" % p))
    torch.manual_seed(100)  # process 0's generator goes on from its saved state


def load_state(folder, net, optimizer, scheduler):
    if os.path.exists(os.path.join(folder, "model.safetensors")):
        weights = (safetensors_torch.load_file(os.path.join(folder, "model.safetensors"))
                   if safetensors_torch is not None else read_safetensors(os.path.join(folder, "model.safetensors")))
    elif os.path.exists(os.path.join(folder, "pytorch_model_fsdp.bin")):  # upstream's FSDP, FULL_STATE_DICT
        weights = load(os.path.join(folder, "pytorch_model_fsdp.bin"))
    else:
        weights = load(os.path.join(folder, "pytorch_model.bin"))
    net.load_state_dict(weights)
    optim = load(os.path.join(folder, "optimizer.bin"))
    # FSDP's optim_state_dict names the parameters; optimizer.state_dict() numbers them.
    number = {name: i for i, (name, _) in enumerate(net.named_parameters())}
    if any(isinstance(k, str) for k in optim["state"]):
        optim["state"] = {number[k]: v for k, v in optim["state"].items()}
        for group in optim["param_groups"]:
            group["params"] = [number[k] for k in group["params"]]
    optimizer.load_state_dict(optim)
    scheduler.load_state_dict(load(os.path.join(folder, "scheduler.bin")))
    states = load(os.path.join(folder, "random_states_0.pkl"))
    random.setstate(states["random_state"])
    np.random.set_state(states["numpy_random_seed"])
    torch.set_rng_state(states["torch_manual_seed"])
    return states["step"]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps-from", type=int, default=0)
    parser.add_argument("--steps-to", type=int, required=True)
    parser.add_argument("--load")
    parser.add_argument("--save")
    parser.add_argument("--save-at", type=int, default=-1)
    parser.add_argument("--processes", type=int, default=1)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    torch.manual_seed(100)
    net = model()
    optimizer = torch.optim.AdamW(net.parameters(), lr=0.01, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, functools.partial(linear_with_warmup, num_warmup_steps=WARMUP, num_training_steps=TOTAL))
    loaded_step = None
    if args.load:
        loaded_step = load_state(args.load, net, optimizer, scheduler)
    draws = []
    for step in range(args.steps_from, args.steps_to):
        if step == args.save_at:
            save_state(args.save, net, optimizer, scheduler, step, args.processes)
        if step == args.steps_from and args.load:
            draws = torch.rand(4).tolist()  # the generator restored by load_state
        elif step == args.save_at:
            draws = torch.rand(4).tolist()
        x, y = batch(step)
        loss = torch.nn.functional.mse_loss(net(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        for _ in range(args.processes):
            scheduler.step()
    result = {
        "params": {k: v.detach().flatten().tolist() for k, v in net.state_dict().items()},
        "lr": optimizer.param_groups[0]["lr"],
        "draws": draws,
        "loaded_step": loaded_step,
        "loss": float(loss),
    }
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
