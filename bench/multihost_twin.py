#!/usr/bin/env python3
"""W13's PyTorch twin: bench/multihost.cpp's model (pre-norm MLP blocks), AdamW, the same rows and
steps, across machines over Gloo, started on each machine by hand (PyTorch's env:// contract):

  multihost_twin.py MODE --hosts H --per_host P --host I --master ADDR --port PORT [--link DEV] ...

MODE: ddp (--comm_hook fp16 registers PyTorch's fp16_compress_hook; its bf16 hook is refused on
CPU tensors by the PyTorch releases here, so bf16 has no twin), full_shard, shard_grad_op,
hybrid_shard (FSDP1 on a 2-D CPU mesh: replicas across machines, shards within), compute (DDP
under no_sync). tp_ddp has no twin here. Process 0 prints the C++ program's record, with the
counts only the library knows left at -1.
"""
import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from twin_launch import status_mib  # noqa: E402


def tx_bytes(device, all_but):
    total = 0
    for name in os.listdir("/sys/class/net"):
        if (name == device) == all_but:
            continue
        try:
            with open(f"/sys/class/net/{name}/statistics/tx_bytes") as f:
                total += int(f.read())
        except OSError:
            pass
    return total


def processor_ticks():
    """The computer's processor time so far in clock ticks, (busy, all), as bench/multihost.cpp reads it."""
    with open("/proc/stat") as f:
        fields = [float(v) for v in f.readline().split()[1:9]]
    return sum(fields) - fields[3] - fields[4], sum(fields)


def worker(args):
    if args.link:
        os.environ["GLOO_SOCKET_IFNAME"] = args.link
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import torch.nn.functional as F

    width, blocks, rows = args.width, args.blocks, args.rows

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(width)
            self.up = nn.Linear(width, 4 * width)
            self.down = nn.Linear(4 * width, width)

        def forward(self, x):
            return x + self.down(F.gelu(self.up(self.norm(x))))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.head = nn.Linear(width, 16)  # first, as the C++ model builds it
            self.blocks = nn.Sequential(*[Block() for _ in range(blocks)])

        def forward(self, x):
            return self.head(self.blocks(x))

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    net = Net()
    params = sum(p.numel() for p in net.parameters())
    if args.mode in ("ddp", "compute"):
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(net, bucket_cap_mb=args.bucket_cap_mb)
        if args.comm_hook == "fp16":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    else:
        from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        extra = {}
        if args.mode == "hybrid_shard":
            from torch.distributed.device_mesh import init_device_mesh

            extra["device_mesh"] = init_device_mesh("cpu", (args.hosts, args.per_host),
                                                    mesh_dim_names=("replicate", "shard"))
        strategy = {"full_shard": ShardingStrategy.FULL_SHARD, "shard_grad_op": ShardingStrategy.SHARD_GRAD_OP,
                    "hybrid_shard": ShardingStrategy.HYBRID_SHARD}[args.mode]
        model = FullyShardedDataParallel(net, auto_wrap_policy=ModuleWrapPolicy({Block}), sharding_strategy=strategy,
                                         device_id=torch.device("cpu"), use_orig_params=True, **extra)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(1234 + rank)
    x = torch.randn(rows, width, generator=gen)
    y = torch.randint(0, 16, (rows,), generator=gen)
    loss = 0.0
    start = time.perf_counter()
    link0 = other0 = cpu0 = 0
    ticks0 = (0.0, 0.0)
    for s in range(args.warmup + args.steps):
        if s == args.warmup:
            dist.barrier()
            start = time.perf_counter()
            link0, other0 = tx_bytes(args.link, False), tx_bytes(args.link, True)
            cpu0, ticks0 = time.process_time(), processor_ticks()
        if args.mode == "compute":  # no_sync around the forward pass too, where DDP decides
            with model.no_sync():
                out = F.cross_entropy(model(x), y)
                out.backward()
        else:
            out = F.cross_entropy(model(x), y)
            out.backward()
        optimizer.step()
        optimizer.zero_grad()
        loss = out.item()
    dist.barrier()  # the job's time: under no_sync the processes drift apart
    seconds = time.perf_counter() - start
    cpu = torch.tensor([(time.process_time() - cpu0) / args.steps], dtype=torch.float64)
    ticks = processor_ticks()
    busy = (ticks[0] - ticks0[0]) / max(1.0, ticks[1] - ticks0[1])
    link, other = tx_bytes(args.link, False) - link0, tx_bytes(args.link, True) - other0
    dist.all_reduce(cpu)
    dist.barrier()
    if rank == 0:
        print(json.dumps({
            "workload": "multihost", "mode": args.mode, "side": "twin", "comm_hook": args.comm_hook, "processes": n,
            "per_machine": args.per_host, "params": params, "bucket_cap_mb": args.bucket_cap_mb,
            "samples_per_s": round(args.steps * rows * n / seconds, 2), "step_s": round(seconds / args.steps, 4),
            "counted_sent_per_step": -1, "counted_machine_sent_per_step": -1,
            "link_tx_per_step": link / args.steps if args.link else -1, "loopback_tx_per_step": other / args.steps,
            "collectives_per_step": -1, "started_before_backward_end": -1,
            "cpu_s_per_step": round(cpu.item(), 3), "processors": os.cpu_count(), "processors_busy": round(busy, 3),
            "peak_mib": round(status_mib("VmHWM"), 1),
            "last_loss": round(loss, 6), "torch": torch.__version__}), flush=True)
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["ddp", "full_shard", "shard_grad_op", "hybrid_shard", "compute", "tp_ddp"])
    parser.add_argument("--hosts", type=int, default=1)
    parser.add_argument("--per_host", type=int, default=2)
    parser.add_argument("--host", type=int, default=0)
    parser.add_argument("--master", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=29500)
    parser.add_argument("--link", default="")
    parser.add_argument("--comm_hook", default="no", choices=["no", "fp16", "bf16"])
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--bucket_cap_mb", type=float, default=25)
    args = parser.parse_args()
    if args.mode == "tp_ddp" or args.comm_hook == "bf16":
        print(f"multihost_twin: no twin for {args.mode} with the {args.comm_hook} hook here", file=sys.stderr)
        return 0
    if "RANK" in os.environ:
        worker(args)
        return 0
    procs = []
    for local in range(args.per_host):
        env = dict(os.environ, RANK=str(args.host * args.per_host + local), WORLD_SIZE=str(args.hosts * args.per_host),
                   LOCAL_RANK=str(local), LOCAL_WORLD_SIZE=str(args.per_host), MASTER_ADDR=args.master,
                   MASTER_PORT=str(args.port), OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", USE_LIBUV="0")
        procs.append(subprocess.Popen([sys.executable] + sys.argv, env=env))
    return max(p.wait() for p in procs)


if __name__ == "__main__":
    sys.exit(main())
