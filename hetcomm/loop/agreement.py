"""What every rank must agree on before the first step, checked with collectives so
that a problem on one rank stops every rank with the same message, not a hang."""

import torch
import torch.distributed as dist
from torch import nn

from hetcomm.amp import compute_precision


def agree_precision(device: torch.device, requested: str = "auto", group=None) -> str:
    """This rank's compute precision ("fp32", "fp16" or "bf16"): `requested` on every
    rank, or with "auto" the policy for its device's generation (hetcomm.amp). A
    precision one rank's device cannot run stops every rank with that rank's message."""
    try:
        mine, problem = compute_precision(device, requested), None
    except ValueError as error:
        mine, problem = None, str(error)
    problems: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(problems, problem, group=group)
    for rank, found in enumerate(problems):
        if found is not None:
            raise ValueError(f"rank {rank}: {found}")
    return mine


def check_same_values(values: dict[str, object], who: str, group=None) -> None:
    """Raises the same ValueError on every rank, naming each rank's value, unless every
    rank passed equal `values` (name -> value): ranks that differ in one of them would deal
    samples from different permutations (some dropped, some repeated, with no error) or
    wait in a collective the others never make, until the timeout."""
    everyone: list[dict | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, values, group=group)
    for name in values:
        seen = [theirs[name] for theirs in everyone]
        if any(value != seen[0] for value in seen):
            listed = ", ".join(f"rank {rank}: {value!r}" for rank, value in enumerate(seen))
            raise ValueError(f"{who}: {name} differs between ranks ({listed}); every rank must pass the same")


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _fingerprint(p: torch.Tensor) -> torch.Tensor:
    """Two int64 numbers that differ when the values differ: sums of the raw bits, plain
    and position-weighted. Integer sums are exact in any order, so different GPUs
    (whose float reductions add in different orders) agree on equal weights."""
    flat = p.detach().contiguous().reshape(-1)
    bits = flat.view(_BITS[flat.element_size()]).to(torch.int64)
    weights = torch.arange(bits.numel(), dtype=torch.int64, device=bits.device) % 1_000_003 + 1
    return torch.stack([bits.sum(), (bits * weights).sum()])


def check_same_parameters(model: nn.Module, group=None) -> None:
    """Raises ValueError on every rank, naming the first parameter that differs, unless
    every rank's model has the same parameters (names, shapes, values). Data-parallel
    ranks must start from the same weights; DDP copies rank 0's over the others, which
    would hide a model built from another seed or checkpoint (seed every rank alike, or
    load the same state, before building the loop)."""
    named = [(name, p) for name, p in model.named_parameters()]
    world = dist.get_world_size(group)
    shapes: list[list | None] = [None] * world
    dist.all_gather_object(shapes, [(name, tuple(p.shape)) for name, p in named], group=group)
    for rank, theirs in enumerate(shapes):
        if theirs != shapes[0]:
            differing = next((f"{a} vs {b}" for a, b in zip(shapes[0], theirs) if a != b),
                             f"{len(shapes[0])} vs {len(theirs)} parameters")
            raise ValueError(f"the model's parameters differ between rank 0 and rank {rank} ({differing}); every "
                             f"rank must build the same model")
    if not named:
        raise ValueError("the model has no parameters")
    device = named[0][1].device if dist.get_backend(group) != "gloo" else torch.device("cpu")
    prints = torch.stack([_fingerprint(p).to(device) for _, p in named])
    low, high = prints.clone(), prints.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN, group=group)
    dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group)
    differ = (low != high).any(dim=1).tolist()
    if any(differ):
        name = named[differ.index(True)][0]
        raise ValueError(f"the model's parameter {name!r} holds different values on different ranks; every rank "
                         f"must start from the same weights (seed every rank alike, or load the same checkpoint, "
                         f"before building the loop)")
