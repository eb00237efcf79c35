"""Runs a function on several Gloo ranks (processes on 127.0.0.1) and collects what
each returned, or the error each raised, without hanging the test run."""

import os
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hetcomm.train.launch import free_port

# Ranks start from a fork server that has imported torch and hetcomm once: a spawned rank
# pays ~1 s of imports each, ~2 s for 2 ranks and ~3.5 s for 4 on 2 cores, at every call.
# The integrations' frameworks too, where installed (a missing one is passed over): the
# Trainer and Lightning tests took 50 s without them, 32 s with them.
mp.set_forkserver_preload(["torch", "torch.distributed", "hetcomm", "distributed", "transformers.trainer",
                           "lightning.pytorch"])


def _rank_main(rank, world_size, port, fn, args, out_dir, group_timeout_s):
    torch.set_num_threads(1)  # several ranks share 2 cores
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=group_timeout_s))
    try:
        result = {"ok": fn(rank, world_size, *args)}
    except Exception as error:  # the test inspects each rank's error
        result = {"type": type(error).__name__, "message": str(error),
                  "traceback": traceback.format_exc()}
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    # A rank whose peers are gone must not linger in the group's destructor.
    os._exit(0)


def run_ranks(world_size: int, fn, *args, tmp_path, group_timeout_s: float = 60.0) -> list[dict]:
    """Calls fn(rank, world_size, *args) on each rank; returns per rank {"ok": value} or
    {"error", "type", "message", "traceback"}. fn must be a module-level function."""
    out_dir = Path(tmp_path) / f"ranks-{fn.__name__}"
    out_dir.mkdir(parents=True, exist_ok=True)
    mp.start_processes(_rank_main, args=(world_size, free_port(), fn, args, str(out_dir), group_timeout_s),
                       nprocs=world_size, join=True, start_method="forkserver")
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(world_size)]


def values(results: list[dict]) -> list:
    """The ranks' return values; fails with the first rank's traceback if any raised."""
    for rank, result in enumerate(results):
        assert "ok" in result, f"rank {rank} raised:\n{result['traceback']}"
    return [r["ok"] for r in results]
