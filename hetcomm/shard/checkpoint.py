"""Checkpoints of sharded optimizer state: each rank writes its range beside the run's
checkpoint, and any rank reads back any range, however many ranks wrote it and however
their ranges were sized (a card removed: 4 ranks' ranges read by 3).

checkpoint-<step>.pt (the run's own checkpoint) is written by rank 0 once every rank has
written checkpoint-<step>.range-<rank>-of-<world>.pt: its range [start, stop) of the flat
parameter space and that range of each state tensor (the fp32 masters and AdamW's
moments), written atomically with the digests of every tensor and value, as the run's
checkpoint is, so a damaged or edited range is found when it is read. Reading checks
that the step's files are one world's, tile the parameters exactly, and are of this
model's parameter layout, then copies out the requested range.

A resume passes over a step whose ranges are incomplete (a rank stopped while saving):
complete() checks every file's values without reading the tensors. A kill during a
write leaves a temporary file that hetcomm.files.verified.remove_temporaries removes;
remove_unkept removes the ranges of steps whose checkpoint `keep` rotated out.

torch.distributed.checkpoint (DCP) is the general engine for resharding, and it is not
used here. Measured (benchmarks/shard_checkpoint_dcp.py, results/shard_checkpoint_dcp_cpu.md:
100M fp32 elements in 4 Gloo ranks' 11/11/11/32 ranges, read back by 3 ranks' 11/11/32):
- its default planner takes the ranks' plain tensors for one replicated tensor and
  silently saves rank 0's 16.9M elements only (68 MB of 400), found only when a load of
  the whole fails on the size;
- with its chunk hooks (torch 2.14's CheckpointableTensor attributes on each range) it
  saves all 4 ranges and reshards 4 -> 3 bit for bit, saving in 0.53 s against these
  files' 0.99 s (their SHA-256 of every byte) and loading in 0.55 s against 0.43 s;
- but it read a data file with a flipped byte without an error (one element wrong), and
  it reads its .metadata with pickle.load, so a checkpoint can run code (the benchmark
  shows one doing so), where hetcomm's checkpoints are read with weights_only=True.
Digests beside DCP's files would need each rank to read whole chunks outside DCP (it
reads only the requested slices) and a restricted unpickler in place of its reader's:
most of this module again, for a planner that for 1-D ranges is the overlap loop below.
The cost of the choice: saves ~0.1 s slower per 100 MB of state (0.46 s for the 400 MB,
set by the rank of the largest range)."""

import re
from pathlib import Path

import torch
from torch import Tensor

from hetcomm.files.run_directory import NAME
from hetcomm.files.verified import CheckpointError, read, verify_digests, write_verified

FORMAT = 1
RANGE_NAME = re.compile(r"checkpoint-(\d+)\.range-(\d+)-of-(\d+)\.pt")


def range_path(directory: Path, step: int, rank: int, world: int) -> Path:
    return Path(directory) / f"checkpoint-{step:08d}.range-{rank}-of-{world}.pt"


def save_range(directory: Path, step: int, rank: int, world: int, start: int, stop: int, total: int,
               model_digest: str, tensors: dict[str, Tensor]) -> Path:
    """Writes this rank's range of the state (1-D tensors of stop - start elements each),
    atomically and with digests. Every rank calls it before rank 0 writes the step's
    checkpoint."""
    if not (0 <= rank < world and 0 <= start <= stop <= total):
        raise ValueError(f"save_range: rank {rank} of {world}, range [{start}, {stop}) of {total:,} elements")
    for name, tensor in tensors.items():
        if tensor.dim() != 1 or tensor.numel() != stop - start:
            raise ValueError(f"save_range: {name} has shape {tuple(tensor.shape)}; expected ({stop - start},), the "
                             f"range [{start}, {stop})")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = range_path(directory, step, rank, world)
    write_verified(path, {"step": step, "rank": rank, "world": world, "start": start, "stop": stop, "total": total,
                          "model": model_digest, "tensors": {n: _own(t) for n, t in tensors.items()}}, FORMAT)
    return path


def _own(tensor: Tensor) -> Tensor:
    """The values alone: torch.save writes a view's whole storage, which a range's slice of
    a larger tensor would fill with elements outside the range (and outside its digest)."""
    tensor = tensor.detach()
    if tensor.device.type == "cpu" and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size():
        return tensor
    return tensor.to("cpu", copy=True)


def load_range(directory: Path, step: int, start: int, stop: int, total: int, model_digest: str) -> dict[str, Tensor]:
    """The state of elements [start, stop), assembled from the ranges the step's ranks
    wrote. Raises CheckpointError naming the file and the fault: a missing, damaged,
    edited or renamed file, files of several world sizes, ranges with a gap or an
    overlap, or the state of another model."""
    if not 0 <= start <= stop <= total:
        raise ValueError(f"load_range: [{start}, {stop}) is not a range of the {total:,} elements")
    out = {}
    for path, state in _verified(directory, step, total, model_digest, (start, stop)):
        low, high = max(start, state["start"]), min(stop, state["stop"])
        for name, tensor in state["tensors"].items():
            if name not in out:
                out[name] = torch.empty(stop - start, dtype=tensor.dtype)
            if low < high:
                out[name][low - start:high - start] = tensor[low - state["start"]:high - state["start"]]
    return out


def check_step(directory: Path, step: int, total: int, model_digest: str) -> None:
    """Raises CheckpointError, as load_range would, unless the step's ranges are all
    there, of one world, tile the parameters and are of this model: every file's values
    verified, no tensor's bytes read (load_range verifies those it reads)."""
    _verified(directory, step, total, model_digest, None)


def complete(directory: Path, step: int, total: int, model_digest: str) -> bool:
    """Whether the step's ranges pass check_step: a resume passes over a step that a rank
    stopped while saving (or whose ranges were removed) to the newest complete one."""
    try:
        check_step(directory, step, total, model_digest)
    except CheckpointError:
        return False
    return True


def _files_of(directory: Path, step: int) -> dict[tuple[int, int], Path]:
    found = {}
    for path in Path(directory).glob(f"checkpoint-{step:08d}.range-*-of-*.pt"):
        match = RANGE_NAME.fullmatch(path.name)
        if match:
            found[(int(match.group(2)), int(match.group(3)))] = path
    return found


def _verified(directory: Path, step: int, total: int, model_digest: str,
              reading: tuple[int, int] | None) -> list[tuple[Path, dict]]:
    """The step's ranges in rank order, each (path, state), once every file's values
    are verified and, where `reading` (start, stop) overlaps its range, its tensors: each
    file overlaps some rank's new range, so every byte is verified by one rank."""
    files = _files_of(directory, step)
    where = f"{Path(directory)} (step {step})"
    if not files:
        raise CheckpointError(f"{where}: no ranges of sharded optimizer state; was the run sharded?")
    worlds = sorted({world for _, world in files})
    if len(worlds) > 1:
        raise CheckpointError(f"{where}: ranges of {' and '.join(map(str, worlds))} ranks are mixed; a step's "
                              f"ranges come from one run")
    world = worlds[0]
    missing = [rank for rank in range(world) if (rank, world) not in files]
    if missing:
        raise CheckpointError(f"{where}: the ranges of ranks {missing} of {world} are missing (a rank stopped "
                              f"while saving, or the files were removed)")
    states = []
    for rank in range(world):
        path = files[(rank, world)]
        state = read(path, mmap=True)   # a tensor's bytes are read only when touched
        if not isinstance(state, dict) or state.get("format") != FORMAT or "digests" not in state \
                or not {"step", "rank", "world", "start", "stop", "total", "model", "tensors"} <= set(state) \
                or not isinstance(state["tensors"], dict):
            raise CheckpointError(f"{path}: not a range of sharded state of format {FORMAT}")
        overlaps = reading is not None and state["start"] < reading[1] and reading[0] < state["stop"]
        verify_digests(path, state, values_only=not overlaps)
        if (state["step"], state["rank"], state["world"]) != (step, rank, world):
            raise CheckpointError(f"{path}: holds the range of rank {state['rank']} of {state['world']} at step "
                                  f"{state['step']}; its name says rank {rank} of {world} at step {step} (renamed "
                                  f"or copied from elsewhere)")
        if state["model"] != model_digest or state["total"] != total:
            raise CheckpointError(f"{path}: the state of another model (parameter layout {state['model']}, "
                                  f"{state['total']:,} elements); this run's model has layout {model_digest}, "
                                  f"{total:,} elements")
        states.append((path, state))
    expected = 0
    for path, state in states:
        if state["start"] != expected or state["stop"] < state["start"]:
            fault = "a gap" if state["start"] > expected else "an overlap" if state["start"] < expected else \
                "a reversed range"
            raise CheckpointError(f"{path}: its range [{state['start']}, {state['stop']}) leaves {fault} after "
                                  f"element {expected}; the ranges must tile the parameters in rank order")
        expected = state["stop"]
    if expected != total:
        raise CheckpointError(f"{where}: the ranges end at element {expected:,} of {total:,}")
    names = sorted(states[0][1]["tensors"])
    for path, state in states:
        if sorted(state["tensors"]) != names:
            raise CheckpointError(f"{path}: holds {sorted(state['tensors'])}, another range {names}")
        for name, tensor in state["tensors"].items():
            if not isinstance(tensor, Tensor) or tuple(tensor.shape) != (state["stop"] - state["start"],):
                raise CheckpointError(f"{path}: {name} is not a 1-D tensor of its range's "
                                      f"{state['stop'] - state['start']:,} elements")
    return states


def remove_unkept(directory: Path) -> list[Path]:
    """Removes the ranges of steps whose checkpoint is gone (rotated out by `keep`, or
    removed when a run starts over): rank 0 calls it after writing a checkpoint."""
    directory = Path(directory)
    kept = {int(m.group(1)) for p in directory.iterdir() if (m := NAME.fullmatch(p.name))} \
        if directory.is_dir() else set()
    removed = []
    for path in directory.glob("checkpoint-*.range-*-of-*.pt") if directory.is_dir() else []:
        match = RANGE_NAME.fullmatch(path.name)
        if match and int(match.group(1)) not in kept:
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed
