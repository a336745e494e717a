"""W9's PyTorch twin: bench/fsdp.cpp's model (8 pre-norm MLP blocks, d=768, a head of 16), data
and AdamW, trained under PyTorch's DDP or its own FullyShardedDataParallel (FSDP1: each block a
unit, FULL_SHARD or SHARD_GRAD_OP, the module's own parameters) on CPU processes over Gloo.
Prints the same JSON line as bench_fsdp on process 0, with side "python".

PyTorch's FSDP runs on CPU processes from 2.x on, given device_id=cpu (its default asks for an
accelerator); Debian 12's 1.13 cannot even import it on Python 3.11. `--probe` exits 0 where it
can run and prints why not otherwise.

Usage: fsdp_twin.py ddp|full_shard|shard_grad_op --nproc N [--quick] [--threads T] | --probe
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from twin_launch import run_as_workers, status_mib  # noqa: E402

WIDTH, BLOCKS, ROWS = 768, 8, 64


def probe():
    try:
        import torch
        from torch.distributed.fsdp import FullyShardedDataParallel  # noqa: F401
    except Exception as e:  # an import that fails for any reason means no twin here
        print(f"PyTorch's FSDP does not import here: {type(e).__name__}: {e}")
        return 1
    if int(torch.__version__.split(".")[0]) < 2:
        print(f"PyTorch {torch.__version__}'s FSDP needs an accelerator device")
        return 1
    return 0


def worker(args):
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # one machine, as the C++ side's loopback device
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import torch.nn.functional as F

    base_mib = status_mib("VmRSS")  # with PyTorch loaded, as the C++ side's is with LibTorch

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(WIDTH)
            self.up = nn.Linear(WIDTH, 4 * WIDTH)
            self.down = nn.Linear(4 * WIDTH, WIDTH)

        def forward(self, x):
            return x + self.down(F.gelu(self.up(self.norm(x))))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.head = nn.Linear(WIDTH, 16)  # first, as the C++ model builds it
            self.blocks = nn.Sequential(*[Block() for _ in range(BLOCKS)])

        def forward(self, x):
            return self.head(self.blocks(x))

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    net = Net()
    params = sum(p.numel() for p in net.parameters())
    largest_unit = sum(p.numel() * 4 for p in net.blocks[0].parameters())
    if args.mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(net)
    else:
        from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        strategy = ShardingStrategy.FULL_SHARD if args.mode == "full_shard" else ShardingStrategy.SHARD_GRAD_OP
        model = FullyShardedDataParallel(net, auto_wrap_policy=ModuleWrapPolicy({Block}), sharding_strategy=strategy,
                                         device_id=torch.device("cpu"), use_orig_params=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(1234 + rank)
    x = torch.randn(ROWS, WIDTH, generator=gen)
    y = torch.randint(0, 16, (ROWS,), generator=gen)
    warmup, steps = 2, 4 if args.quick else 10
    loss = 0.0
    start = time.perf_counter()
    for s in range(warmup + steps):
        if s == warmup:
            dist.barrier()
            start = time.perf_counter()
        out = F.cross_entropy(model(x), y)
        out.backward()
        optimizer.step()
        optimizer.zero_grad()
        loss = out.item()
    dist.barrier()
    seconds = time.perf_counter() - start
    if rank == 0:
        print(json.dumps({"workload": "fsdp", "mode": args.mode, "side": "python", "processes": n, "params": params,
                          "samples_per_s": round(steps * ROWS * n / seconds, 1),
                          "peak_mib": round(status_mib("VmHWM"), 1), "base_mib": round(base_mib, 1),
                          "largest_unit_mib": round(largest_unit / 1048576.0, 1), "last_loss": round(loss, 6),
                          "torch": torch.__version__}), flush=True)
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", nargs="?", choices=["ddp", "full_shard", "shard_grad_op"])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--probe", action="store_true")
    args = parser.parse_args()
    if args.probe:
        sys.exit(probe())
    if args.mode is None:
        parser.error("a mode is required")
    run_as_workers(lambda: worker(args), nproc=args.nproc, threads=args.threads)


if __name__ == "__main__":
    main()
