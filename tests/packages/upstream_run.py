"""Upstream Accelerate's own save_state / load_state, the Python side of the cross-language
checkpoint tests against the real package (tests/packages/checkpoint_check.py).

It runs the training of tests/multiprocess/programs/python_interop.cpp: an MLP whose weights and
data are formulas of their indices, AdamW, and either a fixed rate or the linear warm-up schedule
of transformers (a LambdaLR over functools.partial); each of P processes takes its shard of the
batch, so that, without a schedule, every process count follows the same parameters (to float
tolerance). Upstream steps a prepared scheduler once per process (split_batches=False), so runs
with a schedule only agree at the same process count.

--mode fsdp: upstream's FSDP2 (fully_shard) with the given state-dict type. Upstream makes a job
fully sharded only on accelerators: its AcceleratorState sets DistributedType.FSDP for
MULTI_GPU, MULTI_XPU, ... and never for MULTI_CPU. PyTorch's fully_shard itself runs on CPU
processes over Gloo, so this script sets the state's distributed type to FSDP (and its
fsdp_plugin) after the Accelerator is made; prepare, save_state and load_state then take
upstream's FSDP2 code paths, unchanged. --mode ddp: upstream's DDP (MULTI_CPU), unchanged.

  torchrun --nproc_per_node P upstream_run.py --mode fsdp|ddp [--state-dict-type TYPE]
      [--scheduler linear|none] --steps-to N [--steps-from K --load DIR] [--save-at K --save DIR]
      --out RESULT.json
"""
import argparse
import functools
import json
import os
import sys

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, PartialState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

# The model, the data and transformers' schedule of the Debian-side script, shared.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
from upstream_checkpoint import BATCH, TOTAL, WARMUP, batch, linear_with_warmup, model  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["fsdp", "ddp"], required=True)
    parser.add_argument("--state-dict-type", default="SHARDED_STATE_DICT")
    parser.add_argument("--scheduler", choices=["linear", "none"], default="none")
    parser.add_argument("--steps-from", type=int, default=0)
    parser.add_argument("--steps-to", type=int, required=True)
    parser.add_argument("--save-at", type=int, default=-1)
    parser.add_argument("--save")
    parser.add_argument("--load")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    accelerator = Accelerator(cpu=True)
    if args.mode == "fsdp":
        plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type=args.state_dict_type)
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP
        AcceleratorState._shared_state["distributed_type"] = DistributedType.FSDP
        accelerator.state.fsdp_plugin = plugin
        assert accelerator.distributed_type == DistributedType.FSDP and accelerator.is_fsdp2

    net = model()
    optimizer = torch.optim.AdamW(net.parameters(), lr=0.01, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    if args.scheduler == "linear":
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, functools.partial(linear_with_warmup, num_warmup_steps=WARMUP, num_training_steps=TOTAL))
        net, optimizer, schedule = accelerator.prepare(net, optimizer, schedule)
    else:
        schedule = None
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
            if schedule is not None:
                schedule.step()
    if args.save_at == args.steps_to:  # the state the result shows
        accelerator.save_state(args.save)
    weights = accelerator.get_state_dict(net)
    if accelerator.is_main_process:
        result = {
            "params": {k: v.detach().reshape(-1).tolist() for k, v in weights.items()},
            "lr": schedule.get_last_lr()[0] if schedule is not None else 0.01,
            "step": accelerator.step,
            "processes": processes,
            "distributed_type": str(accelerator.distributed_type),
        }
        with open(args.out, "w") as f:
            json.dump(result, f)
    accelerator.wait_for_everyone()
    # A Gloo group left to the interpreter's exit can abort a process ("terminate called without
    # an active exception") when the machine is loaded: end it first, as PyTorch asks.
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
