"""Where the time over the ideal bound goes, per run of bench_hetero_cluster.py or
bench_hetero_bert.py, from their result files' step logs. Each step's time over its
share of the bound (the step's samples over the sum of the ranks' median throughputs
in the run's own regime, before and after the slowdown) is cut into four parts that
add up to it:

  whole samples  the best split into whole samples at those throughputs, over the bound:
                 what no method that gives each sample to one rank can avoid;
  split          the split the ranks ran (after a handoff, what each did), at the same
                 throughputs, over the best whole-sample one: the balancer's own loss;
  noise          the slowest rank's measured compute over what its median throughput
                 gives it: a rank running slower than its median that step;
  overhead       the step beyond the slowest rank's compute: the all-reduce, the update,
                 the balancer's collectives, and the first step's setup (also given apart).

    python benchmarks/loss_breakdown.py benchmarks/results/hetero_bert_b128_cpu.json
    python benchmarks/loss_breakdown.py benchmarks/results/hetero_cluster_cpu.json
"""

import argparse
import json
from pathlib import Path

from bench_hetero_cluster import regimes

from hetcomm.balance import solve_split

BALANCED = ("static", "hetcomm")   # strategies whose split is meant to match the speeds
WARM_UP = 2


def breakdown(steps_log: list[dict], slowdown_step: int | None) -> dict[str, float]:
    """The run's seconds over its own ideal bound, and the four parts, each relative to
    that bound."""
    bound = whole = split = noise = overhead = warm_up = 0.0
    number = 0
    for part, throughputs in regimes(steps_log, slowdown_step):
        for step in part:
            samples = step.get("samples") or step["micro_batch"]
            ideal = sum(step["micro_batch"]) / sum(throughputs)
            best = solve_split(sum(step["micro_batch"]), [(0.0, 1 / s) for s in throughputs]).step_time
            ran = max(b / s for b, s in zip(samples, throughputs))
            slowest = max(step["compute_s"])
            bound += ideal
            whole += best - ideal
            split += ran - best
            noise += slowest - ran
            overhead += step["step_s"] - slowest
            if number < WARM_UP:
                warm_up += step["step_s"] - ideal
            number += 1
    first = steps_log[0]["step_s"] - max(steps_log[0]["compute_s"])
    total = sum(s["step_s"] for s in steps_log)
    return {"over": total / bound - 1, "whole samples": whole / bound, "split": split / bound,
            "noise": noise / bound, "overhead": overhead / bound, "first step's overhead": first / bound,
            "warm-up": warm_up / bound}


def runs_of(path: Path, strategies: tuple[str, ...] = BALANCED) -> list[tuple[str, dict]]:
    """(label, result row) for each run of `strategies` with a step log in a result file;
    a file of several repeats labels each run with its repeat."""
    rows = json.loads(path.read_text())
    return [(path.stem if "repeat" not in r else f"{path.stem} repeat {r['repeat'] + 1}", r) for r in rows
            if "steps" in r and r["strategy"].startswith(strategies)]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="+", type=Path, help="hetero_cluster_*.json or hetero_bert_*.json files")
    args = parser.parse_args()
    parts = ("whole samples", "split", "noise", "overhead")
    print("| run | scenario | strategy | over its own bound | " + " | ".join(parts)
          + f" | of which the first step | the first {WARM_UP} steps, all parts |")
    print("|---|---|---|---|" + "---|" * (len(parts) + 2))
    for path in args.results:
        for label, row in runs_of(path):
            steps = row["steps"]
            slowdown_step = None if row["scenario"] == "steady" else len(steps) // 2
            figures = breakdown(steps, slowdown_step)
            cells = " | ".join(f"{100 * figures[p]:+.1f}%" for p in (*parts, "first step's overhead", "warm-up"))
            print(f"| {label} | {row['scenario']} | {row['strategy']} | {100 * figures['over']:+.1f}% | {cells} |")


if __name__ == "__main__":
    main()
