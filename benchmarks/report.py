"""Turns pytest-benchmark JSON from bench_ops_cpu.py into a markdown table: effective
GB/s per provider (median time), the fused op's speed-up over the best unfused route,
and its share of same-run copy bandwidth.

    python benchmarks/report.py .benchmarks/ops_cpu.json
    python benchmarks/report.py .benchmarks/ops_cpu.json --out benchmarks/results   # ops_cpu.md/.json
"""

import argparse
import json
import platform
from collections import defaultdict

from result_files import add_out_arguments, write_results

ROUNDS_NOTE = "15 rounds after 2 warm-up rounds"


def load(path):
    with open(path) as f:
        data = json.load(f)
    rows = [dict(b["extra_info"], median=b["stats"]["median"]) for b in data["benchmarks"]]
    return data["machine_info"], data["datetime"], rows


def table(rows):
    by_case = defaultdict(dict)
    copy_gbps = {}
    for r in rows:
        gbps = r["bytes"] / r["median"] / 1e9
        if r["op"] == "copy":
            copy_gbps[r["size"]] = gbps
        else:
            by_case[(r["op"], r["size"])][r["provider"]] = (r["median"], gbps)
    lines = ["| op | elements | hetcomm ms | hetcomm GB/s | best unfused (ms, GB/s) | speed-up | "
             "% of copy bandwidth |", "|---|---|---|---|---|---|---|"]
    for (op, size), providers in by_case.items():
        fused_time, fused_gbps = providers.pop("hetcomm")
        best_name, (best_time, best_gbps) = min(providers.items(), key=lambda item: item[1][0])
        lines.append(f"| {op} | {size} | {fused_time * 1e3:.2f} | {fused_gbps:.1f} | `{best_name}` "
                     f"({best_time * 1e3:.2f}, {best_gbps:.1f}) | {best_time / fused_time:.2f}x | "
                     f"{100 * fused_gbps / copy_gbps[size]:.0f}% |")
    copies = ", ".join(f"{size}: {gbps:.1f} GB/s" for size, gbps in copy_gbps.items())
    lines.append(f"\nSame-run fp32 copy bandwidth (read + write): {copies}.")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("json_path")
    add_out_arguments(parser)
    args = parser.parse_args()
    machine, when, rows = load(args.json_path)
    first = rows[0]
    cpu = machine.get("cpu", {}).get("brand_raw") or platform.processor() or "unknown CPU"
    text = (f"Measured {when[:10]} on {cpu}, {first['threads']} threads, torch {first['torch']}, "
            f"hetcomm CPU loops: {first['cpu_isa']}; medians of {ROUNDS_NOTE}.\n\n{table(rows)}")
    print(text)
    if args.out:
        with open(args.json_path) as f:
            data = json.load(f)
        write_results(args.out, "ops_cpu", text, data)


if __name__ == "__main__":
    main()
