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
    print(f"{'workload':<9}{'procs':>5}  {'C++ steps/s med (min-max)':>27}  {'PyTorch steps/s med (min-max)':>29}"
          f"  {'ratio med':>9}  {'ratio mean':>10}  {'C++ samples/s':>13}  {'Py samples/s':>12}"
          f"  {'C++ step us med/mean':>20}  {'Py step us med/mean':>19}")
    keys = sorted({(w, n) for (w, n, _) in groups}, key=lambda k: (k[0], -k[1]))
    for workload, n in keys:
        cpp, py = groups.get((workload, n, "cpp"), []), groups.get((workload, n, "python"), [])
        if not cpp or not py:
            continue
        c, p = [r["steps_per_s"] for r in cpp], [r["steps_per_s"] for r in py]
        cs, ps = [r["samples_per_s"] for r in cpp], [r["samples_per_s"] for r in py]
        e = {"workload": workload, "processes": n, "repetitions": [len(c), len(p)],
             "cpp_steps_per_s": statistics.median(c), "python_steps_per_s": statistics.median(p),
             "cpp_steps_per_s_mean": statistics.mean(c), "python_steps_per_s_mean": statistics.mean(p),
             "cpp_samples_per_s": statistics.median(cs), "python_samples_per_s": statistics.median(ps),
             "cpp_samples_per_s_mean": statistics.mean(cs), "python_samples_per_s_mean": statistics.mean(ps),
             "cpp_step_median_us": statistics.median(r["step_median_us"] for r in cpp),
             "python_step_median_us": statistics.median(r["step_median_us"] for r in py),
             "cpp_step_mean_us": statistics.median(r["step_mean_us"] for r in cpp),
             "python_step_mean_us": statistics.median(r["step_mean_us"] for r in py),
             "cpp_last_loss": cpp[-1]["last_loss"], "python_last_loss": py[-1]["last_loss"]}
        e["ratio_steps_per_s"] = e["cpp_steps_per_s"] / e["python_steps_per_s"]
        e["ratio_steps_per_s_mean"] = e["cpp_steps_per_s_mean"] / e["python_steps_per_s_mean"]
        e["ratio_samples_per_s"] = e["cpp_samples_per_s"] / e["python_samples_per_s"]
        e["ratio_samples_per_s_mean"] = e["cpp_samples_per_s_mean"] / e["python_samples_per_s_mean"]
        for side, rs in (("cpp", cpp), ("python", py)):
            e[f"{side}_phase_us"] = {ph: [statistics.median(r["phase_median_mean_us"][ph][i] for r in rs) for i in (0, 1)]
                                     for ph in PHASES}
        table.append(e)
        print(f"{workload:<9}{n:>5}  {e['cpp_steps_per_s']:>10.1f} ({min(c):.1f}-{max(c):.1f})"
              f"  {e['python_steps_per_s']:>12.1f} ({min(p):.1f}-{max(p):.1f})"
              f"  {e['ratio_steps_per_s']:>9.2f}  {e['ratio_steps_per_s_mean']:>10.2f}"
              f"  {e['cpp_samples_per_s']:>13.0f}  {e['python_samples_per_s']:>12.0f}"
              f"  {e['cpp_step_median_us']:>9.0f}/{e['cpp_step_mean_us']:<10.0f}"
              f"  {e['python_step_median_us']:>8.0f}/{e['python_step_mean_us']:<10.0f}")
    print("\nper-phase time on process 0, us (median over repetitions of each run's median / mean)")
    print(f"{'workload':<9}{'procs':>5}  {'side':<7}" + "".join(f"{ph:>20}" for ph in PHASES) + f"  {'last loss':>10}")
    for e in table:
        for side in ("cpp", "python"):
            cells = "".join(f"{m:>10.1f}/{a:<9.1f}" for m, a in (e[f"{side}_phase_us"][ph] for ph in PHASES))
            print(f"{e['workload']:<9}{e['processes']:>5}  {side:<7}{cells}  {e[f'{side}_last_loss']:>10.6f}")
    if "--json" in sys.argv:
        with open(sys.argv[sys.argv.index("--json") + 1], "w") as f:
            json.dump({"rows": table}, f, indent=2)


if __name__ == "__main__":
    main()
