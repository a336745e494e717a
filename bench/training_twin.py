"""Twin of bench/training.cpp: the same models, batches, seeds, SGD settings and step counts,
trained with torch.nn.parallel.DistributedDataParallel over Gloo (default bucket settings) on
2 processes, or the bare model on 1. Starts its own processes with the launcher's environment
contract, since Debian's torchrun does not run on its Python.
Usage: /usr/bin/python3 bench/training_twin.py [--quick] [--nproc 2] [--threads 1]
       [--workloads mlp,tiny] [--warmup_steps 20] [--mlp_steps 200] [--tiny_steps 2000]
"""
import argparse
import json
import os
import time

from twin_launch import run_as_workers
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(512, 1024)
        self.fc2 = nn.Linear(1024, 1024)
        self.fc3 = nn.Linear(1024, 10)

    def forward(self, x):
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(32, 32)

    def forward(self, x):
        return self.fc(x)


def median_mean(v):
    v = sorted(v)
    return v[len(v) // 2], sum(v) / len(v)


def run(workload, net, x, y, loss_fn, warmup_steps, steps):
    distributed = dist.is_initialized()
    model = DistributedDataParallel(net) if distributed else net
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    barrier = dist.barrier if distributed else (lambda: None)
    for _ in range(warmup_steps):
        opt.zero_grad(set_to_none=True)  # the default of the C++ side (and of PyTorch 2)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()

    phases = [[0.0] * steps for _ in range(4)]
    step_us = [0.0] * steps
    clock = time.perf_counter
    barrier()
    start = clock()
    for i in range(steps):
        t0 = clock()
        opt.zero_grad(set_to_none=True)
        t1 = clock()
        loss = loss_fn(model(x), y)
        t2 = clock()
        loss.backward()
        t3 = clock()
        opt.step()
        t4 = clock()
        phases[0][i], phases[1][i], phases[2][i], phases[3][i] = (t1 - t0) * 1e6, (t2 - t1) * 1e6, (t3 - t2) * 1e6, (t4 - t3) * 1e6
        step_us[i] = (t4 - t0) * 1e6
    barrier()
    seconds = clock() - start
    rank = dist.get_rank() if distributed else 0
    if rank != 0:
        return
    n = dist.get_world_size() if distributed else 1
    step_median, step_mean = median_mean(step_us)
    names = ["zero_grad", "forward", "backward", "step"]
    print(json.dumps({
        "side": "python", "workload": workload, "processes": n, "threads": torch.get_num_threads(),
        "batch_size": x.size(0), "warmup_steps": warmup_steps, "steps": steps,
        "steps_per_s": round(steps / seconds, 3), "samples_per_s": round(steps / seconds * x.size(0) * n, 1),
        "step_median_us": round(step_median, 1), "step_mean_us": round(step_mean, 1),
        "phase_median_mean_us": {name: [round(m, 1) for m in median_mean(p)] for name, p in zip(names, phases)},
        "last_loss": round(loss.item(), 6)}), flush=True)


def worker(args):
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if int(os.environ["WORLD_SIZE"]) > 1:
        dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    for workload in args.workloads.split(","):
        torch.manual_seed(0)
        gen = torch.Generator().manual_seed(1000 + rank)
        if workload == "mlp":
            net = Mlp()
            x = torch.randn(64, 512, generator=gen)
            y = torch.randint(0, 10, (64,), generator=gen)
            run("mlp", net, x, y, F.cross_entropy, args.warmup_steps, args.mlp_steps)
        elif workload == "tiny":
            net = Tiny()
            x = torch.randn(8, 32, generator=gen)
            y = torch.randn(8, 32, generator=gen)
            run("tiny", net, x, y, F.mse_loss, args.warmup_steps, args.tiny_steps)
        else:
            raise ValueError(f"[training_twin] unknown workload {workload} (expected mlp or tiny)")
    if dist.is_initialized():
        dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--workloads", default="mlp,tiny")
    parser.add_argument("--warmup_steps", type=int, default=20)
    parser.add_argument("--mlp_steps", type=int, default=200)
    parser.add_argument("--tiny_steps", type=int, default=2000)
    args = parser.parse_args()
    if args.quick:
        args.mlp_steps = max(1, args.mlp_steps // 4)
        args.tiny_steps = max(1, args.tiny_steps // 4)
    run_as_workers(lambda: worker(args), nproc=args.nproc, threads=args.threads)


if __name__ == "__main__":
    main()
