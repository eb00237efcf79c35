"""The shape of the published legacy-GPU study (ANCHORS.md) on a simulated cluster: the
time to train the same number of tokens on 4 CPU workers whose speeds relate as 1, 1,
0.5 and 0.25 (Gloo, one machine; every figure here is from a SIMULATED cluster) with

  (a) an equal split (plain DDP, HetSeq),
  (b) a static split from one quick timing of each rank (FastSpeed-style),
  (c) hetcomm's balancer: the same first split, then rebalancing while training, and a
      rank far behind within a step handing its remaining windows to the others,

each once as is and once with rank 1 slowing to a quarter of its speed half-way (a
card that starts throttling); with the slowdown, (c) also without the handoff, to show
what catching the slow step within itself buys over reacting on the next. The ideal
bound: per step, the global batch over the sum of the ranks' median measured
throughputs (in each regime, before and after the slowdown), with no communication and
no update at all; once from the rebalancing run's throughputs (every rank busy all
step: the one bound the strategies are compared against), and once from each run's
own, since a shared machine's speed drifts between runs minutes apart. Beside it, the
same bound in whole windows: each step at the best integer split of its windows at those
throughputs, the least any method that gives each window to one rank can take.

    python benchmarks/bench_hetero_cluster.py                 # ~5 minutes a repeat on 2 cores
    python benchmarks/bench_hetero_cluster.py --steps 20 --json out.json
    python benchmarks/bench_hetero_cluster.py --repeats 3 --out benchmarks/results   # hetero_cluster_cpu.md/.json
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
from result_files import add_out_arguments, write_results

from hetcomm.balance import solve_split
from hetcomm.train.config import DEFAULT_CPU_SPEEDS
from hetcomm.simulated import CORE_SHARE, speeds_for_this_machine

GLOBAL_BATCH = 96
# Steps of about a second on 2 cores, so that the per-step collectives (~5 ms each with 4 Gloo
# processes on 2 cores) are a few percent of a step.
MODEL = ["--n-layer", "2", "--n-embd", "192", "--n-head", "4", "--block-size", "128", "--global-batch",
         str(GLOBAL_BATCH), "--equal-steps", "0"]
STRATEGIES = {"equal split": ["--balance", "equal"], "static split (one profile)": ["--balance", "static"],
              "hetcomm rebalancing": ["--balance", "dynamic"]}
# With a slowdown only: the rebalancer alone, one step late.
WITHOUT_HANDOFF = {"hetcomm rebalancing, no handoff": ["--balance", "dynamic", "--no-handoff"]}


def simulated_speeds() -> str:
    """The trainer's default relative speeds, scaled down as its default run scales them."""
    return speeds_for_this_machine(DEFAULT_CPU_SPEEDS)


def run(strategy: list[str], steps: int, slowdown: str | None, out: Path) -> dict:
    command = [sys.executable, "-m", "hetcomm", "train", "--speeds", simulated_speeds(), "--steps", str(steps),
               *strategy, "--out", str(out), "--no-progress", *MODEL]
    if slowdown:
        command += ["--slowdown", slowdown]
    subprocess.run(command, check=True, capture_output=True, text=True)
    steps_log = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    return {"steps": steps_log, "summary": json.loads((out / "summary.json").read_text())}


def regimes(steps_log: list[dict], slowdown_step: int | None) -> list[tuple[list[dict], list[float]]]:
    """The log's regimes (before and after the slowdown), each with its steps and every
    rank's median measured throughput over them."""
    parts = [steps_log] if slowdown_step is None else [steps_log[:slowdown_step], steps_log[slowdown_step:]]
    ranks = len(steps_log[0]["micro_batch"])
    return [(part, [statistics.median(s["samples_per_second"][r] for s in part if s["samples_per_second"][r] > 0)
                    for r in range(ranks)]) for part in parts]


def ideal_seconds(steps_log: list[dict], slowdown_step: int | None, whole_windows: bool = False) -> float:
    """Sum over steps of B / sum_i s_i, s_i being rank i's median measured throughput in
    its regime (before and after the slowdown), over all runs' steps given. With
    whole_windows, each step's time is instead that of the best split of B into whole
    windows at those throughputs, min over integer b_i of max_i b_i / s_i: what any
    method that gives each window to one rank can reach at best."""
    total = 0.0
    for part, throughputs in regimes(steps_log, slowdown_step):
        for step in part:
            batch = sum(step["micro_batch"])
            total += solve_split(batch, [(0.0, 1 / s) for s in throughputs]).step_time if whole_windows \
                else batch / sum(throughputs)
    return total


def measure(steps: int, repeat: int, work: Path) -> list[dict]:
    """One repeat: every strategy in both scenarios, and the ideal bounds, as rows."""
    slowdown_step = steps // 2
    rows = []
    for scenario, slowdown in (("steady", None), ("rank 1 slows to 1/4 half-way", f"1:{slowdown_step}:0.25")):
        results = {}
        strategies = {**STRATEGIES, **(WITHOUT_HANDOFF if slowdown else {})}
        for number, (label, strategy) in enumerate(strategies.items()):
            start = time.perf_counter()
            result = run(strategy, steps, slowdown, work / f"{repeat}-{number}-{bool(slowdown)}")
            # The first step's step_s holds its timed parts (--equal-steps 0) and the warm-up before them.
            train_seconds = sum(s["step_s"] for s in result["steps"])
            results[label] = (train_seconds, time.perf_counter() - start, result)
        regime_start = slowdown_step if slowdown else None
        ideal = ideal_seconds(results["hetcomm rebalancing"][2]["steps"], regime_start)
        equal_seconds = results["equal split"][0]
        for label, (seconds, wall, result) in results.items():
            own_ideal = ideal_seconds(result["steps"], regime_start)
            rows.append({"repeat": repeat, "scenario": scenario, "strategy": label, "train_seconds": seconds,
                         "wall_seconds_with_startup": wall, "own_ideal_seconds": own_ideal,
                         "reduction_vs_equal": 1 - seconds / equal_seconds, "over_ideal": seconds / ideal - 1,
                         "over_own_ideal": seconds / own_ideal - 1, "steps": result["steps"]})
        rows.append({"repeat": repeat, "scenario": scenario,
                     "strategy": "ideal bound (median throughputs, no communication)", "train_seconds": ideal,
                     "reduction_vs_equal": 1 - ideal / equal_seconds, "over_ideal": 0.0, "over_own_ideal": None})
        whole = ideal_seconds(results["hetcomm rebalancing"][2]["steps"], regime_start, whole_windows=True)
        rows.append({"repeat": repeat, "scenario": scenario, "strategy": "ideal bound in whole windows (best integer "
                     "split of the same throughputs, no communication)", "train_seconds": whole,
                     "reduction_vs_equal": 1 - whole / equal_seconds, "over_ideal": whole / ideal - 1,
                     "over_own_ideal": None})
    return rows


def table(rows: list[dict]) -> list[str]:
    lines = ["| scenario | strategy | seconds | reduction vs equal split | over the ideal bound | over its own run's "
             "ideal bound |", "|---|---|---|---|---|---|"]
    for r in rows:
        own = f"{100 * r['over_own_ideal']:+.1f}%" if r["over_own_ideal"] is not None else "-"
        lines.append(f"| {r['scenario']} | {r['strategy']} | {r['train_seconds']:.1f} | "
                     f"{100 * r['reduction_vs_equal']:.0f}% | {100 * r['over_ideal']:+.1f}% | {own} |")
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=1, help="run the whole comparison this many times, one "
                        "after another (the result set holds every repeat)")
    parser.add_argument("--json", help="also write the results here, with every run's step log")
    add_out_arguments(parser)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = [row for repeat in range(args.repeats) for row in measure(args.steps, repeat, Path(tmp))]
    tokens = args.steps * GLOBAL_BATCH * 128
    lines = [f"SIMULATED cluster, measured {datetime.now(timezone.utc):%Y-%m-%d} on one {torch.get_num_threads()}-"
             f"thread CPU machine: 4 Gloo workers, speed factors {simulated_speeds()} (relative 1 : 1 : 0.5 : 0.25, "
             f"scaled to keep {CORE_SHARE:.0%} of the cores busy at most), GPT 2x192, {args.steps} steps of "
             f"{GLOBAL_BATCH} windows x 128 tokens ({tokens} tokens), {args.repeats} repeat(s), torch "
             f"{torch.__version__}. Seconds of training (sum of step times; process start-up excluded)."]
    for repeat in range(args.repeats):
        lines += ["", f"## Repeat {repeat + 1}", "", *table([r for r in rows if r["repeat"] == repeat])]
    text = "\n".join(lines)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    if args.out:
        write_results(args.out, "hetero_cluster", text, rows)

if __name__ == "__main__":
    main()
