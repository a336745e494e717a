"""W10's PyTorch twin: bench/parallel.cpp's model (examples/char_gpt.cpp's GPT), data and AdamW on
CPU processes over Gloo, under PyTorch's own DDP, FSDP (FSDP1, each block a unit), and DTensor
tensor parallelism (`parallelize_module` with ColwiseParallel on qkv and fc, RowwiseParallel on
proj and fc_out, over pairs of neighbouring processes of a 2-D DeviceMesh), with DDP over the pairs
(`tp`: PyTorch's 2-D recipe, `_pre_dp_module_transform`) or FSDP2's `fully_shard` over them
(`fsdp_tp`). Prints the same JSON line as bench_parallel on process 0, with side "python".

DTensor and FSDP on CPU processes need PyTorch 2.x (Debian 13, through scripts/test_debian.sh
trixie --bench parallel). `--probe` exits 0 where it can run and prints why not otherwise.

Usage: parallel_twin.py ddp|fsdp|tp|fsdp_tp --nproc N [--quick] [--phases] [--threads T] | --probe
"""
import argparse
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from twin_launch import run_as_workers, status_mib  # noqa: E402

VOCAB, BLOCK, EMBD, HEADS, LAYERS, BATCH = 65, 64, 128, 4, 4, 16


def probe():
    try:
        import torch
        from torch.distributed.tensor.parallel import parallelize_module  # noqa: F401
    except Exception as e:  # an import that fails for any reason means no twin here
        print(f"PyTorch's tensor parallelism does not import here: {type(e).__name__}: {e}")
        return 1
    if int(torch.__version__.split(".")[0]) < 2:
        print(f"PyTorch {torch.__version__} has no DTensor tensor parallelism on CPU processes")
        return 1
    return 0


def worker(args):
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import torch.nn.functional as F

    base_mib = status_mib("VmRSS")

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1 = nn.LayerNorm(EMBD)
            self.qkv = nn.Linear(EMBD, 3 * EMBD)
            self.proj = nn.Linear(EMBD, EMBD)
            self.ln2 = nn.LayerNorm(EMBD)
            self.fc = nn.Linear(EMBD, 4 * EMBD)
            self.fc_out = nn.Linear(4 * EMBD, EMBD)

        def forward(self, x):
            b, t, hs = x.size(0), x.size(1), EMBD // HEADS
            qkv = self.qkv(self.ln1(x))
            heads = qkv.size(2) // (3 * hs)
            q, k, v = qkv.view(b, t, heads, 3, hs).permute(3, 0, 2, 1, 4)
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hs))
            future = torch.ones(t, t, dtype=torch.bool).triu(1)
            att = att.masked_fill(future, float("-inf")).softmax(-1)
            y = (att @ v).transpose(1, 2).contiguous().view(b, t, heads * hs)
            x = x + self.proj(y)
            return x + self.fc_out(F.gelu(self.fc(self.ln2(x))))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = nn.Embedding(VOCAB, EMBD)
            self.pos = nn.Embedding(BLOCK, EMBD)
            self.ln_f = nn.LayerNorm(EMBD)
            self.head = nn.Linear(EMBD, VOCAB)
            self.blocks = nn.Sequential(*[Block() for _ in range(LAYERS)])

        def forward(self, ids):
            x = self.tok(ids) + self.pos(torch.arange(ids.size(1)))
            return self.head(self.ln_f(self.blocks(x)))

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    net = GPT()
    params = sum(p.numel() for p in net.parameters())
    tp = args.mode in ("tp", "fsdp_tp")
    tp_size = 2 if tp else 1
    if args.mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(net)
    elif args.mode == "fsdp":
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        model = FullyShardedDataParallel(net, auto_wrap_policy=ModuleWrapPolicy({Block}),
                                         device_id=torch.device("cpu"), use_orig_params=True)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = init_device_mesh("cpu", (n // tp_size, tp_size), mesh_dim_names=("dp", "tp"))
        for block in net.blocks:
            parallelize_module(block, mesh["tp"], {"qkv": ColwiseParallel(), "proj": RowwiseParallel(),
                                                   "fc": ColwiseParallel(), "fc_out": RowwiseParallel()})
        if args.mode == "tp":
            from torch.distributed.tensor.parallel.ddp import _pre_dp_module_transform
            from torch.nn.parallel import DistributedDataParallel

            _pre_dp_module_transform(net)
            model = DistributedDataParallel(net, process_group=mesh["dp"].get_group())
        else:
            try:
                from torch.distributed.fsdp import fully_shard
            except ImportError:
                from torch.distributed._composable.fsdp import fully_shard
            for block in net.blocks:
                fully_shard(block, mesh=mesh["dp"])
            model = fully_shard(net, mesh=mesh["dp"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    dp_rank = rank // tp_size
    gen = torch.Generator().manual_seed(1234 + dp_rank)
    x = torch.randint(0, VOCAB, (BATCH, BLOCK), generator=gen)
    y = torch.randint(0, VOCAB, (BATCH, BLOCK), generator=gen)
    warmup, steps = 2, 4 if args.quick else 10
    loss = 0.0
    phases = [0.0] * 4  # --phases: forward, backward, step, zero_grad
    start = time.perf_counter()
    for s in range(warmup + steps):
        if s == warmup:
            dist.barrier()
            start = time.perf_counter()
            phases = [0.0] * 4
        t0 = time.perf_counter()
        out = F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
        t1 = time.perf_counter()
        out.backward()
        t2 = time.perf_counter()
        optimizer.step()
        loss = out.item()
        t3 = time.perf_counter()
        if s + 1 < warmup + steps:
            optimizer.zero_grad()
        t4 = time.perf_counter()
        for i, (a, b) in enumerate(((t0, t1), (t1, t2), (t2, t3), (t3, t4))):
            phases[i] += b - a
    dist.barrier()
    seconds = time.perf_counter() - start

    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    # The tensors the optimizer steps: under the 2-D recipe the module's parameters are swapped
    # between DTensors and local tensors around each pass, and model.parameters() then misses some.
    state_bytes = 0
    for p in (p for group in optimizer.param_groups for p in group["params"]):
        state_bytes += local(p).numel() * local(p).element_size()
        if p.grad is not None:
            state_bytes += local(p.grad).numel() * local(p.grad).element_size()
    for st in optimizer.state.values():
        for key in ("exp_avg", "exp_avg_sq"):
            if key in st:
                state_bytes += local(st[key]).numel() * 4
    if rank == 0:
        print(json.dumps({"workload": "parallel", "mode": args.mode, "side": "python", "processes": n,
                          "params": params, "tokens_per_s": round(steps * BATCH * BLOCK * (n // tp_size) / seconds, 1),
                          "state_mib": round(state_bytes / 1048576.0, 3), "peak_mib": round(status_mib("VmHWM"), 1),
                          "base_mib": round(base_mib, 1), "last_loss": round(loss, 6), "torch": torch.__version__}),
              flush=True)
        if args.phases:
            names = ("forward_ms", "backward_ms", "step_ms", "zero_grad_ms")
            print(json.dumps({"phases": args.mode, "side": "python",
                              **{k: round(1e3 * v / steps, 2) for k, v in zip(names, phases)}}), flush=True)
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", nargs="?", choices=["ddp", "fsdp", "tp", "fsdp_tp"])
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--phases", action="store_true")
    parser.add_argument("--probe", action="store_true")
    args = parser.parse_args()
    if args.probe:
        sys.exit(probe())
    if args.mode == "fsdp_tp":
        # FSDP2 (fully_shard) needs an accelerator's streams: PyTorch 2.6 fails on CPU processes
        # ("'Stream' object has no attribute 'record_event'").
        import torch

        if int(torch.__version__.split(".")[0]) == 2 and int(torch.__version__.split(".")[1]) <= 6:
            print(f"parallel_twin.py: no fsdp_tp twin on PyTorch {torch.__version__}: FSDP2 does not run on CPU "
                  "processes there", file=sys.stderr)
            sys.exit(0)
    if args.mode is None:
        parser.error("a mode is required")
    run_as_workers(lambda: worker(args), nproc=args.nproc, threads=args.threads)


if __name__ == "__main__":
    main()
