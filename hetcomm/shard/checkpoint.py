"""Checkpoints of sharded optimizer state: each rank writes its range beside the run's
checkpoint, and any rank reads back any range, however many ranks wrote it and however
their ranges were sized (a card removed: 4 ranks' ranges read by 3).

checkpoint-<step>.pt (hetcomm.loop.checkpoint) is written by rank 0 once every rank has
written checkpoint-<step>.range-<rank>-of-<world>.pt: its range [start, stop) of the flat
parameter space and that range of each state tensor (the fp32 masters and AdamW's
moments), written atomically with the digests of every tensor and value, as the run's
checkpoint is, so a damaged or edited range is found when it is read. Reading checks
that the step's files are one world's, tile the parameters exactly, and are of this
model's parameter layout, then copies out the requested range.

torch.distributed.checkpoint (DCP) is the general engine for resharding, and it is not
used here. Measured (benchmarks/shard_checkpoint_dcp.py, 4 ranks holding 11/11/11/32
ranges of 4M elements under one key): its default planner takes the ranks' plain tensors
for one replicated tensor and silently saves rank 0's 676,923 elements only, the other
83% lost, found only when a load of the whole fails on the size; these files save all
4M in half DCP's time (0.035 s against 0.061 s) and read them back exactly. DCP would
need the chunk hooks of a tensor-like wrapper (or a DTensor, whose uneven shards follow
torch.chunk's sizes, not memory), and writes no digests and no atomic files, both of
which hetcomm's faults table relies on. The cost of the choice: every rank writes one
file and reads the files its new range overlaps (one or two when the layout is kept)."""

import re
from pathlib import Path

import torch
from torch import Tensor

from hetcomm.loop.checkpoint import NAME, CheckpointError, read, verify_digests, write_verified

FORMAT = 1
RANGE_NAME = re.compile(r"checkpoint-(\d+)\.range-(\d+)-of-(\d+)\.pt")


def range_path(directory: Path, step: int, rank: int, world: int) -> Path:
    return Path(directory) / f"checkpoint-{step:08d}.range-{rank}-of-{world}.pt"


def save_range(directory: Path, step: int, rank: int, world: int, start: int, stop: int, total: int,
               model_digest: str, tensors: dict[str, Tensor]) -> Path:
    """Writes this rank's range of the state (1-D tensors of stop - start elements each),
    atomically and with digests. Every rank calls it before rank 0 writes the step's
    checkpoint."""
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


def _files_of(directory: Path, step: int) -> dict[tuple[int, int], Path]:
    found = {}
    for path in Path(directory).glob(f"checkpoint-{step:08d}.range-*-of-*.pt"):
        match = RANGE_NAME.fullmatch(path.name)
        if match:
            found[(int(match.group(2)), int(match.group(3)))] = path
    return found


def load_range(directory: Path, step: int, start: int, stop: int, total: int, model_digest: str) -> dict[str, Tensor]:
    """The state of elements [start, stop), assembled from the ranges the step's ranks
    wrote. Raises CheckpointError naming the file and the fault: a missing, damaged or
    edited file, files of several world sizes, ranges with a gap or an overlap, or the
    state of another model."""
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
    # Every file's values are verified (the tiling and the model must hold for all); the
    # tensors only of the files this range overlaps, which are the only ones read. Each
    # file overlaps some rank's new range: every byte is verified by one rank.
    states = []
    for rank in range(world):
        path = files[(rank, world)]
        state = read(path, mmap=True)
        if not isinstance(state, dict) or state.get("format") != FORMAT or "digests" not in state \
                or not {"start", "stop", "total", "model", "tensors"} <= set(state):
            raise CheckpointError(f"{path}: not a range of sharded state of format {FORMAT}")
        overlaps = state["start"] < stop and start < state["stop"]
        verify_digests(path, state, values_only=not overlaps)
        if state["model"] != model_digest or state["total"] != total:
            raise CheckpointError(f"{path}: the state of another model (parameter layout {state['model']}, "
                                  f"{state['total']:,} elements); this run's model has layout {model_digest}, "
                                  f"{total:,} elements")
        states.append((path, state))
    expected = 0
    for path, state in states:
        if state["start"] != expected or state["stop"] < state["start"]:
            fault = "a gap" if state["start"] > expected else "an overlap"
            raise CheckpointError(f"{path}: its range [{state['start']}, {state['stop']}) leaves {fault} after "
                                  f"element {expected}; the ranges must tile the parameters in rank order")
        expected = state["stop"]
    if expected != total:
        raise CheckpointError(f"{where}: the ranges end at element {expected:,} of {total:,}")
    names = set(states[0][1]["tensors"])
    out = {}
    for path, state in states:
        if set(state["tensors"]) != names:
            raise CheckpointError(f"{path}: holds {sorted(state['tensors'])}, another range {sorted(names)}")
        low, high = max(start, state["start"]), min(stop, state["stop"])
        for name, tensor in state["tensors"].items():
            if name not in out:
                out[name] = torch.empty(stop - start, dtype=tensor.dtype)
            if low < high:
                out[name][low - start:high - start] = tensor[low - state["start"]:high - state["start"]]
    return out


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
