"""Upstream Accelerate's own save_state / load_state under its FSDP (FSDP2, on CPU processes over
Gloo): the Python side of the cross-language FSDP checkpoint tests (tests/packages/fsdp_check.py).

It runs the training of tests/multiprocess/programs/python_interop.cpp: an MLP whose weights and
data are formulas of their indices, AdamW at a fixed rate; each of P processes takes its shard of
the batch, so every process count follows the same parameters (to float tolerance).

Upstream makes a job fully sharded only on accelerators: its AcceleratorState sets
DistributedType.FSDP for MULTI_GPU, MULTI_XPU, ... and never for MULTI_CPU. PyTorch's fully_shard
itself runs on CPU processes over Gloo, so this script sets the state's distributed type to FSDP
(and its fsdp_plugin) after the Accelerator is made; prepare, save_state and load_state are then
upstream's code paths for FSDP2, unchanged.

  torchrun --nproc_per_node P upstream_fsdp.py --state-dict-type SHARDED_STATE_DICT|FULL_STATE_DICT
      --steps-to N [--steps-from K --load DIR] [--save-at K --save DIR] --out RESULT.json
"""
import argparse
import json

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, PartialState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

BATCH = 8


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


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--state-dict-type", required=True)
    parser.add_argument("--steps-from", type=int, default=0)
    parser.add_argument("--steps-to", type=int, required=True)
    parser.add_argument("--save-at", type=int, default=-1)
    parser.add_argument("--save")
    parser.add_argument("--load")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type=args.state_dict_type)
    accelerator = Accelerator(cpu=True)
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    AcceleratorState._shared_state["distributed_type"] = DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin
    assert accelerator.distributed_type == DistributedType.FSDP and accelerator.is_fsdp2

    net = model()
    optimizer = torch.optim.AdamW(net.parameters(), lr=0.01, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    net, optimizer = accelerator.prepare(net, optimizer)
    if args.load:
        accelerator.load_state(args.load)
    rank, processes = accelerator.process_index, accelerator.num_processes
    per = BATCH // processes
    for step in range(args.steps_from, args.steps_to):
        if step == args.save_at:
            accelerator.save_state(args.save)
        with accelerator.accumulate(net):  # counts the accelerator's step, saved with the state
            x, y = batch(step)
            loss = torch.nn.functional.mse_loss(net(x[rank * per:(rank + 1) * per]), y[rank * per:(rank + 1) * per])
            optimizer.zero_grad()
            accelerator.backward(loss)
            optimizer.step()
    weights = accelerator.get_state_dict(net)
    if accelerator.is_main_process:
        result = {
            "params": {k: v.detach().reshape(-1).tolist() for k, v in weights.items()},
            "step": accelerator.step,
            "processes": processes,
            "distributed_type": str(accelerator.distributed_type),
            "fsdp_version": accelerator.state.fsdp_plugin.fsdp_version,
        }
        with open(args.out, "w") as f:
            json.dump(result, f)
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    main()
