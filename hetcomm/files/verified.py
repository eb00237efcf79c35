"""Atomic writes of nested state with a SHA-256 digest of every tensor and of everything
else, and reads that check them.

A file is written to a temporary file in the same directory, flushed to disk, then
renamed: a reader sees a whole file or none (a kill during the write leaves a temporary
file; see remove_temporaries). The digests make a flipped byte, a truncated file or a
hand-edited value an error when the file is read, not after training from it. Reads use
torch.load(weights_only=True): a file cannot run code."""

import hashlib
import os
import tempfile
from pathlib import Path

import torch

# The digests' key for everything in a file that is not a tensor.
NON_TENSORS = "(the values that are not tensors)"
TEMPORARY_PREFIX = ".checkpoint-"


class CheckpointError(ValueError):
    """The checkpoint is unreadable, damaged or belongs to another run configuration."""


def tensors_of(value, prefix: str = ""):
    """(path, tensor) of every tensor in nested dicts, lists and tuples, in a fixed order."""
    if isinstance(value, torch.Tensor):
        yield prefix, value
    elif isinstance(value, dict):
        for key in sorted(value, key=str):
            yield from tensors_of(value[key], f"{prefix}/{key}" if prefix else str(key))
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            yield from tensors_of(item, f"{prefix}/{index}")


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


def values_digest(state) -> str:
    """The SHA-256 of the repr of everything in `state` that is not a tensor (exact for
    the numbers, strings, booleans and None that torch.load(weights_only=True) and
    json.load give back)."""
    return hashlib.sha256(repr(_skeleton(state)).encode()).hexdigest()


def digests(state: dict) -> dict[str, str]:
    """The SHA-256 of every tensor's dtype, shape and bytes, by its path in `state`, and
    under NON_TENSORS the values_digest of everything else."""
    found = {}
    for path, tensor in tensors_of(state):
        data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        digest = hashlib.sha256(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
        digest.update(data.tobytes())
        found[path] = digest.hexdigest()
    found[NON_TENSORS] = values_digest(state)
    return found


def write_atomically(path: Path, write) -> None:
    """Calls write(f) on a temporary file in `path`'s directory, flushes it to disk, then
    renames it to `path`: a reader sees the old file, the new one, or none."""
    descriptor, temporary = tempfile.mkstemp(dir=Path(path).parent, prefix=TEMPORARY_PREFIX, suffix=".tmp")
    try:
        with os.fdopen(descriptor, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def write_verified(path: Path, content: dict, format: int) -> None:
    """Writes content with its format and digests to `path`, atomically."""
    write_atomically(path, lambda f: torch.save({"format": format, **content, "digests": digests(content)}, f))


def remove_temporaries(directory: Path) -> list[Path]:
    """Removes the temporary files of writes that a kill interrupted."""
    directory = Path(directory)
    stale = [p for p in directory.glob(f"{TEMPORARY_PREFIX}*.tmp")] if directory.is_dir() else []
    for p in stale:
        p.unlink(missing_ok=True)
    return stale


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
        found = {NON_TENSORS: values_digest(content)}
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
