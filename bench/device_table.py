"""The device table: one run that measures, on one device (a GPU, or the CPU to check the runner
itself), each figure of the library beside the same loop in plain LibTorch (the limit) and
beside its PyTorch twin:
  W1  the MLP of bench/training.cpp, 1 process, per precision (samples/s)
  W2  the transformer of bench/training.cpp, 1 process, per precision (samples/s)
  main job  examples/char_gpt, 1 process (tokens/s of its training steps; no twin)
  W9  bench/fsdp.cpp at 2 processes sharing the device over Gloo: DDP, FULL_SHARD, SHARD_GRAD_OP
      (peak device memory of process 0 as the CUDA allocator counts it, or VmHWM on the CPU)
  W12 the GPT-2-small-shaped model of bench/training.cpp ("gpt2": 12 layers, 12 heads, d 768,
      sequence 1024, vocabulary 50 304, batch 8, AdamW) in bf16 on a GPU, 1 process: tokens/s,
      MFU and peak device memory of the library's loop, the same loop in plain LibTorch and the
      nanoGPT-style PyTorch twin, eager and (where the wheel has it) under torch.compile. MFU is
      tokens/s x FLOPs per token (6 x parameters without the position embedding + 12 x layers x
      width x sequence) over the device's dense bf16 peak: --peak_tflops, else looked up by the
      GPU's name (PEAK_BF16_TFLOPS). On the CPU a tiny configuration checks the runner.
Every program runs through `accelerate launch` with one CPU thread per process, the plain
LibTorch one too, so that all run with the same environment (BLAS threads differ otherwise).
Precisions: no, bf16 and, on CUDA, fp16 (the scaler). Sides alternate within each repetition.
Usage: python3 bench/device_table.py --build DIR --device cuda|cpu [--python PYTHON] [--reps 2]
       [--quick] [--peak_tflops T] [--out FILE.jsonl]
Prints the table and exits 1 when a figure is missing; the raw rows go to --out.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))

# Dense bf16 peaks (TFLOP/s, without sparsity) from the vendors' data sheets, by a part of the
# name torch.cuda.get_device_name gives; the first match wins.
PEAK_BF16_TFLOPS = [("H200", 989.4), ("H100 PCIe", 756.0), ("H100", 989.4), ("A100", 312.0), ("L40S", 362.05),
                    ("A10G", 70.0), ("L4", 121.0)]

# W12's tiny configuration for the CPU (the runner's own check).
GPT_TINY = ["--gpt_layers", "2", "--gpt_heads", "2", "--gpt_embd", "64", "--gpt_seq", "64", "--gpt_vocab", "256",
            "--gpt_batch", "4", "--gpt_warmup_steps", "1", "--gpt_steps", "5"]


def json_rows(text):
    rows = []
    for line in text.splitlines():
        line = re.sub(r"^\[rank\d+\]: ", "", line.strip())
        if line.startswith("{"):
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return rows


def run(cmd, env=None, timeout=600):
    done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, timeout=timeout)
    if done.returncode != 0:
        print(f"device_table: {' '.join(cmd)} failed ({done.returncode}):\n{done.stdout[-3000:]}", file=sys.stderr)
    return done.stdout


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--build", required=True)
    parser.add_argument("--device", choices=["cpu", "cuda"], required=True)
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=None)
    parser.add_argument("--peak_tflops", type=float, default=None)
    args = parser.parse_args()
    build = os.path.abspath(args.build)
    accelerate = os.path.join(build, "bin", "accelerate")
    launch = [accelerate, "launch", "--main_process_port", "0", "--num_cpu_threads_per_process", "1"]
    cuda = args.device == "cuda"
    precisions = ["no", "bf16", "fp16"] if cuda else ["no", "bf16"]
    scale = 10 if args.quick else 1
    steps = {
        "mlp": ["--warmup_steps", str((200 if cuda else 20) // scale or 1), "--mlp_steps", str((3000 if cuda else 200) // scale)],
        "transformer": ["--transformer_warmup_steps", str(20 if cuda else 2), "--transformer_steps",
                        str(max(1, (300 if cuda else 10) // scale))],
    }
    rows = []
    for _ in range(args.reps):
        for workload in ("mlp", "transformer"):
            for precision in precisions:
                flags = ["--workloads", workload] + steps[workload]
                cpp = launch + ["--num_processes", "1", "--mixed_precision", precision,
                                os.path.join(build, "bench", "bench_training")] + flags
                plain = launch + ["--num_processes", "1", os.path.join(build, "bench", "bench_training_plain"),
                                  "--device", "cuda:0" if cuda else "cpu", "--mixed_precision", precision] + flags
                twin = [args.python, os.path.join(HERE, "training_twin.py"), "--nproc", "1", "--threads", "1",
                        "--device", args.device, "--mixed_precision", precision] + flags
                for cmd in (cpp, plain, twin):
                    rows += json_rows(run(cmd))

    # W12: the GPT-2-small-shaped model, 1 process, bf16 on a GPU (the tiny one in fp32 on the CPU).
    gpt = (["--gpt_steps", str(max(2, 20 // scale))] if cuda else GPT_TINY)
    gpt_precision = "bf16" if cuda else "no"
    for _ in range(args.reps):
        flags = ["--workloads", "gpt2"] + gpt
        cpp = launch + ["--num_processes", "1", "--mixed_precision", gpt_precision,
                        os.path.join(build, "bench", "bench_training")] + flags
        plain = launch + ["--num_processes", "1", os.path.join(build, "bench", "bench_training_plain"),
                          "--device", "cuda:0" if cuda else "cpu", "--mixed_precision", gpt_precision] + flags
        twin = [args.python, os.path.join(HERE, "training_twin.py"), "--nproc", "1", "--threads", "1",
                "--device", args.device, "--mixed_precision", gpt_precision] + flags
        for cmd in (cpp, plain, twin):
            rows += json_rows(run(cmd))
        if cuda:
            rows += json_rows(run(twin + ["--compile"]))

    # The main job on one process of the device, 100 steps (bf16 on a GPU, as gpu_check's main job).
    with tempfile.TemporaryDirectory() as out_dir:
        job = launch + ["--num_processes", "1"] + (["--mixed_precision", "bf16"] if cuda else []) + [
            os.path.join(build, "examples", "char_gpt"), "--max_steps", str(100 // scale), "--output_dir", out_dir]
        text = run(job)
        match = re.search(r"throughput: (\d+) tokens/s", text)
        if match:
            rows.append({"side": "cpp", "workload": "main_job", "tokens_per_s": int(match.group(1)),
                         "mixed_precision": "bf16" if cuda else "no"})

    # W9 at 2 processes sharing the device (NCCL refuses two ranks on one GPU: Gloo). The job sees
    # one GPU only, the first this runner sees, as the gpu test tier gives it (tests/support/gpu.h):
    # otherwise process 1 takes the second GPU of a machine that has one, or another job's.
    share = dict(os.environ)
    if cuda:
        share["CUDA_VISIBLE_DEVICES"] = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0]
    for mode in ("ddp", "full_shard", "shard_grad_op"):
        cmd = launch + ["--num_processes", "2", "--backend", "gloo", os.path.join(build, "bench", "bench_fsdp"), mode]
        if args.quick:
            cmd.append("--quick")
        rows += json_rows(run(cmd, env=share))

    if args.out:
        with open(args.out, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    peak = args.peak_tflops or (peak_of_device(args.python) if cuda else None)
    sys.exit(0 if print_table(rows, precisions, cuda, peak) else 1)


def peak_of_device(python):
    """The dense bf16 peak (TFLOP/s) of GPU 0 by its name, or None when the name is not in the list."""
    name = subprocess.run([python, "-c", "import torch; print(torch.cuda.get_device_name(0))"],
                          stdout=subprocess.PIPE, text=True).stdout.strip()
    return next(((part, tflops) for part, tflops in PEAK_BF16_TFLOPS if part in name), (name, None))


def print_table(rows, precisions, cuda, peak=None):
    complete = True

    def median(side, workload, precision, key="samples_per_s"):
        v = [r[key] for r in rows if r.get("side") == side and r.get("workload") == workload
             and r.get("mixed_precision", "no") == precision and key in r]
        return (statistics.median(v), min(v), max(v)) if v else None

    device = next((r.get("device") for r in rows if r.get("side") == "cpp" and "device" in r), "?")
    print(f"Device table on {device}: medians [min-max] of each side's runs; 1 process unless said")
    print(f"{'workload':<12} {'precision':<9} {'C++ (library)':>22} {'plain LibTorch':>22} {'PyTorch twin':>22} "
          f"{'C++/plain':>9} {'C++/PyTorch':>11}")
    for workload, unit in (("mlp", "samples/s"), ("transformer", "samples/s")):
        for precision in precisions:
            figures = [median(side, workload, precision) for side in ("cpp", "plain", "python")]
            texts = [f"{f[0]:.0f} [{f[1]:.0f}-{f[2]:.0f}]" if f else "missing" for f in figures]
            if not all(figures):
                complete = False
            ratio = lambda a, b: f"{a[0] / b[0]:.3f}" if a and b else "-"
            name = "W1 mlp" if workload == "mlp" else "W2 transf."
            print(f"{name:<12} {precision:<9} {texts[0]:>22} {texts[1]:>22} {texts[2]:>22} "
                  f"{ratio(figures[0], figures[1]):>9} {ratio(figures[0], figures[2]):>11}  ({unit})")
    losses = {}
    for r in rows:
        if r.get("workload") in ("mlp", "transformer") and "last_loss" in r:
            losses.setdefault((r["workload"], r.get("mixed_precision", "no")), {})[r["side"]] = r["last_loss"]
    for (workload, precision), by_side in sorted(losses.items()):
        print(f"  last loss {workload} {precision}: " + ", ".join(f"{s} {v:.4f}" for s, v in sorted(by_side.items())))
    complete = print_gpt2(rows, cuda, peak) and complete
    job = [r for r in rows if r.get("workload") == "main_job"]
    if job:
        print(f"{'main job':<12} {job[0]['mixed_precision']:<9} {job[0]['tokens_per_s']:>15} tokens/s (char_gpt; no twin)")
    else:
        print("main job: missing")
        complete = False
    key = "peak_device_allocated_mib" if cuda else "peak_mib"
    fsdp = {r["mode"]: r for r in rows if r.get("workload") == "fsdp"}
    for mode in ("ddp", "full_shard", "shard_grad_op"):
        r = fsdp.get(mode)
        if not r:
            print(f"W9 {mode}: missing")
            complete = False
            continue
        against = f"{r[key] / fsdp['ddp'][key]:.2f} x DDP" if "ddp" in fsdp and fsdp["ddp"].get(key, 0) > 0 else ""
        reserved = f", reserved {r['peak_device_reserved_mib']:.0f} MiB" if cuda else ""
        print(f"W9 {mode:<14} 2 processes: {r['samples_per_s']:.0f} samples/s, peak "
              f"{'device memory' if cuda else 'resident memory'} of process 0 {r[key]:.0f} MiB{reserved} {against}")
    return complete


def print_gpt2(rows, cuda, peak):
    """W12's rows: tokens/s, MFU and peak memory per side, against plain LibTorch and eager PyTorch."""
    name, tflops = peak if peak and isinstance(peak, tuple) else ("--peak_tflops", peak)
    gpt = [r for r in rows if r.get("workload") == "gpt2"]
    precision = "bf16" if cuda else "no"
    print(f"W12 gpt2 ({precision}, 1 process; MFU against {f'{tflops} TFLOP/s dense bf16 ({name})' if tflops else 'no known peak'}):")
    figures = {}
    complete = True
    for side, label in (("cpp", "C++ (library)"), ("plain", "plain LibTorch"), ("python", "PyTorch eager"),
                        ("python-compile", "PyTorch compile")):
        got = [r for r in gpt if r.get("side") == side]
        if not got:
            if side != "python-compile":
                print(f"  {label:<16} missing")
                complete = False
            elif cuda:
                print(f"  {label:<16} missing (torch.compile did not run; its error is above)")
            continue
        tokens = statistics.median(r["tokens_per_s"] for r in got)
        figures[side] = tokens
        mfu = f"{tokens * got[0]['flops_per_token'] / (tflops * 1e12) * 100:.1f} %" if tflops else "-"
        memory = ""
        if cuda:
            memory = f", peak {statistics.median(r.get('peak_device_allocated_mib', -1) for r in got):.0f} MiB allocated"
        print(f"  {label:<16} {tokens:>12.0f} tokens/s  MFU {mfu:>7}{memory}  last loss {got[0]['last_loss']:.4f}")
    if "cpp" in figures:
        ratios = [f"C++/{side} {figures['cpp'] / figures[side]:.3f}" for side in ("plain", "python", "python-compile")
                  if side in figures]
        print("  " + ", ".join(ratios))
    return complete


if __name__ == "__main__":
    main()
