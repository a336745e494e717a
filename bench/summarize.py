"""Summarises benchmark rows into one table: per (workload, case, metric), each side's median and
min-max over the repetitions, every side's ratio to the PyTorch twin and to the physical limit,
the targets and whether they were met, and the final losses that show both sides did the same work.

Input: JSON lines, one sample per line (one repetition of one side), in this schema:

    {"workload": "W1",                  # workload id (W1..W8)
     "case": "mlp, 2 processes",        # what was measured; one row per (workload, case, metric)
     "metric": "samples/s",             # unit of `value`
     "better": "higher",                # or "lower" (times)
     "side": "cpp",                     # "cpp", "python" (the twin, the reference of the ratios),
                                        # any other program side ("cpp-mpi", ...), or "limit"
     "value": 4123.4,                   # the measurement of this repetition
     "limit": "memcpy",                 # side "limit" only: what the physical limit is
     "loss": 2.3012,                    # optional: the final loss of this run
     "targets": [{"side": "cpp", "vs": "python", "op": ">=", "ratio": 1.1}],
                                        # optional (any sample of the row): side/vs must satisfy op ratio
     "detail": {...}}                   # optional, free-form (e.g. per-phase times), kept in the JSON

Lines that are not JSON objects are ignored. A runner adds a workload by appending such lines to
the file bench/run passes in BENCH_ROWS (see bench/README.md).

Output JSON ({"rows": [...]}), one object per row:

    {"workload", "case", "metric", "better",
     "sides": {"cpp": {"median", "min", "max", "n", "loss", "detail"}, "python": {...},
               "limit": {..., "name": "memcpy"}},
     "ratios": {"cpp/python": 1.21, "cpp/limit": 0.8},   # ratios of medians
     "targets": [{"side", "vs", "op", "ratio", "measured", "met"}]}

Usage: summarize.py rows.jsonl [more.jsonl ...] [--json out.json] [--title text]
"""
import json
import statistics
import sys
from collections import OrderedDict

SIDE_ORDER = {"cpp": 0, "python": 1, "limit": 3}


def load(paths):
    samples = []
    for path in paths:
        with open(path) as f:
            for line in f:
                line = line.strip()
                if line.startswith("{"):
                    samples.append(json.loads(line))
    return samples


def summarise(samples):
    rows = OrderedDict()
    for s in samples:
        key = (s["workload"], s["case"], s["metric"])
        row = rows.setdefault(key, {"workload": s["workload"], "case": s["case"], "metric": s["metric"],
                                    "better": s.get("better", "higher"), "values": {}, "samples": {}, "targets": []})
        row["values"].setdefault(s["side"], []).append(s["value"])
        row["samples"].setdefault(s["side"], []).append(s)
        for t in s.get("targets") or []:  # each side's samples may carry their own targets
            if t not in row["targets"]:
                row["targets"].append(t)
    out = []
    # Workloads in id order; within one, rows in the order the runner wrote them.
    for row in sorted(rows.values(), key=lambda r: r["workload"]):
        sides = {}
        for side, values in sorted(row["values"].items(), key=lambda kv: (SIDE_ORDER.get(kv[0], 2), kv[0])):
            entry = {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}
            losses = [s["loss"] for s in row["samples"][side] if s.get("loss") is not None]
            if losses:
                entry["loss"] = losses[-1]
            # The detail (e.g. per-phase times) of the repetition whose value is the median.
            with_detail = sorted((s for s in row["samples"][side] if s.get("detail") is not None), key=lambda s: s["value"])
            if with_detail:
                entry["detail"] = with_detail[len(with_detail) // 2]["detail"]
            if side == "limit":
                entry["name"] = row["samples"][side][0].get("limit", "limit")
            sides[side] = entry
        ratios = {}
        for side in sides:
            if side in ("python", "limit"):
                continue
            for ref in ("python", "limit"):
                if ref in sides and sides[ref]["median"]:
                    ratios[f"{side}/{ref}"] = sides[side]["median"] / sides[ref]["median"]
        targets = []
        for t in row["targets"]:
            measured = ratios.get(f"{t['side']}/{t['vs']}")
            met = None if measured is None else (measured >= t["ratio"] if t["op"] == ">=" else measured <= t["ratio"])
            targets.append(dict(t, measured=measured, met=met))
        out.append({"workload": row["workload"], "case": row["case"], "metric": row["metric"], "better": row["better"],
                    "sides": sides, "ratios": ratios, "targets": targets})
    return out


def fmt(x):
    if x is None:
        return "-"
    a = abs(x)
    return f"{x:.0f}" if a >= 1000 else f"{x:.1f}" if a >= 10 else f"{x:.2f}" if a >= 1 else f"{x:.3f}"


def cell(entry):
    if entry is None:
        return "-"
    return f"{fmt(entry['median'])} ({fmt(entry['min'])}-{fmt(entry['max'])})"


def print_table(rows, title=None):
    if title:
        print(title)
    head = (f"{'W':<3} {'case':<40} {'metric':<12} {'side':<8} {'side: median (min-max)':>26} "
            f"{'PyTorch: median (min-max)':>27} {'ratio':>6}  {'limit: median':>22} {'/limit':>6}  "
            f"{'target':<16} {'met':<4} {'final loss side / PyTorch':<24}")
    print(head)
    print("-" * len(head))
    for row in rows:
        sides = row["sides"]
        shown = [s for s in sides if s not in ("python", "limit")] or ["python"]
        for side in shown:
            entry = sides.get(side)
            py = sides.get("python")
            limit = sides.get("limit")
            ratio = row["ratios"].get(f"{side}/python")
            frac = row["ratios"].get(f"{side}/limit")
            targets = [t for t in row["targets"] if t["side"] == side]
            target_txt = ", ".join(f"{'/lim' if t['vs'] == 'limit' else '/py'}{t['op']}{t['ratio']:g}" for t in targets) or "-"
            met = [t["met"] for t in targets if t["met"] is not None]
            met_txt = "-" if not met else ("yes" if all(met) else "NO")
            limit_txt = f"{fmt(limit['median'])} {limit['name']}"[:22] if limit else "-"
            loss_txt = "-"
            if entry and "loss" in entry:
                loss_txt = f"{entry['loss']:.5f} / {py['loss']:.5f}" if py and "loss" in py else f"{entry['loss']:.5f}"
            print(f"{row['workload']:<3} {row['case'][:40]:<40} {row['metric'][:12]:<12} {side:<8} {cell(entry):>26} "
                  f"{cell(py):>27} {fmt(ratio):>6}  {limit_txt:>22} {fmt(frac):>6}  {target_txt:<16} {met_txt:<4} {loss_txt:<24}")
    phases = [r for r in rows if any("detail" in e and "phases_us" in e["detail"] for e in r["sides"].values())]
    if phases:
        print()
        print("time per step by phase on process 0, us: median / mean of the median repetition")
        for row in phases:
            for side, e in row["sides"].items():
                if "detail" not in e or "phases_us" not in e["detail"]:
                    continue
                cells = "  ".join(f"{name} {m:.0f}/{a:.0f}" for name, (m, a) in e["detail"]["phases_us"].items())
                local = e["detail"].get("step_without_communication_median_us")
                if local is not None:  # what synchronising adds: the step against the same step in no_sync
                    step = e["detail"]["step_median_us"]
                    cells += f"  | step {step:.0f} = without communication {local:.0f} + synchronising {step - local:.0f}"
                print(f"  {row['workload']:<3} {row['case'][:40]:<40} {side:<7} {cells}")


def main():
    args = sys.argv[1:]
    json_path = title = None
    if "--json" in args:
        i = args.index("--json")
        json_path = args[i + 1]
        del args[i:i + 2]
    if "--title" in args:
        i = args.index("--title")
        title = args[i + 1]
        del args[i:i + 2]
    rows = summarise(load(args))
    print_table(rows, title)
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
