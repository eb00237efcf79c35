"""What the rebalancer leaves on the table under noise, with no processes: the benchmark
cluster's speeds (bench_hetero_cluster.py: 51 : 51 : 25 : 12 samples per second, 96
samples per step), a first split from one timing with log-normal noise, then steps whose
compute times carry log-normal noise of their own and, with --common, a log-normal
factor every rank shares (a shared machine's load), the first three steps 10% slower for
every rank (warm-up). Per setting, the mean over seeds of
the true step time of the splits in use (each rank's samples over its true speed, the
slowest rank's) over the best split's, minus 1, and the mean number of changes.

    python benchmarks/bench_rebalancer_noise.py               # ~8 minutes on 2 cores
    python benchmarks/bench_rebalancer_noise.py --seeds 10 --steps 40
    python benchmarks/bench_rebalancer_noise.py --out benchmarks/results   # rebalancer_noise_cpu_<date>.md/.json
"""

import argparse
import math
import random
import statistics
import sys

from hetcomm.balance.rebalancer import TRAINING_SETTINGS, Rebalancer
from hetcomm.balance.solver import solve_split
from result_files import add_out_arguments, today, write_results

SPEEDS = [51.0, 51.0, 25.0, 12.0]
GLOBAL_BATCH = 96


def true_step_time(sizes) -> float:
    return max(b / s for b, s in zip(sizes, SPEEDS))


WARM_UP_STEPS, WARM_UP_SLOWDOWN = 3, 1.1


def run(first_noise: float, step_noise: float, steps: int, seed: int, common: float = 0.0) -> tuple[float, int]:
    """(mean true step time over the best one's, minus 1; number of changes) of one run."""
    rng = random.Random(seed)
    timed = [s * math.exp(rng.gauss(0, first_noise)) for s in SPEEDS]
    first = solve_split(GLOBAL_BATCH, [(0.0, 1 / s) for s in timed]).sizes
    rebalancer = Rebalancer(GLOBAL_BATCH, first, **TRAINING_SETTINGS)
    total, changes = true_step_time(first), 0
    for step in range(1, steps):
        shared = math.exp(rng.gauss(0, common)) * (WARM_UP_SLOWDOWN if common and step <= WARM_UP_STEPS else 1.0)
        times = [b / s * shared * math.exp(rng.gauss(0, step_noise)) for b, s in zip(rebalancer.sizes, SPEEDS)]
        changes += rebalancer.observe(times).changed
        total += true_step_time(rebalancer.sizes)
    best = solve_split(GLOBAL_BATCH, [(0.0, 1 / s) for s in SPEEDS]).step_time
    return total / steps / best - 1, changes


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=40)
    parser.add_argument("--steps", type=int, nargs="+", default=[40, 400])
    parser.add_argument("--common", type=float, nargs="+", default=[0.0],
                        help="noise every rank shares, e.g. 0 0.03 0.06 (above 0: with the warm-up steps)")
    add_out_arguments(parser)
    args = parser.parse_args()
    lines = [f"Rebalancer under noise ({' '.join(sys.argv[1:]) or 'defaults'}: {args.seeds} seeds, steps "
             f"{', '.join(map(str, args.steps))}), {today()}, pure simulation (no processes). Cluster "
             f"{':'.join(f'{s:g}' for s in SPEEDS)} samples/s, {GLOBAL_BATCH} per step; common noise > 0 adds "
             f"{WARM_UP_STEPS} warm-up steps {WARM_UP_SLOWDOWN - 1:.0%} slower.\n",
             "| steps | first split's timing noise | step noise | common noise | excess over the best split "
             "| changes |",
             "|---|---|---|---|---|---|"]
    print("\n".join(lines))
    rows = []
    for steps in args.steps:
        for first_noise in (0.05, 0.10):
            for step_noise in (0.02, 0.04, 0.07, 0.10):
                for common in args.common:
                    runs = [run(first_noise, step_noise, steps, seed, common) for seed in range(args.seeds)]
                    excess = statistics.fmean(r[0] for r in runs)
                    changes = statistics.fmean(r[1] for r in runs)
                    rows.append({"steps": steps, "first_noise": first_noise, "step_noise": step_noise,
                                 "common_noise": common, "excess": excess, "changes": changes})
                    lines.append(f"| {steps} | {first_noise:.0%} | {step_noise:.0%} | {common:.0%} | {excess:.2%} | "
                                 f"{changes:.1f} |")
                    print(lines[-1], flush=True)
    if args.out:
        write_results(args.out, "rebalancer_noise", "\n".join(lines), {"seeds": args.seeds, "rows": rows},
                      variant="common" if any(args.common) else None, run=args.run)


if __name__ == "__main__":
    main()
