"""Checkpoints that survive a crash mid-write, prove their own content, and refuse to
load into the wrong run.

A run directory holds its last `keep` checkpoints, checkpoint-<step>.pt. Each is
written to a temporary file in the same directory, flushed to disk, then renamed: a
reader sees a whole checkpoint or none (a kill during the write leaves a temporary
file, removed when the next run starts there). Each carries a SHA-256 digest of every
tensor it holds and one of everything else (the step, the sampler's position, the split,
the loss scale, the rebalancer's state), so a flipped byte, a truncated file or a
hand-edited value is found when it is read, not after training from it. Read with
torch.load(weights_only=True): a checkpoint cannot run code."""

from pathlib import Path

import torch

from hetcomm.files.run_directory import NAME, checkpoint_path, checkpoints
from hetcomm.files.verified import (NON_TENSORS, TEMPORARY_PREFIX, CheckpointError, digests, read,
                                    remove_temporaries, tensors_of, verify_digests, write_verified)

__all__ = ["FORMAT", "NAME", "NON_TENSORS", "READABLE", "TEMPORARY_PREFIX", "CheckpointError", "checkpoint_path",
           "checkpoints", "digests", "load", "newest_valid", "read", "remove_temporaries", "save", "verify_digests",
           "write_verified"]

# 3: one file per step, with the digest of every tensor. 4: and of the rest (NON_TENSORS).
FORMAT = 4
# A run written by the previous release resumes: its tensors are verified as before.
READABLE = (3, FORMAT)


def save(directory: Path, step: int, state: dict, keep: int = 3) -> Path:
    """Writes state (with its digests) as checkpoint-<step>.pt, atomically, and removes
    all but the newest `keep` checkpoints of the directory."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = checkpoint_path(directory, step)
    write_verified(path, {"step": step, **state}, FORMAT)
    for old in checkpoints(directory)[keep:]:
        old.unlink(missing_ok=True)
    return path


def load(path: Path, expected: dict, finite: tuple[str, ...] = ("model",)) -> dict:
    """Reads and verifies a checkpoint: readable, of this format, of the run `expected`
    describes (every difference named), every tensor's digest as written, a step that
    is a non-negative integer, and no inf/NaN in the float tensors under `finite`."""
    path = Path(path)
    state = read(path)
    if not isinstance(state, dict) or state.get("format") not in READABLE or "run" not in state \
            or "digests" not in state:
        raise CheckpointError(f"{path}: not a hetcomm checkpoint of format {' or '.join(map(str, READABLE))}")
    differences = [f"{key}: checkpoint has {state['run'].get(key)!r}, this run {value!r}"
                   for key, value in expected.items() if state["run"].get(key) != value]
    if differences:
        raise CheckpointError(f"{path}: the checkpoint belongs to another run configuration; " + "; ".join(differences))
    verify_digests(path, state, tensors_only=state["format"] == 3)   # format 3's digests cover the tensors only
    step = state.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointError(f"{path}: step {step!r} is not a non-negative integer")
    for part in finite:
        for name, tensor in tensors_of(state.get(part, {}), part):
            if tensor.is_floating_point() and not torch.isfinite(tensor).all():
                raise CheckpointError(f"{path}: {name} holds inf or NaN values")
    return state


def newest_valid(directory: Path, expected: dict, verify=None) -> tuple[dict | None, Path | None, list[str]]:
    """The newest checkpoint of the directory that verifies (see load; and `verify`,
    called with the state and its path, raises no CheckpointError: what lies beside a
    checkpoint, such as the ranges of a sharded run), its path, and why each newer one
    was passed over."""
    passed = []
    for path in checkpoints(directory):
        try:
            state = load(path, expected)
            if verify is not None:
                verify(state, path)
            return state, path, passed
        except CheckpointError as error:
            passed.append(str(error))
    return None, None, passed

