"""Twin of bench/data_loader.cpp: the same datasets, collate functions, batch size and shuffling
through PyTorch's DataLoader with a DistributedSampler on each of 2 processes (the PyTorch way of
sharding). Starts its own processes with the launcher's environment contract, since Debian's
torchrun does not run on its Python. Usage: /usr/bin/python3 bench/data_loader_twin.py [--quick]
"""
import json
import os
import sys
import time

from twin_launch import run_as_workers
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset

SAMPLES = 16384
BATCH_SIZE = 64


class Tokens(Dataset):
    def __init__(self):
        gen = torch.Generator().manual_seed(0)
        lengths = torch.randint(16, 129, (SAMPLES,), generator=gen)
        features = torch.randn(SAMPLES, 64, generator=gen)
        self.labels = torch.randint(0, 10, (SAMPLES,), generator=gen)
        self.ids = [torch.randint(1, 30000, (int(lengths[i]),), generator=gen) for i in range(SAMPLES)]
        self.features = [features[i].clone() for i in range(SAMPLES)]

    def __len__(self):
        return SAMPLES

    def __getitem__(self, i):
        return {"input": self.ids[i], "target": self.labels[i], "features": self.features[i]}


def pad_collate(samples):
    n = len(samples)
    longest = max(s["input"].size(0) for s in samples)
    ids = torch.zeros(n, longest, dtype=torch.long)
    mask = torch.zeros(n, longest, dtype=torch.bool)
    for i, s in enumerate(samples):
        length = s["input"].size(0)
        ids[i, :length].copy_(s["input"])
        mask[i, :length].fill_(True)
    f = torch.stack([s["features"] for s in samples])
    f = (f - f.mean(0)) / (f.std(0) + 1e-5)
    return {"input": ids, "target": torch.stack([s["target"] for s in samples]), "attention_mask": mask, "features": f}


def batches_per_second(loader, sampler, epochs):
    sink = 0
    sampler.set_epoch(0)
    for batch in loader:  # warm-up epoch
        sink += len(batch)
    dist.barrier()
    start = time.perf_counter()
    batches = 0
    for e in range(epochs):
        sampler.set_epoch(e + 1)
        for batch in loader:
            sink += len(batch)
            batches += 1
    return batches / (time.perf_counter() - start)


def report(rank, workload, workers, rate):
    if rank == 0:
        print(json.dumps({"side": "python", "workload": workload, "num_workers": workers,
                          "processes": dist.get_world_size(), "batch_size": BATCH_SIZE,
                          "batches_per_s": round(rate, 2)}), flush=True)


def worker(quick):
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    epochs = 2 if quick else 8
    tokens = Tokens()
    gen = torch.Generator().manual_seed(1)
    mlp = TensorDataset(torch.randn(SAMPLES, 512, generator=gen), torch.randint(0, 10, (SAMPLES,), generator=gen))
    for workers in (0, 2):
        sampler = DistributedSampler(tokens, shuffle=True, seed=0)
        loader = DataLoader(tokens, batch_size=BATCH_SIZE, sampler=sampler, num_workers=workers, collate_fn=pad_collate)
        report(rank, "padded_tokens", workers, batches_per_second(loader, sampler, epochs))
        sampler = DistributedSampler(mlp, shuffle=True, seed=0)
        loader = DataLoader(mlp, batch_size=BATCH_SIZE, sampler=sampler, num_workers=workers)
        report(rank, "mlp_features", workers, batches_per_second(loader, sampler, epochs))
    dist.destroy_process_group()


def main():
    quick = "--quick" in sys.argv
    run_as_workers(lambda: worker(quick), nproc=2)


if __name__ == "__main__":
    main()
