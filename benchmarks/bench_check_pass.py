"""What the handoff's check costs a rank: its share as one forward/backward pass against
a check of a quarter of it and then the rest (two passes, as `--balance dynamic` runs a
share under its memory cap), in CPU time of one thread, on the GPT of
bench_hetero_cluster.py (2x192, 128-token windows). The best of several repeats, after
warm-up, with freed memory kept mapped as the trainer's CPU workers keep it.

    python benchmarks/bench_check_pass.py
    python benchmarks/bench_check_pass.py --shares 8,12,36 --json out.json
    python benchmarks/bench_check_pass.py --out benchmarks/results     # check_pass_cpu_<date>.md/.json
"""

import argparse
import json
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from hetcomm.balance.handoff import check_size
from hetcomm.loop.host_memory import keep_freed_memory
from hetcomm.train.model import GPT, GPTConfig
from result_files import add_out_arguments, write_results

REPEATS = 7


def passes_seconds(model: GPT, windows: torch.Tensor, cuts: list[int]) -> float:
    """CPU seconds of forward and backward over `windows` cut into passes at `cuts`."""
    start = time.thread_time()
    bounds = [0, *cuts, len(windows)]
    for lo, hi in zip(bounds, bounds[1:]):
        _, loss = model(windows[lo:hi], windows[lo:hi], reduction="sum")
        loss.backward()
    return time.thread_time() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shares", default="4,8,12,17,24,36,49", help="windows per rank to measure")
    parser.add_argument("--json", help="also write the rows here")
    add_out_arguments(parser)
    args = parser.parse_args()
    keep_freed_memory()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, block_size=128, n_layer=2, n_head=4, n_embd=192))
    rows = []
    for share in (int(s) for s in args.shares.split(",")):
        windows = torch.randint(0, 256, (share, 128))
        check = check_size(share)
        for _ in range(2):
            passes_seconds(model, windows, [])
            passes_seconds(model, windows, [check])
        one = min(passes_seconds(model, windows, []) for _ in range(REPEATS))
        two = min(passes_seconds(model, windows, [check]) for _ in range(REPEATS))
        rows.append({"share": share, "check": check, "one_pass_s": one, "check_and_rest_s": two,
                     "extra": two / one - 1})
    lines = [f"Measured {datetime.now(timezone.utc):%Y-%m-%d}, one CPU thread, torch {torch.__version__}: CPU "
             f"seconds of one rank's share, best of {REPEATS}.\n",
             "| windows | check | one pass, ms | check + rest, ms | the check's cost |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['share']} | {r['check']} | {1e3 * r['one_pass_s']:.1f} | "
                     f"{1e3 * r['check_and_rest_s']:.1f} | {100 * r['extra']:+.1f}% |")
    print("\n".join(lines))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    if args.out:
        write_results(args.out, "check_pass", "\n".join(lines), rows, run=args.run)


if __name__ == "__main__":
    main()
