"""Twin of bench/training.cpp: the same models, batches, seeds, SGD settings and step counts,
trained with torch.nn.parallel.DistributedDataParallel over Gloo (default bucket settings) on
2 processes, or the bare model on 1; gradient accumulation with DDP's no_sync, bf16 (and, on
CUDA, fp16 with PyTorch's GradScaler) with torch.autocast around the forward pass (outputs back to
float32, as upstream Accelerate's prepared model does). Starts its own processes with the launcher's environment contract, since
Debian's torchrun does not run on its Python; the parent imports torch as torchrun would.
With --device cuda the model and the batches live on the GPU (process i on GPU i, NCCL between
processes) and the clock is read after the GPU finished, as bench/training.cpp does on a CUDA
machine (scripts/gpu_check.sh).
W12 ("gpt2") is nanoGPT's GPT in eager PyTorch: F.scaled_dot_product_attention (written out where
the release lacks it), AdamW (fused on CUDA); with --compile the model goes through
torch.compile first (side "python-compile"), where the release has it.
Usage: /usr/bin/python3 bench/training_twin.py [--quick] [--nproc 2] [--threads 1] [--device cpu|cuda]
       [--mixed_precision no|bf16|fp16] [--workloads mlp,mlp_accum4,tiny,transformer,gpt2|startup]
       [--warmup_steps 20] [--mlp_steps 200] [--tiny_steps 2000] [--transformer_warmup_steps 3]
       [--transformer_steps 40] [--gpt_layers 12] [--gpt_heads 12] [--gpt_embd 768] [--gpt_seq 1024]
       [--gpt_vocab 50304] [--gpt_batch 8] [--gpt_warmup_steps 3] [--gpt_steps 20] [--compile]
"""
import argparse
import contextlib
import json
import os
import time

from twin_launch import run_as_workers
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

# Where models and batches live: the CPU, or this process's GPU with --device cuda (set by worker).
DEVICE = torch.device("cpu")


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


class EncoderClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(256, 4, dim_feedforward=2048, dropout=0.0), 2,
                                             enable_nested_tensor=False)
        self.head = nn.Linear(256, 10)

    def forward(self, x):  # x: [sequence, batch, 256]
        return self.head(self.encoder(x).mean(0))


def causal_attention(q, k, v):
    if hasattr(F, "scaled_dot_product_attention"):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    scores = q @ k.transpose(-2, -1) / (q.size(-1) ** 0.5)
    future = torch.ones(q.size(-2), k.size(-2), dtype=torch.bool, device=q.device).triu(1)
    return scores.masked_fill(future, float("-inf")).softmax(-1) @ v


class GptBlock(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.heads = c["heads"]
        self.norm_1 = nn.LayerNorm(c["embd"])
        self.attn_qkv = nn.Linear(c["embd"], 3 * c["embd"])
        self.attn_proj = nn.Linear(c["embd"], c["embd"])
        self.norm_2 = nn.LayerNorm(c["embd"])
        self.mlp_fc = nn.Linear(c["embd"], 4 * c["embd"])
        self.mlp_proj = nn.Linear(4 * c["embd"], c["embd"])

    def forward(self, x):
        B, T, C = x.shape
        qkv = self.attn_qkv(self.norm_1(x)).view(B, T, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        y = causal_attention(qkv[0], qkv[1], qkv[2]).transpose(1, 2).reshape(B, T, C)
        x = x + self.attn_proj(y)
        return x + self.mlp_proj(F.gelu(self.mlp_fc(self.norm_2(x))))


class Gpt(nn.Module):
    """bench/training_models.h's GptImpl, with the same parameter names."""

    def __init__(self, c):
        super().__init__()
        self.wte = nn.Embedding(c["vocab"], c["embd"])
        self.wpe = nn.Embedding(c["seq"], c["embd"])
        self.h = nn.ModuleList([GptBlock(c) for _ in range(c["layers"])])
        self.norm_f = nn.LayerNorm(c["embd"])

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1), device=idx.device))
        for block in self.h:
            x = block(x)
        return self.norm_f(x) @ self.wte.weight.t()

    def flops_per_token(self, c):
        n = sum(p.numel() for p in self.parameters()) - self.wpe.weight.numel()
        return 6.0 * n + 12.0 * c["layers"] * c["embd"] * c["seq"]


def gpt_loss(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def init_transformer(net):
    """The C++ side's deterministic parameters: in name order, matrices N(0, 0.02^2) from one
    generator, layer-norm weights 1, biases 0."""
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in sorted(net.named_parameters()):
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
            elif "norm" in name and name.endswith("weight"):
                p.fill_(1.0)
            else:
                p.zero_()


def make_grad_scaler():
    """PyTorch's loss scaler for CUDA (torch.amp's from 2.3, torch.cuda.amp's before)."""
    if hasattr(torch, "amp") and hasattr(torch.amp, "GradScaler"):
        return torch.amp.GradScaler("cuda")
    return torch.cuda.amp.GradScaler()


def median_mean(v):
    v = sorted(v)
    return v[len(v) // 2], sum(v) / len(v)


def synchronize():
    """GPU work runs asynchronously: waits for this process's GPU before the clock is read."""
    if DEVICE.type == "cuda":
        torch.cuda.synchronize(DEVICE)


def data_parallel(net):
    return DistributedDataParallel(net, device_ids=[DEVICE.index] if DEVICE.type == "cuda" else None)


def run(workload, net, x, y, loss_fn, warmup_steps, steps, accumulation=1, precision="no", language_model=None,
        compiled=False):
    """language_model: W12's {"tokens_per_sample", "flops_per_token"} (AdamW instead of SGD)."""
    distributed = dist.is_initialized()
    net.to(DEVICE)
    x, y = x.to(DEVICE), y.to(DEVICE)
    if DEVICE.type == "cuda":
        torch.cuda.reset_peak_memory_stats(DEVICE)
    model = data_parallel(net) if distributed else net
    if compiled:
        model = torch.compile(model)
    if language_model:
        fused = {"fused": True} if DEVICE.type == "cuda" else {}
        opt = torch.optim.AdamW(net.parameters(), lr=3e-4, weight_decay=0.1, **fused)
    else:
        opt = torch.optim.SGD(net.parameters(), lr=0.01)
    first_loss = None
    barrier = dist.barrier if distributed else (lambda: None)
    counter = 0

    # fp16 scales the loss as the Accelerator does (its GradScaler); the scaler's step skips a step
    # whose gradients overflowed and update() moves the scale.
    scaler = make_grad_scaler() if precision == "fp16" else None

    def forward():
        if precision != "no":
            dtype = torch.bfloat16 if precision == "bf16" else torch.float16
            with torch.autocast(DEVICE.type, dtype=dtype):
                out = model(x)
            return loss_fn(out.float(), y)
        return loss_fn(model(x), y)

    def backward(loss):
        (scaler.scale(loss) if scaler else loss).backward()

    def step():
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()

    def sync_context():
        # Every `accumulation`-th step synchronises, counted from the first warm-up step.
        nonlocal counter
        counter += 1
        sync = counter % accumulation == 0
        return sync, (model.no_sync() if distributed and not sync else contextlib.nullcontext())

    for _ in range(warmup_steps):
        sync, context = sync_context()
        with context:
            loss = forward()
            if first_loss is None:
                first_loss = loss.item()
            backward(loss / accumulation)
        if sync:
            step()
            opt.zero_grad(set_to_none=True)  # the default of the C++ side (and of PyTorch 2)

    phases = [[0.0] * steps for _ in range(4)]
    step_us = [0.0] * steps
    clock = time.perf_counter
    synchronize()
    barrier()
    start = clock()
    for i in range(steps):
        t0 = clock()
        sync, context = sync_context()
        with context:
            loss = forward()
            if first_loss is None:
                first_loss = loss.item()
            t1 = clock()
            backward(loss / accumulation)
        t2 = clock()
        if sync:
            step()
        t3 = clock()
        if sync:
            opt.zero_grad(set_to_none=True)
        t4 = clock()
        phases[0][i], phases[1][i], phases[2][i], phases[3][i] = (t1 - t0) * 1e6, (t2 - t1) * 1e6, (t3 - t2) * 1e6, (t4 - t3) * 1e6
        step_us[i] = (t4 - t0) * 1e6
    synchronize()
    barrier()
    seconds = clock() - start
    rank = dist.get_rank() if distributed else 0
    if rank != 0:
        return
    n = dist.get_world_size() if distributed else 1
    batch = x.size(1) if x.dim() == 3 else x.size(0)  # the transformer's input is [sequence, batch, d]
    step_median, step_mean = median_mean(step_us)
    names = ["forward", "backward", "step", "zero_grad"]
    extra = {}
    if language_model:
        extra["tokens_per_s"] = round(steps / seconds * batch * n * language_model["tokens_per_sample"], 1)
        extra["flops_per_token"] = language_model["flops_per_token"]
    if DEVICE.type == "cuda":
        extra["peak_device_allocated_mib"] = round(torch.cuda.max_memory_allocated(DEVICE) / 1048576, 1)
        extra["peak_device_reserved_mib"] = round(torch.cuda.max_memory_reserved(DEVICE) / 1048576, 1)
    print(json.dumps({
        "side": "python-compile" if compiled else "python", "workload": workload, "device": str(DEVICE), "processes": n, "threads": torch.get_num_threads(),
        "mixed_precision": precision, "batch_size": batch, "warmup_steps": warmup_steps,
        "steps": steps, "steps_per_s": round(steps / seconds, 3), "samples_per_s": round(steps / seconds * batch * n, 1),
        "step_median_us": round(step_median, 1), "step_mean_us": round(step_mean, 1),
        "phase_median_mean_us": {name: [round(m, 1) for m in median_mean(p)] for name, p in zip(names, phases)},
        **extra, "first_loss": round(first_loss, 6), "last_loss": round(loss.item(), 6)}), flush=True)


def first_step(x, y):
    """W5: one optimizer step of the MLP, then the wall-clock time on process 0."""
    distributed = dist.is_initialized()
    net = Mlp().to(DEVICE)
    x, y = x.to(DEVICE), y.to(DEVICE)
    model = data_parallel(net) if distributed else net
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    now = time.time()
    if (dist.get_rank() if distributed else 0) == 0:
        print(json.dumps({"side": "python", "workload": "startup", "processes": dist.get_world_size() if distributed else 1,
                          "first_step_end_unix": now, "last_loss": round(loss.item(), 6)}), flush=True)


def worker(args):
    global DEVICE
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if args.device == "cuda":
        DEVICE = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(DEVICE)
    if int(os.environ["WORLD_SIZE"]) > 1:
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank = int(os.environ["RANK"])
    precision = args.mixed_precision
    if precision == "fp16" and args.device != "cuda":
        raise SystemExit("[training_twin] fp16 needs --device cuda (as the Accelerator, which refuses fp16 on the CPU)")
    for workload in args.workloads.split(","):
        torch.manual_seed(0)
        gen = torch.Generator().manual_seed(1000 + rank)
        if workload in ("mlp", "mlp_accum4", "startup"):
            x = torch.randn(64, 512, generator=gen)
            y = torch.randint(0, 10, (64,), generator=gen)
            if workload == "startup":
                first_step(x, y)
            else:
                run(workload, Mlp(), x, y, F.cross_entropy, args.warmup_steps, args.mlp_steps,
                    1 if workload == "mlp" else 4, precision)
        elif workload == "tiny":
            net = Tiny()
            x = torch.randn(8, 32, generator=gen)
            y = torch.randn(8, 32, generator=gen)
            run("tiny", net, x, y, F.mse_loss, args.warmup_steps, args.tiny_steps, 1, precision)
        elif workload == "transformer":
            net = EncoderClassifier()
            init_transformer(net)
            x = torch.randn(64, 16, 256, generator=gen)
            y = torch.randint(0, 10, (16,), generator=gen)
            run("transformer", net, x, y, F.cross_entropy, args.transformer_warmup_steps, args.transformer_steps, 1, precision)
        elif workload == "gpt2":
            c = {"layers": args.gpt_layers, "heads": args.gpt_heads, "embd": args.gpt_embd, "seq": args.gpt_seq,
                 "vocab": args.gpt_vocab}
            net = Gpt(c)
            init_transformer(net)
            x = torch.randint(0, c["vocab"], (args.gpt_batch, c["seq"]), generator=gen)
            y = torch.randint(0, c["vocab"], (args.gpt_batch, c["seq"]), generator=gen)
            lm = {"tokens_per_sample": c["seq"], "flops_per_token": net.flops_per_token(c)}
            if args.compile and not hasattr(torch, "compile"):
                raise SystemExit(f"[training_twin] --compile: PyTorch {torch.__version__} has no torch.compile")
            run("gpt2", net, x, y, gpt_loss, args.gpt_warmup_steps, args.gpt_steps, 1, precision, lm, args.compile)
        else:
            raise ValueError(f"[training_twin] unknown workload {workload} "
                             "(expected mlp, mlp_accum4, tiny, transformer, gpt2 or startup)")
    if dist.is_initialized():
        dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--mixed_precision", default="no", choices=["no", "bf16", "fp16"])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--workloads", default="mlp,mlp_accum4,tiny,transformer")
    parser.add_argument("--warmup_steps", type=int, default=20)
    parser.add_argument("--mlp_steps", type=int, default=200)
    parser.add_argument("--tiny_steps", type=int, default=2000)
    parser.add_argument("--transformer_warmup_steps", type=int, default=3)
    parser.add_argument("--transformer_steps", type=int, default=40)
    for name, default in (("layers", 12), ("heads", 12), ("embd", 768), ("seq", 1024), ("vocab", 50304), ("batch", 8),
                          ("warmup_steps", 3), ("steps", 20)):
        parser.add_argument(f"--gpt_{name}", type=int, default=default)
    parser.add_argument("--compile", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.mlp_steps = max(1, args.mlp_steps // 4)
        args.tiny_steps = max(1, args.tiny_steps // 4)
        args.transformer_steps = max(1, args.transformer_steps // 4)
    run_as_workers(lambda: worker(args), nproc=args.nproc, threads=args.threads)


if __name__ == "__main__":
    main()
