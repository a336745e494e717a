#!/usr/bin/env python3
"""W13's table from bench/run_multihost's raw rows, and the alpha-beta model (--predict).

  multihost_table.py RAW.jsonl [RAW.jsonl ...] [--predict]

Per link rate and row (mode, compression hook, side): seconds a step, samples/s, MB a machine
sends per step as the library counted it and as the machine's interfaces carried it (the link and
loopback together, their ratio to the count),
the wire time (the link's bytes / the measured rate), compute alone (the `compute` row of the same
side and rate: DDP's steps under no_sync), the step against its limit max(compute, wire), the
overlapped fraction f = (compute + wire - step) / min(compute, wire) (1: the shorter one hidden
entirely, 0: none of it, below 0: the step lost more than the two add up to), the processor
seconds all processes used per step, and how busy the computer's processors were over the timed
steps (the test bed's machines share them: near 1, the processors and not the link set the step),
C++ / twin, and the peak memory of process 0.

--predict: the step model t(M) = compute + wire(M) - f * min(compute, wire(M)) with
wire(M) = collectives * 2 (M - 1) * alpha + bytes(2) * 2 (M - 1) / M / beta (ring collectives:
every process sends (M - 1) / M of what it did at 2 machines, times 2), alpha half the measured
round trip, beta the measured rate, compute and f from the 2-machine rows (one process a machine).
It prints predictions for 2 to 64 machines and, for each row measured at another machine count,
predicted / measured, also with compute alone as measured at that count (the test bed's machines
share one computer's cores, so there it grows with the machines).
"""
import collections
import json
import sys


def load(paths):
    rows = []
    for path in paths:
        with open(path) as f:
            rows += [json.loads(line) for line in f if line.startswith("{")]
    return rows


def name(r):
    hook = r.get("comm_hook", "no")
    return r["mode"] + ("" if hook == "no" else ":" + hook)


def wire_s(r):
    return r["link_tx_per_step"] * 8 / (r["measured_mbit"] * 1e6)


def table(rows):
    groups = collections.defaultdict(dict)
    for r in rows:
        groups[(r["hosts"], r["per_host"], r["rate_mbit"])][(name(r), r["side"])] = r
    for (hosts, per_host, rate), g in sorted(groups.items()):
        any_row = next(iter(g.values()))
        print(f"\n## {hosts} machines x {per_host} processes, link {rate:.0f} Mbit/s "
              f"(measured {any_row['measured_mbit']:.0f}, round trip {any_row['round_trip_us']:.0f} us)")
        print("| row | side | step s | samples/s | counted MB/step | link MB/step | counted/sent | wire s | "
              "compute s | step/limit | overlapped f | CPU s | busy | C++/twin | peak MiB | loss |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for (row, side), r in sorted(g.items()):
            compute = g.get(("compute", side))
            wire = wire_s(r)
            c = compute["step_s"] if compute else float("nan")
            limit = max(c, wire)
            f = (c + wire - r["step_s"]) / min(c, wire) if row != "compute" and min(c, wire) > 0 else float("nan")
            twin = g.get((row, "twin"))
            ratio = f"{twin['step_s'] / r['step_s']:.2f}" if side == "cpp" and twin else ""
            counted = r["counted_machine_sent_per_step"] / 1e6 if side == "cpp" else float("nan")
            link = r["link_tx_per_step"] / 1e6
            sent = link + r["loopback_tx_per_step"] / 1e6
            print(f"| {row} | {side} | {r['step_s']:.3f} | {r['samples_per_s']:.1f} | {counted:.1f} | {link:.1f} | "
                  f"{counted / sent if sent > 0 else float('nan'):.3f} | {wire:.3f} | {c:.3f} | "
                  f"{r['step_s'] / limit if row != 'compute' else float('nan'):.2f} | "
                  f"{max(-1.0, min(1.0, f)):.2f} | {r.get('cpu_s_per_step', float('nan')):.2f} | "
                  f"{r.get('processors_busy', float('nan')):.2f} | {ratio} | {r['peak_mib']:.0f} | "
                  f"{r['last_loss']:.5f} |")


def predict(rows):
    rates = sorted({r["rate_mbit"] for r in rows if r["hosts"] == 2 and r["per_host"] == 1 and r["side"] == "cpp"})
    if not rates:
        print("\n--predict needs the 2 x 1 rows (run_multihost --hosts 2 --per_host 1), compute among them")
    for rate in rates:
        predict_at(rate, [r for r in rows if r["rate_mbit"] == rate])


def predict_at(rate, rows):
    base = {name(r): r for r in rows if r["hosts"] == 2 and r["per_host"] == 1 and r["side"] == "cpp"}
    if "compute" not in base:
        print(f"\n--predict at {rate:.0f} Mbit/s: no compute row of 2 x 1")
        return
    compute = base["compute"]["step_s"]

    def model(r, machines, compute_there=None):
        # compute_there: compute alone as measured at that machine count (the test bed's machines
        # share one computer's cores, so it grows with them; real machines keep their own).
        alpha = r["round_trip_us"] / 2 * 1e-6
        beta = r["measured_mbit"] * 1e6 / 8
        wire2 = wire_s(r)
        f = (compute + wire2 - r["step_s"]) / min(compute, wire2)
        f = max(-1.0, min(1.0, f))
        scale = 2 * (machines - 1) / machines
        wire = r["collectives_per_step"] * 2 * (machines - 1) * alpha + r["link_tx_per_step"] * scale / beta
        c = compute if compute_there is None else compute_there
        return c + wire - f * min(c, wire), wire, f

    print(f"\n## The alpha-beta model at {rate:.0f} Mbit/s (calibrated on 2 machines x 1 process)")
    counts = [2, 4, 8, 16, 32, 64]
    print("| row | f | " + " | ".join(f"{m} machines s" for m in counts) + " |")
    print("|---|---|" + "---|" * len(counts))
    for row, r in sorted(base.items()):
        if row == "compute":
            continue
        cells = [model(r, m)[0] for m in counts]
        print(f"| {row} | {model(r, 2)[2]:.2f} | " + " | ".join(f"{t:.2f}" for t in cells) + " |")
    checked = [r for r in rows if r["hosts"] != 2 and r["per_host"] == 1 and r["side"] == "cpp" and name(r) in base
               and name(r) != "compute"]
    if checked:
        there = {r["hosts"]: r["step_s"] for r in rows
                 if r["per_host"] == 1 and r["side"] == "cpp" and name(r) == "compute"}
        print("\n| row | machines | predicted s | measured s | predicted / measured | compute there s | "
              "predicted with it s | / measured |")
        print("|---|---|---|---|---|---|---|---|")
        for r in checked:
            t = model(base[name(r)], r["hosts"])[0]
            cells = f"| {name(r)} | {r['hosts']} | {t:.2f} | {r['step_s']:.2f} | {t / r['step_s']:.2f} |"
            if r["hosts"] in there:
                t2 = model(base[name(r)], r["hosts"], there[r["hosts"]])[0]
                cells += f" {there[r['hosts']]:.2f} | {t2:.2f} | {t2 / r['step_s']:.2f} |"
            else:
                cells += " | | |"
            print(cells)


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--predict"]
    if not args:
        sys.exit(__doc__)
    rows = load(args)
    table(rows)
    if "--predict" in sys.argv:
        predict(rows)
