"""Validation of `hetcomm plan` against a SIMULATED CPU cluster, and its speed at scale.

For each scenario (4 CPU workers under Gloo on this machine, with simulated speed
factors):
  1. a profiling run: `hetcomm train` with rebalancing, whose log the planner reads
     (each rank's line t = a + c·b fitted over the sizes it was given, its update time,
     the measured all-reduce);
  2. the planner, given that profile, predicts the best split and its step time, and
     the step time of an equal split;
  3. two runs execute those splits (--split, no balancing); their median step times
     are what the predictions are checked against.
The error is printed (target: within 15%), never asserted. Then a 10,000-GPU cluster
of 8 kinds is planned and timed, once as is and once with every other core kept
busy (target: under a second).

    python benchmarks/bench_planner.py                       # ~5 minutes on 2 cores
    python benchmarks/bench_planner.py --steps 20 --json out.json
    python benchmarks/bench_planner.py --out benchmarks/results     # planner_cpu.md/.json
    python benchmarks/bench_planner.py --scale-only                 # the 10,000-GPU timing alone
"""

import argparse
import contextlib
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path

import torch

from hetcomm.balance import equal_split
from hetcomm.plan import load_catalog, load_run_profile, make_plan, parse_cluster, parse_model, spec_members
from hetcomm.simulated import speeds_for_this_machine
from result_files import add_out_arguments, write_results

# Relative speeds, fitted to the machine's cores as bench_hetero_cluster.py and the trainer's
# default run fit theirs: ranks that need more cores than there are slow one another down as
# no cluster of separate cards does.
SCENARIOS = {"speeds 1 : 1 : 0.5 : 0.25": speeds_for_this_machine([1, 1, 0.5, 0.25]),
             "speeds 1 : 0.5 : 0.5 : 0.2": speeds_for_this_machine([1, 0.5, 0.5, 0.2])}
# Steps of about a second on 2 cores, as in bench_hetero_cluster.py.
MODEL = ["--n-layer", "2", "--n-embd", "192", "--n-head", "4", "--block-size", "128", "--global-batch", "96"]
LARGE_CLUSTER = ",".join(f"1250x{name}" for name in ("1080ti", "titanxp", "p100", "v100", "t4", "2080ti", "3090",
                                                     "a100"))


def train(speeds: str, steps: int, out: Path, *extra: str) -> list[dict]:
    command = [sys.executable, "-m", "hetcomm", "train", "--speeds", speeds, "--steps", str(steps), "--out", str(out),
               "--no-progress", *MODEL, *extra]
    subprocess.run(command, check=True, capture_output=True, text=True)
    return [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]


def median_step(steps: list[dict]) -> float:
    return statistics.median(s["step_s"] for s in steps[1:])   # step 0 pays for warm-up


def validate(name: str, speeds: str, steps: int, work: Path) -> dict:
    runs = work / speeds.replace(",", "-")
    profile_dir = runs / "profile"
    train(speeds, steps, profile_dir)
    profile = load_run_profile(profile_dir)
    plan = make_plan(profile.members(), profile.model, profile.seq, profile.global_batch, in_node=profile.link,
                     between_nodes=profile.link, wire=profile.wire, find_slow_cards=False)
    equal = equal_split(profile.global_batch, len(profile.ranks))
    planned_run = train(speeds, steps, runs / "planned", "--split", ",".join(map(str, plan.split.sizes)))
    equal_run = train(speeds, max(8, steps // 2), runs / "equal", "--split", ",".join(map(str, equal)))
    measured, measured_equal = median_step(planned_run), median_step(equal_run)
    return {"scenario": name, "speeds": speeds, "profile_steps": profile.steps,
            "profile": [{"fixed_s": r.fixed, "per_sample_s": r.per_sample, "method": r.method} for r in profile.ranks],
            "measured_all_reduce_s": profile.comm_s,
            "planned_split": list(plan.split.sizes), "predicted_step_s": plan.step_s, "measured_step_s": measured,
            "error": plan.step_s / measured - 1,
            "equal_split": list(equal), "predicted_equal_step_s": plan.equal_step_s,
            "measured_equal_step_s": measured_equal, "equal_error": plan.equal_step_s / measured_equal - 1,
            "predicted_speedup": plan.speedup_over_equal, "measured_speedup": measured_equal / measured}


def _spin() -> None:
    while True:
        pass


@contextlib.contextmanager
def other_cores_busy() -> Iterator[int]:
    """Every core but one kept busy by a spinning process, as training or a second job
    keeps them while someone plans; yields how many."""
    spinners = [multiprocessing.Process(target=_spin, daemon=True) for _ in range((os.cpu_count() or 1) - 1)]
    for spinner in spinners:
        spinner.start()
    try:
        yield len(spinners)
    finally:
        for spinner in spinners:
            spinner.terminate()
            spinner.join()


def plan_large_cluster(repeats: int = 3) -> dict:
    catalog = load_catalog()
    model = parse_model("gpt2-124m")
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        cluster = parse_cluster(LARGE_CLUSTER, catalog)
        members = spec_members(cluster, model, 1024)
        link = catalog.link("100gbe")
        plan = make_plan(members, model, 1024, 100_000, in_node=catalog.link("pcie3"), between_nodes=link)
        times.append(time.perf_counter() - start)
    return {"devices": len(plan.members), "kinds": 8, "global_batch": 100_000, "seconds": min(times),
            "seconds_all": times, "step_s": plan.step_s, "slow_cards": len(plan.slow_cards)}


def markdown(results: list[dict], large: dict, meta: dict) -> str:
    lines = [f"# hetcomm plan against a SIMULATED CPU cluster ({meta['date']}, {meta['machine']})", "",
             "4 CPU worker processes (Gloo) with simulated speed factors (relative speeds fitted to the machine's "
             "cores, the factors in brackets); the planner reads a profiling run's log, "
             "predicts the best split and its step time; runs with that split, and with an equal split, measure "
             "them (median step, same machine, one session). Target: within 15%.", "",
             "| scenario | planned split | predicted | measured | error | equal split predicted | measured | error |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['scenario']} ({r['speeds']}) | {'/'.join(map(str, r['planned_split']))} | "
                     f"{r['predicted_step_s']:.3f} s | {r['measured_step_s']:.3f} s | {r['error']:+.1%} | "
                     f"{r['predicted_equal_step_s']:.3f} s | "
                     f"{r['measured_equal_step_s']:.3f} s | {r['equal_error']:+.1%} |")
    lines += ["", f"Planning {large['devices']:,} GPUs of {large['kinds']} kinds (gpt2-124m, global batch "
                  f"{large['global_batch']:,}, including the slow-card analysis): {large['seconds']:.3f} s "
                  f"(best of {len(large['seconds_all'])}; target under 1 s); with {large['busy']['cores']} other "
                  f"core(s) kept busy by a spinning process: {large['busy']['seconds']:.3f} s (slowest of "
                  f"{len(large['busy']['seconds_all'])}: {max(large['busy']['seconds_all']):.3f} s)."]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40, help="steps of each profiling and planned run")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--markdown", help="write a table here")
    parser.add_argument("--scale-only", action="store_true",
                        help="only time planning the 10,000-GPU cluster, idle and with the other cores busy (seconds)")
    add_out_arguments(parser)
    args = parser.parse_args()
    if args.scale_only and (args.markdown or args.out):
        parser.error("--scale-only: prints the timings (and --json); --markdown and --out need the validation runs")
    meta = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d"), "torch": torch.__version__,
            "machine": f"{torch.get_num_threads()} threads, CPU", "simulated": True}
    results = []
    with tempfile.TemporaryDirectory() as work:
        for name, speeds in ({} if args.scale_only else SCENARIOS).items():
            result = validate(name, speeds, args.steps, Path(work))
            results.append(result)
            print(f"{name}: planned {'/'.join(map(str, result['planned_split']))}: predicted "
                  f"{result['predicted_step_s']:.3f} s, measured {result['measured_step_s']:.3f} s "
                  f"({result['error']:+.1%}); equal split predicted {result['predicted_equal_step_s']:.3f} s, "
                  f"measured {result['measured_equal_step_s']:.3f} s ({result['equal_error']:+.1%})", flush=True)
    large = plan_large_cluster()
    with other_cores_busy() as busy:
        large["busy"] = {"cores": busy, **plan_large_cluster()}
    print(f"planning {large['devices']:,} GPUs of 8 kinds: {large['seconds']:.3f} s; with {busy} other core(s) "
          f"busy: {large['busy']['seconds']:.3f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "validation": results, "scale": large}, indent=1) + "\n")
    if args.markdown:
        Path(args.markdown).write_text(markdown(results, large, meta))
    if args.out:
        write_results(args.out, "planner", markdown(results, large, meta),
                      {"meta": meta, "validation": results, "scale": large})
    return 0


if __name__ == "__main__":
    sys.exit(main())
