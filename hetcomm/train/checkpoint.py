"""Checkpoints that survive a crash mid-write and refuse to load into the wrong run.

Written by rank 0 to a temporary file in the same directory, flushed to disk, then
renamed over the old one: a reader sees the old checkpoint or the new one, never half
of one. Read with torch.load(weights_only=True): a checkpoint cannot run code."""

import os
import tempfile
from pathlib import Path

import torch

# 2: the balancing state under "loop" (hetcomm.loop.BalancedLoop.state_dict).
FORMAT = 2


class CheckpointError(ValueError):
    """The checkpoint is unreadable or belongs to another run configuration."""


def save_atomic(state: dict, path: Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(descriptor, "wb") as f:
            torch.save({"format": FORMAT, **state}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def load_checked(path: Path, expected: dict) -> dict:
    """Loads a checkpoint and checks that its run description matches `expected`
    (model shape, world size, global batch, data...), naming each difference."""
    path = Path(path)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"--resume {path}: no such file") from None
    except Exception as error:  # any unpickling or format error means the file cannot be trusted
        raise CheckpointError(f"--resume {path}: not a readable hetcomm checkpoint ({type(error).__name__}: "
                              f"{str(error).splitlines()[0][:200]})") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT or "run" not in state:
        raise CheckpointError(f"--resume {path}: not a hetcomm checkpoint of format {FORMAT}")
    differences = [f"{key}: checkpoint has {state['run'].get(key)!r}, this run {value!r}"
                   for key, value in expected.items() if state["run"].get(key) != value]
    if differences:
        raise CheckpointError(f"--resume {path}: the checkpoint belongs to another run configuration; "
                              + "; ".join(differences))
    return state
