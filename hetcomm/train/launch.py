"""`hetcomm train`: checks the settings, then runs the ranks — joining a torchrun job
(env://) when launched by torchrun, otherwise starting one process per local GPU, or
a simulated heterogeneous cluster of CPU workers on a machine without GPUs."""

import json
import os
import socket
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hetcomm.train.checkpoint import CheckpointError, load_checked
from hetcomm.train.config import (DEFAULT_CPU_RANKS, DEFAULT_CPU_SPEEDS, TrainConfig, config_device_is_cpu,
                                  from_args, parser, validate)
from hetcomm.train.host_memory import keep_freed_memory
from hetcomm.train.simulate import speeds_for_this_machine


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now, for a local process group."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_rank(rank: int, world: int, config: TrainConfig, use_cuda: bool, init_method: str | None) -> None:
    from hetcomm.train.trainer import Trainer

    if use_cuda:
        torch.cuda.set_device(rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
        # The workers share the machine's cores.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        keep_freed_memory()
    spawned = init_method is not None
    kwargs = {"init_method": init_method, "rank": rank, "world_size": world} if spawned else {}
    dist.init_process_group("nccl" if use_cuda else "gloo", timeout=timedelta(minutes=10), **kwargs)
    Trainer(config, dist.get_rank(), dist.get_world_size(), device).run()
    dist.barrier()
    if spawned:
        # A worker we started has nothing left to do once every rank is past the barrier.
        # Tearing the Gloo group down as the peers exit can abort in torch's C++ destructors
        # (seen with torch 2.13: "terminate called without an active exception"), so the
        # worker leaves without running them.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    dist.destroy_process_group()


def _check_resume(config: TrainConfig, world: int) -> None:
    """Reads the checkpoint before any worker starts, so a corrupt or mismatched one is
    one message and nothing is overwritten."""
    from hetcomm.train.trainer import load_data, run_description

    data, description = load_data(config)
    load_checked(config.resume, run_description(config, world, description, len(data)))


def _print_summary(out: Path, config: TrainConfig, world: int) -> None:
    summary = json.loads((out / "summary.json").read_text())
    steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines() if line.strip()]
    kind = (f"SIMULATED cluster of {world} CPU workers (speed factors {config.speeds}"
            + (f", slowdowns {', '.join(config.slowdown)}" if config.slowdown else "") + ")") \
        if summary["simulated"] else f"{world} ranks"
    print(f"\nhetcomm train: {kind}: {summary['steps']} steps in {summary['seconds']:.0f} s")
    phases = summary["phases"]
    for name, phase in phases.items():
        print(f"  {name:<14} {phase['steps']:>4} steps, median {phase['median_step_s']:.3f} s per step")
    baseline = phases.get("equal split", {}).get("median_step_s")
    for name in ("balanced", "static split"):
        if name in phases and phases[name]["steps"] and phases.get("equal split", {}).get("steps"):
            print(f"  {name} vs equal split: {baseline / phases[name]['median_step_s']:.2f}x faster per step "
                  f"(same global batch, same gradient)")
    print(f"  ideal bound from the measured speeds: {summary['ideal_step_s']:.3f} s of compute per step; "
          f"final split {'/'.join(map(str, summary['final_split']))}")
    handoffs = [s for s in steps if s.get("handoff")]
    if handoffs:
        listed = ", ".join(str(s["step"]) for s in handoffs[:10]) + (", ..." if len(handoffs) > 10 else "")
        moved = sum(s["handoff"]["moved"] for s in handoffs)
        print(f"  a rank far behind handed {moved} window{'s' if moved != 1 else ''} to the others within "
              f"{len(handoffs)} step{'s' if len(handoffs) != 1 else ''} (step {listed})")
    print(f"  loss {steps[0]['loss']:.3f} -> {steps[-1]['loss']:.3f}; log {out / 'steps.jsonl'}; "
          f"checkpoint {out / 'checkpoint.pt'}; plots: hetcomm report {out}")


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    config = from_args(args)
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    use_cuda = not config_device_is_cpu(config)
    if config.device == "cuda" and not torch.cuda.is_available():
        parser().exit(2, "hetcomm train: error: --device cuda but torch sees no CUDA GPU\n")
    if under_torchrun:
        world = int(os.environ["WORLD_SIZE"])
    elif config.nproc is not None:
        world = config.nproc
    else:
        world = torch.cuda.device_count() if use_cuda else DEFAULT_CPU_RANKS
        if not use_cuda and config.speeds is None:
            # The built-in default: a simulated heterogeneous cluster that fits this machine.
            config.speeds = speeds_for_this_machine(DEFAULT_CPU_SPEEDS)
    try:
        if world < 1:
            raise ValueError(f"--nproc must be at least 1; got {world}")
        validate(config, world)
        if config.resume:
            _check_resume(config, world)
    except (ValueError, FileNotFoundError, CheckpointError) as error:
        parser().exit(2, f"hetcomm train: error: {error}\n")

    if under_torchrun:
        _run_rank(int(os.environ["LOCAL_RANK"]) if use_cuda else int(os.environ["RANK"]), world, config, use_cuda,
                  None)
        return 0
    mp.start_processes(_run_rank, args=(world, config, use_cuda, f"tcp://127.0.0.1:{free_port()}"), nprocs=world,
                       join=True, start_method="spawn")
    _print_summary(Path(config.out), config, world)
    return 0


if __name__ == "__main__":
    sys.exit(main())
