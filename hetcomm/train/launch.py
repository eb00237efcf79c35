"""`hetcomm train`: checks the settings, then runs the ranks — joining a torchrun job
(env://) when launched by torchrun, otherwise starting one process per local GPU, or
a simulated heterogeneous cluster of CPU workers on a machine without GPUs."""

import json
import os
import sys
from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path

import torch

from hetcomm.loop.launch import RankFailed, free_port, launch, local_world, under_torchrun
from hetcomm.loop.checkpoint import CheckpointError, checkpoints, load, newest_valid
from hetcomm.train.data_fingerprint import data_fingerprint
from hetcomm.train.out_lock import hold_out
from hetcomm.train.config import (DEFAULT_CPU_SPEEDS, TrainConfig, check_data, check_out, config_device_is_cpu,
                                  from_args, parser, validate)
from hetcomm.simulated import speeds_for_this_machine

__all__ = ["main", "free_port"]


def _train(rank: int, world: int, device: torch.device, config: TrainConfig) -> None:
    from hetcomm.train.trainer import Trainer

    Trainer(config, rank, world, device).run()


def _check_resume(config: TrainConfig, world: int) -> None:
    """Chooses what the ranks start from, before any of them starts, so that a corrupt
    or mismatched checkpoint is one message and nothing in --out is touched: --resume's
    checkpoint, verified; or else the newest valid checkpoint of this same run in --out
    when that run is unfinished (a job restarted by torchrun, or the same command run
    again, goes on where it stopped); a finished run there is started over; checkpoints
    of another run, or none valid, stop with their reasons unless --fresh."""
    from hetcomm.train.trainer import check_ranges, check_resumable, load_data, run_description

    data, description = load_data(config)
    config.data_fingerprint = data_fingerprint(config.data, data.tokens, config.out)
    expected = run_description(config, world, description, len(data))
    # A sharded run's checkpoint is whole only with every rank's range of the state beside it.
    verify = check_ranges if config.shard else None
    if config.resume:
        state = load(config.resume, expected)
        if verify is not None:
            verify(state, config.resume)
        check_resumable(state, config, data.vocab_size)
        _check_same_data(state, config, config.resume)
        return
    if config.fresh or not checkpoints(config.out):
        return
    state, path, passed = newest_valid(config.out, expected, verify)
    if state is None:
        raise CheckpointError(f"--out {config.out} holds checkpoints of no resumable run of these settings ("
                              + "; ".join(passed) + "); pass --fresh to start over there, or another --out")
    # Every torchrun worker decides for itself, alike; one of them says so.
    say = os.environ.get("RANK", "0") == "0"
    for reason in passed if say else ():
        print(f"hetcomm train: passing over {reason}", file=sys.stderr)
    if state["step"] < config.steps:
        check_resumable(state, config, data.vocab_size)
        _check_same_data(state, config, path)
        if say:
            print(f"hetcomm train: resuming from {path} (step {state['step']} of {config.steps})", file=sys.stderr)
        config.resume = str(path)


def _check_same_data(state: dict, config: TrainConfig, path) -> None:
    """Refuses to resume on data whose content is not what the checkpoint was trained on
    (regenerated, edited or cut under the same name: the window count may not change),
    unless --data-changed. A checkpoint written before fingerprints were kept has none."""
    recorded, now = state["run"].get("data_sha256"), config.data_fingerprint["sha256"]
    if recorded is None or recorded == now or config.data_changed:
        return
    data = f"--data {config.data}" if config.data else "the default corpus"
    raise CheckpointError(f"{data}: its content is not what {path} was trained on (SHA-256 {recorded[:16]}... then, "
                          f"{now[:16]}... now): it was regenerated or edited; pass --data-changed to resume on it "
                          f"anyway, or --fresh to start over")


def speedup_words(ratio: float) -> str:
    """A speed-up as people say it: 0.5 is "2.00x slower", not "0.50x faster"."""
    return f"{ratio:.2f}x faster" if ratio >= 1 else f"{1 / ratio:.2f}x slower"


def _print_summary(out: Path, config: TrainConfig, world: int) -> None:
    summary = json.loads((out / "summary.json").read_text())
    steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines() if line.strip()]
    kind = (f"SIMULATED cluster of {world} CPU workers (speed factors {config.speeds}"
            + (f", slowdowns {', '.join(config.slowdown)}" if config.slowdown else "") + ")") \
        if summary["simulated"] else f"{world} ranks"
    # After a resume this process ran only the steps from the checkpoint on: the time of
    # the whole run is that of its logged steps.
    logged_s = sum(s["step_s"] for s in steps)
    resumed = summary.get("first_step", 0)
    session = f" (resumed at step {resumed}: {summary['seconds']:.3g} s in this session)" if resumed else ""
    print(f"\nhetcomm train: {kind}: {summary['steps']} steps in {logged_s:.3g} s of logged steps{session}")
    phases = summary["phases"]
    for name, phase in phases.items():
        print(f"  {name:<14} {phase['steps']:>4} steps, median {phase['median_step_s']:.3f} s per step")
    baseline = phases.get("equal split", {}).get("median_step_s")
    for name in ("balanced", "static split"):
        if name in phases and phases[name]["steps"] and phases.get("equal split", {}).get("steps"):
            print(f"  {name} vs equal split: {speedup_words(baseline / phases[name]['median_step_s'])} per step "
                  f"(same global batch, same gradient)")
    print(f"  ideal bound from the measured speeds: {summary['ideal_step_s']:.3f} s of compute per step; "
          f"final split {'/'.join(map(str, summary['final_split']))}")
    if summary.get("shard"):
        shard = summary["shard"]
        owned = '/'.join(f'{n:,}' for n in shard['elements'])
        print(f"  {shard.get('what', 'optimizer state')} sharded by memory: ranks own {owned} of "
              f"{sum(shard['elements']):,} elements, keeping {'/'.join(f'{b:,}' for b in shard['state_bytes'])} "
              f"bytes of state (unsharded, each would keep {shard['unsharded_state_bytes']:,})")
        if shard.get("host_bytes"):
            print(f"  optimizer state offloaded: {'/'.join(f'{b:,}' for b in shard['host_bytes'])} bytes of host "
                  f"memory per rank")
    handoffs = [s for s in steps if s.get("handoff")]
    if handoffs:
        listed = ", ".join(str(s["step"]) for s in handoffs[:10]) + (", ..." if len(handoffs) > 10 else "")
        moved = sum(s["handoff"]["moved"] for s in handoffs)
        print(f"  a rank far behind handed {moved} window{'s' if moved != 1 else ''} to the others within "
              f"{len(handoffs)} step{'s' if len(handoffs) != 1 else ''} (step {listed})")
    print(f"  loss {steps[0]['loss']:.3f} -> {steps[-1]['loss']:.3f}; log {out / 'steps.jsonl'}; "
          f"checkpoints {out}/checkpoint-*.pt; plots: hetcomm report {out}")


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    config = from_args(args)
    use_cuda = not config_device_is_cpu(config)
    if config.device == "cuda" and not torch.cuda.is_available():
        parser().exit(2, "hetcomm train: error: --device cuda but torch sees no CUDA GPU\n")
    world = local_world(use_cuda, config.nproc)
    if not under_torchrun() and config.nproc is None and not use_cuda and config.speeds is None:
        # The built-in default: a simulated heterogeneous cluster that fits this machine.
        config.speeds = speeds_for_this_machine(DEFAULT_CPU_SPEEDS)
    try:
        if world < 1:
            raise ValueError(f"--nproc must be at least 1; got {world}")
        validate(config, world)
        check_out(config.out)
        check_data(config)
        _check_resume(config, world)
        # Held while the run goes: by the launcher, or under torchrun by rank 0's worker.
        out_lock = hold_out(config.out) if os.environ.get("RANK", "0") == "0" else nullcontext()
    except (ValueError, OSError, CheckpointError) as error:
        parser().exit(2, f"hetcomm train: error: {error}\n")
    with out_lock:
        try:
            launch(_train, config, nproc=world, use_cuda=use_cuda, debug=args.debug,
                   timeout=timedelta(seconds=config.timeout))
        except RankFailed as failure:
            hint = "" if args.debug else " (--debug prints its traceback)"
            parser().exit(1, f"hetcomm train: error: {failure}{hint}\n")
    if not under_torchrun():
        if (Path(config.out) / "summary.json").is_file():
            _print_summary(Path(config.out), config, world)
        else:   # the ranks agreed to stop early (SIGTERM) and checkpointed
            print(f"hetcomm train: stopped early; the same command resumes from the last checkpoint in {config.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
