"""The names of a run directory's checkpoints, shared by the run's own checkpoint
(hetcomm.loop.checkpoint) and the ranges of sharded state written beside it
(hetcomm.shard.checkpoint)."""

import re
from pathlib import Path

NAME = re.compile(r"checkpoint-(\d+)\.pt")


def checkpoint_path(directory: Path, step: int) -> Path:
    return Path(directory) / f"checkpoint-{step:08d}.pt"


def checkpoints(directory: Path) -> list[Path]:
    """The directory's checkpoints, newest (highest step) first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := NAME.fullmatch(p.name))]
    return [p for _, p in sorted(found, reverse=True)]
