"""Summarises the JSON lines of bench/training.cpp and bench/training_twin.py: per (workload,
processes), each side's steps/s and samples/s as the median (and mean, min-max) over repetitions,
the C++/PyTorch ratios of those, the per-step times, the per-phase times (median over repetitions
of each run's median and mean) and the last losses of both sides, which should agree since both
draw the same numbers. Usage: summarize_training.py results.jsonl [--json out.json]"""
import json
import statistics
import sys
from collections import defaultdict

PHASES = ["zero_grad", "forward", "backward", "step"]


def main():
    rows = [json.loads(line) for line in open(sys.argv[1]) if line.startswith("{")]
    groups = defaultdict(list)
    for r in rows:
        groups[(r["workload"], r["processes"], r["side"])].append(r)
    table = []
    keys = sorted({(w, n) for (w, n, _) in groups}, key=lambda k: (k[0], -k[1]))
    for workload, n in keys:
        cpp, py = groups.get((workload, n, "cpp"), []), groups.get((workload, n, "python"), [])
        if not cpp or not py:
            continue
        e = {"workload": workload, "processes": n, "repetitions": [len(cpp), len(py)]}
        for metric in ("steps_per_s", "samples_per_s"):
            c, p = [r[metric] for r in cpp], [r[metric] for r in py]
            e[f"cpp_{metric}"], e[f"python_{metric}"] = statistics.median(c), statistics.median(p)
            e[f"cpp_{metric}_mean"], e[f"python_{metric}_mean"] = statistics.mean(c), statistics.mean(p)
            e[f"cpp_{metric}_range"], e[f"python_{metric}_range"] = [min(c), max(c)], [min(p), max(p)]
            e[f"ratio_{metric}"] = e[f"cpp_{metric}"] / e[f"python_{metric}"]
            e[f"ratio_{metric}_mean"] = e[f"cpp_{metric}_mean"] / e[f"python_{metric}_mean"]
        for side, rs in (("cpp", cpp), ("python", py)):
            e[f"{side}_step_median_us"] = statistics.median(r["step_median_us"] for r in rs)
            e[f"{side}_step_mean_us"] = statistics.median(r["step_mean_us"] for r in rs)
            e[f"{side}_phase_us"] = {ph: [statistics.median(r["phase_median_mean_us"][ph][i] for r in rs) for i in (0, 1)]
                                     for ph in PHASES}
            e[f"{side}_last_loss"] = rs[-1]["last_loss"]
        table.append(e)
    for metric, label in (("steps_per_s", "steps/s"), ("samples_per_s", "samples/s")):
        print(f"{label} over repetitions: median (min-max) mean, and the C++/PyTorch ratio of medians and of means")
        print(f"{'workload':<9}{'procs':>5}  {'C++':>34}  {'PyTorch':>34}  {'ratio med':>9}  {'ratio mean':>10}")
        for e in table:
            cells = []
            for side in ("cpp", "python"):
                lo, hi = e[f"{side}_{metric}_range"]
                cells.append(f"{e[f'{side}_{metric}']:.1f} ({lo:.1f}-{hi:.1f}) {e[f'{side}_{metric}_mean']:.1f}")
            print(f"{e['workload']:<9}{e['processes']:>5}  {cells[0]:>34}  {cells[1]:>34}"
                  f"  {e[f'ratio_{metric}']:>9.2f}  {e[f'ratio_{metric}_mean']:>10.2f}")
        print()
    print("time per step and per phase on process 0, us: median over repetitions of each run's median / mean")
    print(f"{'workload':<9}{'procs':>5}  {'side':<7}" + "".join(f"{ph:>20}" for ph in PHASES + ["whole step"])
          + f"  {'last loss':>10}")
    for e in table:
        for side in ("cpp", "python"):
            times = [e[f"{side}_phase_us"][ph] for ph in PHASES] + [[e[f"{side}_step_median_us"], e[f"{side}_step_mean_us"]]]
            cells = "".join(f"{m:>10.1f}/{a:<9.1f}" for m, a in times)
            print(f"{e['workload']:<9}{e['processes']:>5}  {side:<7}{cells}  {e[f'{side}_last_loss']:>10.6f}")
    if "--json" in sys.argv:
        with open(sys.argv[sys.argv.index("--json") + 1], "w") as f:
            json.dump({"rows": table}, f, indent=2)


if __name__ == "__main__":
    main()
