"""W4 twin: the same allreduce and gather loop as bench/collectives.cpp, in PyTorch over Gloo.

Starts its own processes with the launcher's environment contract (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT), since Debian's torchrun does not run on its Python.
Usage: python3 bench/collectives_twin.py [--quick] [--nproc 2]
"""
import json
import os
import sys
import time

from twin_launch import run_as_workers
import torch
import torch.distributed as dist

SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20]


def iterations_for(size, quick):
    base = 400 if size <= (1 << 16) else 100 if size <= (1 << 20) else 20 if size <= (16 << 20) else 8
    return max(5, base // 4) if quick else base


def time_it(iterations, fn):
    for _ in range(3):
        fn()
    samples = []
    for _ in range(iterations):
        dist.barrier()
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e6)
    samples.sort()
    return samples[len(samples) // 2], sum(samples) / len(samples)


def report(rank, op, size, stats, bus_factor):
    if rank != 0:
        return
    median, mean = stats
    print(json.dumps({"side": "python", "op": op, "bytes": size, "median_us": round(median, 2),
                      "mean_us": round(mean, 2), "busbw_gbps": size * bus_factor / (median * 1e3)}), flush=True)


def worker(quick):
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    for size in SIZES:
        numel = size // 4
        t = torch.ones(numel)
        iters = iterations_for(size, quick)

        def allreduce():
            c = t.clone()  # accelerate's reduce works on a copy, as upstream's does
            dist.all_reduce(c)

        report(rank, "allreduce", size, time_it(iters, allreduce), 2.0 * (n - 1) / n)
        part = torch.ones(numel // n)

        def gather():
            out = [torch.empty_like(part) for _ in range(n)]
            dist.all_gather(out, part)
            torch.cat(out)

        report(rank, "gather", size, time_it(iters, gather), (n - 1) / n)
    dist.destroy_process_group()


def main():
    quick = "--quick" in sys.argv
    run_as_workers(lambda: worker(quick), nproc=int(sys.argv[sys.argv.index("--nproc") + 1]) if "--nproc" in sys.argv else 2)


if __name__ == "__main__":
    main()
