"""What the rebalancer leaves on the table under noise, with no processes: the benchmark
cluster's speeds (bench_hetero_cluster.py: 51 : 51 : 25 : 12 samples per second, 96
samples per step), a first split from one timing with log-normal noise, then steps whose
compute times carry log-normal noise of their own and, with --common, a log-normal
factor every rank shares (a shared machine's load), the first three steps 10% slower for
every rank (warm-up). With --rank-warm-up, each rank's time in those three steps also
carries log-normal noise of its own of that size (warm-up the ranks do not share alike:
allocation at new sizes). With --throttle G, rank 1 slows to a quarter half-way and each
other rank then runs faster by its own factor drawn from 1 to 1 + G (on a shared host the
throttled rank leaves them its cores, unevenly; on GPUs larger micro-batches run faster
per sample); G = -1 for no throttle. Per setting, the mean over seeds and steps of the
true step time of the splits in use (each rank's samples over its true speed, the
slowest rank's) over the best split's at that step's speeds, minus 1, and the mean
number of changes. With --baseline REV the rebalancer of git revision REV runs the same
seeds and draws beside the current one.

    python benchmarks/bench_rebalancer_noise.py               # ~8 minutes on 2 cores
    python benchmarks/bench_rebalancer_noise.py --seeds 10 --steps 40
    python benchmarks/bench_rebalancer_noise.py --out benchmarks/results   # rebalancer_noise_cpu.md/.json
    python benchmarks/bench_rebalancer_noise.py --steps 40 --common 0.03 --rank-warm-up 0 0.08 --baseline 6cfccb0
    python benchmarks/bench_rebalancer_noise.py --steps 40 --common 0.03 --throttle 0.05 --baseline HEAD
"""

import argparse
import importlib.util
import math
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType

import hetcomm.balance.rebalancer as current
from hetcomm.balance.solver import solve_split
from result_files import add_out_arguments, today, write_results

SPEEDS = [51.0, 51.0, 25.0, 12.0]
GLOBAL_BATCH = 96
REBALANCER_PATH = "hetcomm/balance/rebalancer.py"


def true_step_time(sizes, speeds) -> float:
    return max(b / s for b, s in zip(sizes, speeds))


def best_step_time(speeds) -> float:
    return solve_split(GLOBAL_BATCH, [(0.0, 1 / s) for s in speeds]).step_time


WARM_UP_STEPS, WARM_UP_SLOWDOWN = 3, 1.1
THROTTLED_RANK, THROTTLE = 1, 0.25
NO_THROTTLE = -1.0


def run(module: ModuleType, first_noise: float, step_noise: float, steps: int, seed: int, common: float = 0.0,
        rank_warm_up: float = 0.0, throttle: float = NO_THROTTLE) -> tuple[float, int]:
    """(mean true step time over the best one's, minus 1; number of changes) of one run of
    `module`'s Rebalancer. The draws depend on the seed alone, whatever the rebalancer does."""
    rng = random.Random(seed)
    timed = [s * math.exp(rng.gauss(0, first_noise)) for s in SPEEDS]
    first = solve_split(GLOBAL_BATCH, [(0.0, 1 / s) for s in timed]).sizes
    rebalancer = module.Rebalancer(GLOBAL_BATCH, first, **module.TRAINING_SETTINGS)
    speeds = list(SPEEDS)
    best = best_step_time(speeds)
    excess, changes = true_step_time(first, speeds) / best - 1, 0
    for step in range(1, steps):
        if throttle != NO_THROTTLE and step == steps // 2:
            speeds = [s * (THROTTLE if i == THROTTLED_RANK else 1 + rng.uniform(0, throttle))
                      for i, s in enumerate(speeds)]
            best = best_step_time(speeds)
        warm_up = step <= WARM_UP_STEPS
        shared = math.exp(rng.gauss(0, common)) * (WARM_UP_SLOWDOWN if common and warm_up else 1.0)
        own = [math.exp(rng.gauss(0, step_noise) + (rng.gauss(0, rank_warm_up) if warm_up and rank_warm_up else 0.0))
               for _ in SPEEDS]
        times = [b / s * shared * o for b, s, o in zip(rebalancer.sizes, speeds, own)]
        changes += rebalancer.observe(times).changed
        excess += true_step_time(rebalancer.sizes, speeds) / best - 1
    return excess / steps, changes


def rebalancer_at(revision: str, folder: Path) -> ModuleType:
    """The rebalancer module as it was at a git revision (its imports resolve to today's
    package, which is what the rebalancer builds on: the solver)."""
    root = Path(__file__).resolve().parent.parent
    source = subprocess.run(["git", "show", f"{revision}:{REBALANCER_PATH}"], cwd=root, check=True,
                            capture_output=True, text=True).stdout
    path = folder / "baseline_rebalancer.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("baseline_rebalancer", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def settings(args) -> list[tuple[int, float, float, float, float, float]]:
    return [(steps, first, step, common, warm, throttle) for steps in args.steps for first in (0.05, 0.10)
            for step in (0.02, 0.04, 0.07, 0.10) for common in args.common for warm in args.rank_warm_up
            for throttle in args.throttle]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=40)
    parser.add_argument("--steps", type=int, nargs="+", default=[40, 400])
    parser.add_argument("--common", type=float, nargs="+", default=[0.0],
                        help="noise every rank shares, e.g. 0 0.03 0.06 (above 0: with the warm-up steps)")
    parser.add_argument("--rank-warm-up", type=float, nargs="+", default=[0.0],
                        help="each rank's own noise in the three warm-up steps, e.g. 0 0.08")
    parser.add_argument("--throttle", type=float, nargs="+", default=[NO_THROTTLE], metavar="G",
                        help="rank 1 slows to 1/4 half-way and the others speed up by up to G, e.g. 0 0.05 "
                             "(-1: no throttle)")
    parser.add_argument("--baseline", metavar="REV", help="also run the rebalancer of this git revision, side by side")
    add_out_arguments(parser)
    args = parser.parse_args()
    if any(g < 0 and g != NO_THROTTLE for g in args.throttle):
        parser.error(f"--throttle {' '.join(map(str, args.throttle))}: each G must be a speed-up of 0 or more, "
                     f"or {NO_THROTTLE:g} for no throttle")
    beside = f" | excess at {args.baseline} | changes at {args.baseline}" if args.baseline else ""
    lines = [f"Rebalancer under noise ({' '.join(sys.argv[1:]) or 'defaults'}: {args.seeds} seeds, steps "
             f"{', '.join(map(str, args.steps))}), {today()}, pure simulation (no processes). Cluster "
             f"{':'.join(f'{s:g}' for s in SPEEDS)} samples/s, {GLOBAL_BATCH} per step; common noise > 0 adds "
             f"{WARM_UP_STEPS} warm-up steps {WARM_UP_SLOWDOWN - 1:.0%} slower; a throttle G slows rank "
             f"{THROTTLED_RANK} to {THROTTLE:g} half-way and speeds each other rank up by 1 to 1 + G.\n",
             "| steps | first split's timing noise | step noise | common noise | each rank's warm-up noise "
             f"| throttle | excess over the best split | changes{beside} |",
             "|---|---|---|---|---|---|---|---|" + ("---|---|" if args.baseline else "")]
    print("\n".join(lines))
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        modules = {"current": current}
        if args.baseline:
            modules["baseline"] = rebalancer_at(args.baseline, Path(folder))
        for steps, first_noise, step_noise, common, warm, throttle in settings(args):
            row = {"steps": steps, "first_noise": first_noise, "step_noise": step_noise, "common_noise": common,
                   "rank_warm_up": warm, "throttle": throttle}
            for name, module in modules.items():
                runs = [run(module, first_noise, step_noise, steps, seed, common, warm, throttle)
                        for seed in range(args.seeds)]
                prefix = "" if name == "current" else "baseline_"
                row[prefix + "excess"] = statistics.fmean(r[0] for r in runs)
                row[prefix + "changes"] = statistics.fmean(r[1] for r in runs)
            rows.append(row)
            cells = f"{row['excess']:.2%} | {row['changes']:.1f}"
            if args.baseline:
                cells += f" | {row['baseline_excess']:.2%} | {row['baseline_changes']:.1f}"
            throttled = "-" if throttle == NO_THROTTLE else f"+{throttle:.0%}"
            lines.append(f"| {steps} | {first_noise:.0%} | {step_noise:.0%} | {common:.0%} | {warm:.0%} | {throttled} "
                         f"| {cells} |")
            print(lines[-1], flush=True)
    if args.out:
        variant = "throttle" if max(args.throttle) != NO_THROTTLE else "warmup" if any(args.rank_warm_up) else \
            "common" if any(args.common) else None
        write_results(args.out, "rebalancer_noise", "\n".join(lines),
                      {"seeds": args.seeds, "baseline": args.baseline, "rows": rows}, variant=variant)


if __name__ == "__main__":
    main()
