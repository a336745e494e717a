"""Turns the JSON lines the benchmark programs and their twins print into rows of the schema
documented in bench/summarize.py (one sample per repetition and side), with each workload's
targets and physical limit. Usage: rows.py training|collectives|checkpoint|data_loader|offload|fsdp|parallel raw.jsonl
(prints rows on stdout; the bench/run_* scripts append them to their rows file)."""
import json
import sys

# Targets from the benchmark issue; measured and reported, never asserted by tests.
THROUGHPUT_2P = [{"side": "cpp", "vs": "python", "op": ">=", "ratio": 1.1}]


def row(workload, case, metric, better, side, value, **extra):
    r = {"workload": workload, "case": case, "metric": metric, "better": better, "side": side, "value": value}
    r.update({k: v for k, v in extra.items() if v is not None})
    return r


def size_text(nbytes):
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def training(raw):
    """bench/training.cpp and bench/training_twin.py (and the runner's launch-start lines for W5)."""
    out = []
    single = {}  # (workload, side, mixed precision) -> samples/s of 1-process runs, in order
    for r in raw:
        if r["workload"] == "startup":
            continue
        if r["processes"] == 1:
            single.setdefault((r["workload"], r["side"], r.get("mixed_precision", "no")), []).append(r["samples_per_s"])
    seen = {}
    for r in raw:
        w, n, side = r["workload"], r["processes"], r["side"]
        procs = f"{n} process" + ("es" if n > 1 else "")
        if w == "startup":
            out.append(row("W5", f"launch to first step, {procs}", "s", "lower", side,
                           r["first_step_end_unix"] - r["launch_start_unix"], loss=r.get("last_loss"),
                           targets=[{"side": "cpp", "vs": "python", "op": "<=", "ratio": 0.25}]))
            continue
        mp = r.get("mixed_precision", "no")
        detail = {"phases_us": r["phase_median_mean_us"], "step_median_us": r["step_median_us"],
                  "step_mean_us": r["step_mean_us"], "steps": r["steps"], "threads": r["threads"]}
        if "step_without_communication_median_us" in r:  # the same step inside no_sync, measured apart
            detail["step_without_communication_median_us"] = r["step_without_communication_median_us"]
        if w == "tiny":
            targets = [{"side": "cpp", "vs": "python", "op": "<=", "ratio": 0.5 if n == 1 else 0.6}]
            if side == "cpp-mpi":  # the MPI issue's target: 0.2 of the Python Gloo twin
                targets = [{"side": "cpp-mpi", "vs": "python", "op": "<=", "ratio": 0.2}]
            out.append(row("W3", f"tiny Linear(32,32), {procs}", "us/step", "lower", side, 1e6 / r["steps_per_s"],
                           loss=r["last_loss"], targets=targets, detail=detail))
            continue
        workload, name = {"mlp": ("W1", "mlp"), "mlp_accum4": ("W1", "mlp accumulation 4"),
                          "transformer": ("W2", "transformer")}[w]
        case = f"{name}{', bf16' if mp == 'bf16' else ''}, {procs}"
        targets = THROUGHPUT_2P if n == 2 else None
        if side == "cpp-mpi" and mp == "no" and w in ("mlp", "mlp_accum4"):
            # Of two processes without communication: 0.85 stepping every batch, 0.9 with accumulation.
            targets = [{"side": "cpp-mpi", "vs": "limit", "op": ">=", "ratio": 0.85 if w == "mlp" else 0.9}]
        out.append(row(workload, case, "samples/s", "higher", side, r["samples_per_s"], loss=r["last_loss"],
                       targets=targets, detail=detail))
        if "peak_mib" in r:  # process 0's VmHWM over this workload (the C++ sides)
            out.append(row(workload, case, "peak MiB", "lower", side, r["peak_mib"]))
        # The scaling limit of 2 processes: twice one process of the same side, no communication.
        if n == 2 and side == "cpp" and mp == "no":
            k = seen.get((w, mp), 0)
            seen[(w, mp)] = k + 1
            ones = single.get((w, "cpp", mp), [])
            if ones:
                out.append(row(workload, case, "samples/s", "higher", "limit", 2 * ones[min(k, len(ones) - 1)],
                               limit="2x C++ 1-process"))
    return out


def collectives(raw):
    """bench/collectives.cpp and bench/collectives_twin.py: bus bandwidth per operation and size on
    2 processes. The limit beside it is the bus bandwidth the operation would have if it took as
    long as a single-process memory copy of the same bytes; from 16 MiB on, each C++ side must
    take at most 4 times that copy's time (ratio to the limit >= 0.25). The machine's own figure
    comes first: writing 64 MiB into fresh pages and into reused ones."""
    out = []
    for r in raw:
        if r["side"] == "machine":
            name = {"fill_fresh": "fresh pages (mapped, written, unmapped)", "fill_reused": "pages already held"}
            out.append(row("W4", f"machine: writing 64 MiB into {name[r['op']]}", "GB/s", "higher", "machine",
                           r["gbps"], detail={"median_us": r["median_us"]}))
    n = 2
    factor = {"allreduce": 2.0 * (n - 1) / n, "gather": (n - 1) / n}
    memcpy = [r for r in raw if r["op"] == "memcpy" and r["side"] == "cpp"]
    for r in raw:
        if r["op"] == "memcpy" or r["side"] == "machine":
            continue
        detail = {"median_us": r["median_us"], "mean_us": r["mean_us"]}
        targets = []
        if r["side"] == "cpp":
            targets.append({"side": "cpp", "vs": "python", "op": ">=", "ratio": 1.0})
        if r["side"] in ("cpp", "cpp-mpi") and r["bytes"] >= 16 << 20:
            targets.append({"side": r["side"], "vs": "limit", "op": ">=", "ratio": 0.25})
        out.append(row("W4", f"{r['op']} {size_text(r['bytes'])}, 2 processes", "bus GB/s", "higher", r["side"],
                       r["busbw_gbps"], detail=detail, targets=targets or None))
    for m in memcpy:
        for op in sorted({r["op"] for r in raw if r["op"] not in ("memcpy",) and r["side"] != "machine"}):
            out.append(row("W4", f"{op} {size_text(m['bytes'])}, 2 processes", "bus GB/s", "higher", "limit",
                           m["busbw_gbps"] * factor[op], limit="memcpy of the same bytes, 1 process"))
    return out


def mb_per_s(text):
    value, unit = text.split()
    return float(value) * {"kB/s": 1e-3, "MB/s": 1.0, "GB/s": 1e3, "B/s": 1e-6}[unit]


def checkpoint(raw):
    """bench/checkpoint.cpp, bench/checkpoint_twin.py and dd lines ({"side": "dd", "bytes",
    "write", "read"} with dd's own rate text) for the same sizes on the same disk."""
    out = []
    names = {"state_dict_200mb": "state dict ~200 MB", "transformer_save_state": "W2 save_state"}
    cpp_bytes = {}
    for r in raw:
        if r["side"] == "cpp":
            cpp_bytes[r["workload"]] = r["bytes"]
    for r in raw:
        if r["side"] == "dd":
            for workload, nbytes in cpp_bytes.items():
                if nbytes == r["bytes"]:
                    out.append(row("W6", f"save {names[workload]} (fsync)", "MB/s", "higher", "limit",
                                   mb_per_s(r["write"]), limit="dd conv=fsync"))
                    out.append(row("W6", f"load {names[workload]}", "MB/s", "higher", "limit", mb_per_s(r["read"]),
                                   limit="dd read"))
            continue
        name = names[r["workload"]]
        both = [{"side": "cpp", "vs": "limit", "op": ">=", "ratio": 0.8}, {"side": "cpp", "vs": "python", "op": ">=", "ratio": 1.0}]
        out.append(row("W6", f"save {name} (fsync)", "MB/s", "higher", r["side"], r["save_mb_per_s"], targets=both,
                       detail={"bytes": r["bytes"], "seconds": r["save_s"]}))
        out.append(row("W6", f"load {name}", "MB/s", "higher", r["side"], r["load_mb_per_s"], targets=both,
                       detail={"bytes": r["bytes"], "seconds": r["load_s"]}))
    return out


def data_loader(raw):
    """bench/data_loader.cpp and bench/data_loader_twin.py."""
    return [row("W7", f"{r['workload']}, {r['num_workers']} workers, {r.get('processes', 2)} processes", "batches/s",
                "higher", r["side"], r["batches_per_s"]) for r in raw]


def offload(raw):
    """bench/offload.cpp and bench/offload_twin.py: forward in memory and with every weight on the
    disk; the C++ in-memory forward is the limit of the offloaded one. The checksum of the output
    (the same weights and input on both sides) stands in for a loss."""
    out = []
    for r in raw:
        case = "forward, disk-offloaded" if r["variant"] == "disk_offload" else "forward, in memory"
        targets = None
        if r["variant"] == "disk_offload" and r["side"] == "cpp":  # reading ahead hides the disk
            targets = [{"side": "cpp", "vs": "limit", "op": ">=", "ratio": 0.8}]
        out.append(row("W8", case, "samples/s", "higher", r["side"], r["samples_per_s"], loss=r["checksum"],
                       targets=targets))
        if r["variant"] == "in_memory" and r["side"] == "cpp":
            out.append(row("W8", "forward, disk-offloaded", "samples/s", "higher", "limit", r["samples_per_s"],
                           limit="C++ forward in memory"))
    return out


def fsdp(raw):
    """bench/fsdp.cpp and bench/fsdp_twin.py: per repetition and number of processes, DDP then
    FULL_SHARD then SHARD_GRAD_OP, each side after the other. Throughput rows take C++ DDP's
    samples/s of the same repetition as the limit; memory rows take the process's memory before the
    model plus C++ DDP's model memory / N plus the largest unit. The twin (side "python") is
    PyTorch's DDP and its own FSDP where that runs on CPU processes."""
    out = []
    ddp = {}  # side -> its last DDP record
    for r in raw:
        n, side = r["processes"], r["side"]
        size = f"{r['params'] / 1e6:.0f}M"
        if r["mode"] == "ddp":
            ddp[side] = r
            out.append(row("W9", f"blocks {size}, DDP, {n} processes", "samples/s", "higher", side, r["samples_per_s"],
                           loss=r["last_loss"]))
            out.append(row("W9", f"blocks {size}, DDP, {n} processes", "peak MiB", "lower", side, r["peak_mib"]))
            continue
        name = {"full_shard": "FULL_SHARD", "shard_grad_op": "SHARD_GRAD_OP"}[r["mode"]]
        case = f"blocks {size}, {name}, {n} processes"
        if side != "cpp":
            out.append(row("W9", case, "samples/s", "higher", side, r["samples_per_s"], loss=r["last_loss"]))
            out.append(row("W9", case, "peak MiB", "lower", side, r["peak_mib"],
                           detail={"base_mib": r["base_mib"], "torch": r.get("torch")}))
            continue
        targets = [{"side": "cpp", "vs": "limit", "op": ">=", "ratio": 0.8}] if n == 2 and name == "FULL_SHARD" else None
        out.append(row("W9", case, "samples/s", "higher", "cpp", r["samples_per_s"], loss=r["last_loss"], targets=targets))
        # The limit holds one unit whole: FULL_SHARD's bound (SHARD_GRAD_OP keeps every unit whole
        # from its forward to its backward, by design).
        mem_targets = [{"side": "cpp", "vs": "limit", "op": "<=", "ratio": 1.2}] if name == "FULL_SHARD" else None
        out.append(row("W9", case, "peak MiB", "lower", "cpp", r["peak_mib"], targets=mem_targets,
                       detail={"base_mib": r["base_mib"], "largest_unit_mib": r["largest_unit_mib"]}))
        base = ddp.get("cpp")
        if base is not None and base["processes"] == n:
            out.append(row("W9", case, "samples/s", "higher", "limit", base["samples_per_s"], limit="C++ DDP",
                           loss=base["last_loss"]))
            model = base["peak_mib"] - base["base_mib"]
            out.append(row("W9", case, "peak MiB", "lower", "limit",
                           r["base_mib"] + model / n + r["largest_unit_mib"], limit="base + DDP model / N + unit"))
            out.append(row("W9", case, "peak MiB", "lower", "cpp-ddp", base["peak_mib"]))
    return out


def parallel(raw):
    """bench/parallel.cpp and bench/parallel_twin.py: per repetition, DDP, FULL_SHARD, TP 2 x DDP
    and TP 2 x FULL_SHARD, each side after the other. The memory rows of tensor parallelism take C++
    DDP's parameter, gradient and AdamW bytes per process of the same repetition as the limit."""
    out = []
    names = {"ddp": "DDP", "fsdp": "FULL_SHARD", "tp": "TP 2 x DDP", "fsdp_tp": "TP 2 x FULL_SHARD"}
    ddp = {}  # side -> its last DDP record
    for r in raw:
        n, side, mode = r["processes"], r["side"], r["mode"]
        case = f"GPT {r['params'] / 1e6:.2f}M, {names[mode]}, {n} processes"
        if mode == "ddp":
            ddp[side] = r
        tp = mode in ("tp", "fsdp_tp")
        speed = [{"side": "cpp", "vs": "python", "op": ">=", "ratio": 1.0}] if tp and side == "cpp" else None
        out.append(row("W10", case, "tokens/s", "higher", side, r["tokens_per_s"], loss=r["last_loss"],
                       targets=speed))
        memory = [{"side": "cpp", "vs": "limit", "op": "<=", "ratio": 0.55}] if mode == "tp" and side == "cpp" else None
        out.append(row("W10", case, "state MiB", "lower", side, r["state_mib"], targets=memory,
                       detail={"torch": r.get("torch")} if side != "cpp" else None))
        out.append(row("W10", case, "peak MiB", "lower", side, r["peak_mib"], detail={"base_mib": r["base_mib"]}))
        base = ddp.get("cpp")
        if tp and side == "cpp" and base is not None and base["processes"] == n:
            out.append(row("W10", case, "state MiB", "lower", "limit", base["state_mib"], limit="C++ DDP"))
    return out


def main():
    kind, path = sys.argv[1], sys.argv[2]
    raw = [json.loads(line) for line in open(path) if line.startswith("{")]
    for r in {"training": training, "collectives": collectives, "checkpoint": checkpoint,
              "data_loader": data_loader, "offload": offload, "fsdp": fsdp, "parallel": parallel}[kind](raw):
        print(json.dumps(r))


if __name__ == "__main__":
    main()
