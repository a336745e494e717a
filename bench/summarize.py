"""Summarises benchmark JSON lines: per (op, bytes), the median over repetitions of each side's
median time and bus bandwidth, min-max, the C++/Python ratio, and the fraction of memory-copy
bandwidth. Usage: summarize.py results.jsonl [--json out.json]"""
import json
import statistics
import sys
from collections import defaultdict


def main():
    rows = [json.loads(line) for line in open(sys.argv[1]) if line.startswith("{")]
    groups = defaultdict(list)
    for r in rows:
        groups[(r["op"], r["bytes"], r["side"])].append(r)
    memcpy = {b: statistics.median(r["busbw_gbps"] for r in rs)
              for (op, b, side), rs in groups.items() if op == "memcpy"}
    table = []
    print(f"{'op':<10}{'size':>10}  {'C++ GB/s (min-max)':>24}  {'PyTorch GB/s (min-max)':>24}  {'C++/Py':>7}  {'C++/memcpy':>10}  {'C++ med us':>10}  {'Py med us':>10}")
    for (op, size) in sorted({(op, b) for (op, b, _) in groups if op != "memcpy"}):
        cpp, py = groups.get((op, size, "cpp"), []), groups.get((op, size, "python"), [])
        if not cpp or not py:
            continue
        c = [r["busbw_gbps"] for r in cpp]
        p = [r["busbw_gbps"] for r in py]
        entry = {"op": op, "bytes": size, "cpp_busbw_gbps": statistics.median(c), "python_busbw_gbps": statistics.median(p),
                 "cpp_median_us": statistics.median(r["median_us"] for r in cpp),
                 "python_median_us": statistics.median(r["median_us"] for r in py),
                 "cpp_mean_us": statistics.median(r["mean_us"] for r in cpp),
                 "python_mean_us": statistics.median(r["mean_us"] for r in py)}
        entry["ratio"] = entry["cpp_busbw_gbps"] / entry["python_busbw_gbps"]
        entry["fraction_of_memcpy"] = entry["cpp_busbw_gbps"] / memcpy[size] if size in memcpy else None
        table.append(entry)
        size_txt = f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"
        print(f"{op:<10}{size_txt:>10}  {entry['cpp_busbw_gbps']:>8.3f} ({min(c):.3f}-{max(c):.3f})  "
              f"{entry['python_busbw_gbps']:>8.3f} ({min(p):.3f}-{max(p):.3f})  {entry['ratio']:>7.2f}  "
              f"{(entry['fraction_of_memcpy'] or 0):>10.3f}  {entry['cpp_median_us']:>10.1f}  {entry['python_median_us']:>10.1f}")
    if "--json" in sys.argv:
        with open(sys.argv[sys.argv.index("--json") + 1], "w") as f:
            json.dump({"rows": table, "memcpy_gbps": memcpy}, f, indent=2)


if __name__ == "__main__":
    main()
