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

import hashlib
import os
import re
import tempfile
from pathlib import Path

import torch

# 3: one file per step, with the digest of every tensor. 4: and of the rest (NON_TENSORS).
FORMAT = 4
# A run written by the previous release resumes: its tensors are verified as before.
READABLE = (3, FORMAT)
# The digests' key for everything in a checkpoint that is not a tensor.
NON_TENSORS = "(the values that are not tensors)"
NAME = re.compile(r"checkpoint-(\d+)\.pt")
TEMPORARY_PREFIX = ".checkpoint-"


class CheckpointError(ValueError):
    """The checkpoint is unreadable, damaged or belongs to another run configuration."""


def checkpoint_path(directory: Path, step: int) -> Path:
    return Path(directory) / f"checkpoint-{step:08d}.pt"


def _tensors(value, prefix: str = ""):
    """(path, tensor) of every tensor in nested dicts, lists and tuples, in a fixed order."""
    if isinstance(value, torch.Tensor):
        yield prefix, value
    elif isinstance(value, dict):
        for key in sorted(value, key=str):
            yield from _tensors(value[key], f"{prefix}/{key}" if prefix else str(key))
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            yield from _tensors(item, f"{prefix}/{index}")


def _skeleton(value):
    """`value` with every tensor replaced by a mark: what the tensors' digests leave out.
    Sequences keep their type, so that a tuple edited into a list differs too."""
    if isinstance(value, torch.Tensor):
        return "<tensor>"
    if isinstance(value, dict):
        return [(repr(key), _skeleton(value[key])) for key in sorted(value, key=repr)]
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, [_skeleton(item) for item in value])
    return value


def digests(state: dict) -> dict[str, str]:
    """The SHA-256 of every tensor's dtype, shape and bytes, by its path in `state`, and
    under NON_TENSORS that of the repr of everything else (exact for the numbers, strings,
    booleans and None that torch.load(weights_only=True) gives back)."""
    found = {}
    for path, tensor in _tensors(state):
        data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        digest = hashlib.sha256(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
        digest.update(data.tobytes())
        found[path] = digest.hexdigest()
    found[NON_TENSORS] = hashlib.sha256(repr(_skeleton(state)).encode()).hexdigest()
    return found


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


def write_verified(path: Path, content: dict, format: int) -> None:
    """Writes content with its format and digests to `path`, atomically: a temporary file
    in the same directory, flushed to disk, then renamed."""
    descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=TEMPORARY_PREFIX, suffix=".tmp")
    try:
        with os.fdopen(descriptor, "wb") as f:
            torch.save({"format": format, **content, "digests": digests(content)}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def checkpoints(directory: Path) -> list[Path]:
    """The directory's checkpoints, newest (highest step) first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := NAME.fullmatch(p.name))]
    return [p for _, p in sorted(found, reverse=True)]


def remove_temporaries(directory: Path) -> list[Path]:
    """Removes the temporary files of checkpoint writes that a kill interrupted."""
    directory = Path(directory)
    stale = [p for p in directory.glob(f"{TEMPORARY_PREFIX}*.tmp")] if directory.is_dir() else []
    for p in stale:
        p.unlink(missing_ok=True)
    return stale


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
        for name, tensor in _tensors(state.get(part, {}), part):
            if tensor.is_floating_point() and not torch.isfinite(tensor).all():
                raise CheckpointError(f"{path}: {name} holds inf or NaN values")
    return state


def read(path: Path, mmap: bool = False):
    """torch.load(weights_only=True) of a checkpoint file, any failure a CheckpointError;
    with mmap, tensors are read from the file only when touched."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such file") from None
    except Exception as error:  # any unpickling or format error means the file cannot be trusted
        first = (str(error).splitlines() or [""])[0][:200]
        raise CheckpointError(f"{path}: not a readable hetcomm checkpoint ({type(error).__name__}: {first})") from None


def verify_digests(path: Path, state: dict, tensors_only: bool = False, values_only: bool = False) -> None:
    """Takes the digests out of `state` and raises CheckpointError, naming what differs,
    unless every tensor and the values that are not tensors hold what was written
    (values_only: only those values, no tensor's bytes read)."""
    written = state.pop("digests")
    content = {k: v for k, v in state.items() if k != "format"}
    if values_only:
        written = {NON_TENSORS: written.get(NON_TENSORS)}
        found = {NON_TENSORS: hashlib.sha256(repr(_skeleton(content)).encode()).hexdigest()}
    else:
        found = digests(content)
    if tensors_only:
        found = {name: digest for name, digest in found.items() if name != NON_TENSORS}
    for name in sorted(set(written) | set(found)):
        if written.get(name) != found.get(name):
            if name == NON_TENSORS:
                raise CheckpointError(f"{path}: its values that are not tensors (the step, the sampler's position, "
                                      f"the split, the loss scale, ...) do not hold what was written (damaged or "
                                      f"edited)")
            what = "is missing" if name not in found else "was not written" if name not in written else \
                "does not hold what was written (damaged or edited)"
            raise CheckpointError(f"{path}: tensor {name} {what}")


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

