"""Replays the step times that bench_hetero_cluster.py and bench_hetero_bert.py logged
through the working tree's rebalancer, and with --baseline through a git revision's: a
check of a rebalancer change in seconds, on the noise the benchmark machine really had,
where one benchmark run takes ten minutes and brings noise of its own.

Each dynamic run is replayed from the split of its second step (the loop chooses it from
the first step's timed parts, whose times its rebalancer leaves out, and has it reviewed
at the third measurement). At every later
step each rank's logged seconds per sample (its compute over the samples it did), times
the samples the replayed split gives it, is fed in as that rank's compute time. A split
is judged at its regime's median throughputs, as loss_breakdown.py's "split" part is: its
step time over that of the best split into whole samples, summed over the run's steps,
so the noise of a step, the same for every rebalancer replayed, does not count.

What a replay cannot know: a rank's per-sample time at a size it did not run (the logged
one is taken for any size), and the handoff (its steps are replayed at the split as
dealt). So it compares rebalancers; the run's own figure is given beside it ("as run",
the split each rank ran) to show how far the replay of the code that ran strays from it.

    python benchmarks/replay_rebalancer.py benchmarks/results/hetero_cluster_cpu.json
    python benchmarks/replay_rebalancer.py --baseline HEAD~3 benchmarks/results/hetero_bert_*.json
    python benchmarks/replay_rebalancer.py --baseline 5ac87f1 --out benchmarks/results --variant noisefloor \\
        benchmarks/results/equal_ranks_cpu.json benchmarks/results/hetero_*.json
"""

import argparse
import inspect
import statistics
import tempfile
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

from bench_hetero_cluster import regimes
from bench_rebalancer_noise import rebalancer_at
from loss_breakdown import runs_of
from result_files import add_out_arguments, write_results

import hetcomm.balance.rebalancer as tree_rebalancer
from hetcomm.balance import solve_split

DYNAMIC = ("hetcomm",)   # the strategies whose split the rebalancer chose


def split_loss(steps_log: list[dict], slowdown_step: int | None, splits: Sequence[Sequence[int]]) -> float:
    """The steps' time at `splits` (one per step) over that at the best whole-sample
    splits, both at each regime's median throughputs, less 1."""
    ran = best = 0.0
    index = 0
    for part, throughputs in regimes(steps_log, slowdown_step):
        rates = [(0.0, 1 / s) for s in throughputs]
        best_at = {}   # the best whole split's time per step size, solved once per regime
        for step in part:
            batch = sum(step["micro_batch"])
            if batch not in best_at:
                best_at[batch] = solve_split(batch, rates).step_time
            ran += max(b / s for b, s in zip(splits[index], throughputs))
            best += best_at[batch]
            index += 1
    return ran / best - 1


def replay(module: ModuleType, steps_log: list[dict]) -> tuple[list[tuple[int, ...]], int]:
    """The split `module`'s Rebalancer (with its training settings) gives each step,
    fed the logged per-sample times at its own splits, and how many changes it made."""
    if len(steps_log) < 2:   # the first step's split is the loop's, before any rebalancing
        return [tuple(steps_log[0]["micro_batch"])], 0
    ranks = len(steps_log[0]["micro_batch"])
    batch = sum(steps_log[1]["micro_batch"])
    # The runs dealt their first split from the first step's timing, which BalancedLoop has its
    # rebalancer review (a revision from before the review has no such option).
    review = {"review_first": True} if "review_first" in inspect.signature(module.Rebalancer).parameters else {}
    rebalancer = module.Rebalancer(batch, tuple(steps_log[1]["micro_batch"]), **module.TRAINING_SETTINGS, **review)
    splits, changes = [tuple(steps_log[0]["micro_batch"])], 0
    # A rank that did no sample in a step (a giver of its whole share) has no time of its own
    # that step: it is measured at its run's median rate.
    medians = [statistics.median(s["compute_s"][r] / s["samples"][r] for s in steps_log if s["samples"][r] > 0)
               for r in range(ranks)]
    for step in steps_log[1:]:
        sizes = rebalancer.sizes
        splits.append(sizes)
        rates = [c / n if n > 0 else m for c, n, m in zip(step["compute_s"], step["samples"], medians)]
        changes += rebalancer.observe([b * r for b, r in zip(sizes, rates)]).changed
    return splits, changes


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="+", type=Path,
                        help="hetero_cluster_*.json, hetero_bert_*.json or equal_ranks_*.json files")
    parser.add_argument("--baseline", metavar="REVISION",
                        help="also replay the rebalancer of this git revision (e.g. HEAD, main~2)")
    add_out_arguments(parser)
    parser.add_argument("--variant", default="", help="with --out: the result set's variant (its name's part)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        modules = {"this tree": tree_rebalancer}
        if args.baseline:
            modules[args.baseline] = rebalancer_at(args.baseline, Path(folder))
        names = " | ".join(f"{name}: split loss | changes" for name in modules)
        lines = [f"| run | scenario | strategy | as run | {names} |", "|---|---|---|---|" + "---|---|" * len(modules)]
        totals = {name: [] for name in modules}
        for path in args.results:
            mine = {name: ([], []) for name in modules}
            for label, row in runs_of(path, DYNAMIC):
                steps = row["steps"]
                slowdown_step = None if row["scenario"] == "steady" else len(steps) // 2
                as_run = split_loss(steps, slowdown_step, [s["samples"] for s in steps])
                cells = []
                for name, module in modules.items():
                    splits, changes = replay(module, steps)
                    loss = split_loss(steps, slowdown_step, splits)
                    totals[name].append(loss)
                    mine[name][0].append(loss)
                    mine[name][1].append(changes)
                    cells.append(f"{100 * loss:.2f}% | {changes}")
                lines.append(f"| {label} | {row['scenario']} | {row['strategy']} | {100 * as_run:.2f}% | "
                             + " | ".join(cells) + " |")
            means = " | ".join(f"{100 * statistics.fmean(losses):.2f}% | {statistics.fmean(changes):.1f}"
                               for losses, changes in mine.values())
            lines.append(f"| **mean of {path.stem}'s {len(next(iter(mine.values()))[0])} runs** | | | | {means} |")
        means = " | ".join(f"{100 * statistics.fmean(losses):.2f}% | " for losses in totals.values())
        lines.append(f"| mean of {len(next(iter(totals.values())))} runs | | | | {means}|")
    text = "\n".join(lines)
    print(text)
    if args.out:
        command = " ".join(["python benchmarks/replay_rebalancer.py"] + (["--baseline", args.baseline] if args.baseline
                                                                          else []) + [str(p) for p in args.results])
        write_results(args.out, "replay_rebalancer", f"The logged step times replayed through the rebalancer "
                      f"(`{command}`): each run's split loss, its steps' time at the replayed splits over that at "
                      f"the best whole-sample splits (both at the run's median throughputs), less 1, and the "
                      f"number of split changes.\n\n{text}", variant=args.variant or None)


if __name__ == "__main__":
    main()
