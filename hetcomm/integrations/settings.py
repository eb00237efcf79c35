"""What the integrations' arguments may be, checked when a trainer, strategy, batch
sampler or hook is built, before any step: a TypeError for a wrong type, a ValueError for
a value out of range or a combination that cannot work, each naming the argument and what
was expected. Knows nothing of any framework."""

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

from hetcomm.balance import equal_split
from hetcomm.balance.rebalancer import THRESHOLD
from hetcomm.comm.reducer import WIRE_DTYPES, check_wire_dtype as check_wire_on_group

BALANCE = ("dynamic", "static", "equal")


def check_choices(*, balance="dynamic", split=None, max_micro_batch=None, seed=0, drop_last=False, steps_ahead=0,
                  rebalance_threshold=THRESHOLD, who="hetcomm") -> None:
    """Each balancing argument on its own, before the ranks or the dataset are known."""
    if not isinstance(who, str):
        raise TypeError(f"who = {who!r}: expected a str (the name errors begin with)")
    if not isinstance(balance, str):
        raise TypeError(f"{who}: balance = {balance!r}: expected a str, one of {', '.join(BALANCE)}")
    if balance not in BALANCE:
        raise ValueError(f"{who}: balance = {balance!r}: expected one of {', '.join(BALANCE)}")
    if split is not None:
        _check_counts("split", split, who)
    if max_micro_batch is not None and not _is_integer(max_micro_batch):
        _check_counts("max_micro_batch", max_micro_batch, who)
    elif max_micro_batch is not None and max_micro_batch < 1:
        raise ValueError(f"{who}: max_micro_batch = {max_micro_batch!r}: expected a positive integer, or one per rank")
    if not _is_integer(seed):
        raise TypeError(f"{who}: seed = {seed!r}: expected an integer (the same on every rank)")
    if not isinstance(drop_last, bool):
        raise TypeError(f"{who}: drop_last = {drop_last!r}: expected a bool")
    _check_integer("steps_ahead", steps_ahead, 0, who)
    if isinstance(rebalance_threshold, bool) or not isinstance(rebalance_threshold, (int, float)):
        raise TypeError(f"{who}: rebalance_threshold = {rebalance_threshold!r}: expected a number (0.02 for 2%)")
    if not (math.isfinite(rebalance_threshold) and rebalance_threshold >= 0):
        raise ValueError(f"{who}: rebalance_threshold = {rebalance_threshold!r}: expected a finite, non-negative "
                         f"fraction (0.02 for 2%)")


def check_settings(dataset_size: int | None, global_batch: int, world: int, *, accumulation: int = 1,
                   balance: str = "dynamic", split=None, max_micro_batch=None, seed=0, drop_last: bool = False,
                   steps_ahead: int = 0, rebalance_threshold: float = THRESHOLD,
                   who: str = "hetcomm") -> tuple[tuple[int, ...] | None, list[int] | None]:
    """Everything BalancedBatches refuses (dataset_size None: all but what depends on the
    dataset); returns the fixed split and each rank's largest share (None for none)."""
    check_choices(balance=balance, split=split, max_micro_batch=max_micro_batch, seed=seed, drop_last=drop_last,
                  steps_ahead=steps_ahead, rebalance_threshold=rebalance_threshold, who=who)
    if dataset_size is not None:
        _check_integer("dataset_size", dataset_size, 1, who)
    _check_integer("global_batch", global_batch, 1, who)
    _check_integer("accumulation", accumulation, 1, who)
    if global_batch < world * accumulation:
        raise ValueError(f"{who}: the global batch of {global_batch} samples cannot give each of the {world} ranks "
                         f"one sample for each of its {accumulation} micro-batches; use a global batch of at least "
                         f"{world * accumulation}")
    if dataset_size is not None:
        _check_dataset(dataset_size, global_batch, world, accumulation, drop_last, who)
    fixed = _fixed_split(split, world, global_batch, accumulation, who)
    caps = _caps(max_micro_batch, world, accumulation, who)
    if caps is not None:
        _check_caps_hold(caps, fixed, balance, global_batch, world, accumulation, max_micro_batch, who)
    return fixed, caps


def check_wire_dtype(wire_dtype, who: str, group=None) -> None:
    """A dtype the wire can carry: float32, float16, or bfloat16 where the process group
    (when it exists already) is not Gloo's, as hetcomm's hooks require."""
    if not isinstance(wire_dtype, torch.dtype):
        raise TypeError(f"{who}: wire_dtype = {wire_dtype!r}: expected a torch.dtype (torch.float16, torch.float32, "
                        f"or torch.bfloat16 on NCCL)")
    if wire_dtype not in WIRE_DTYPES:
        raise ValueError(f"{who}: wire_dtype = {wire_dtype}: expected torch.float16, torch.float32 or torch.bfloat16 "
                         f"(bfloat16 on NCCL only)")
    if dist.is_available() and dist.is_initialized():
        check_wire_on_group(wire_dtype, group, who)


def check_bfloat16_backend(wire_dtype, backend: str | None, who: str) -> None:
    """The refusal of check_wire_dtype for a process group not yet made, of `backend`."""
    if wire_dtype == torch.bfloat16 and backend == "gloo":
        raise ValueError(f"{who}: the Gloo backend cannot all-reduce bfloat16; use wire_dtype=torch.float16 "
                         f"(with a loss scale) or torch.float32 on Gloo, or NCCL for a bfloat16 wire")


def check_count_items(count_items, who: str) -> None:
    if count_items is not None and not callable(count_items):
        raise TypeError(f"{who}: count_items = {count_items!r}: expected None or a function of a micro-batch "
                        f"returning the items its loss averages over")


def _is_integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_integer(name: str, value, least: int, who: str) -> None:
    if not _is_integer(value):
        raise TypeError(f"{who}: {name} = {value!r}: expected an integer of at least {least}")
    if value < least:
        raise ValueError(f"{who}: {name} = {value!r}: expected an integer of at least {least}")


def _check_counts(name: str, value, who: str) -> None:
    """A sequence of positive integers (a split, or one cap per rank)."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) \
            or not all(_is_integer(v) for v in value):
        raise TypeError(f"{who}: {name} = {value!r}: expected a sequence of integers, one per rank"
                        + (" (or one integer for all)" if name == "max_micro_batch" else ""))
    if not value or any(v < 1 for v in value):
        raise ValueError(f"{who}: {name} = {list(value)!r}: expected positive integers, one per rank")


def _check_dataset(dataset_size, global_batch, world, accumulation, drop_last, who) -> None:
    if global_batch > dataset_size:
        raise ValueError(f"{who}: the global batch of {global_batch} samples is larger than the dataset "
                         f"({dataset_size})")
    leftover = dataset_size % global_batch
    if not drop_last and 0 < leftover < world * accumulation:
        raise ValueError(f"{who}: the dataset's {dataset_size} samples leave {leftover} for an epoch's last step, "
                         f"fewer than one for each of the {accumulation} micro-batches on each of the {world} ranks "
                         f"({world * accumulation}); leave them out (drop_last, dataloader_drop_last) or change "
                         f"the global batch")


def _fixed_split(split, world, global_batch, accumulation, who) -> tuple[int, ...] | None:
    if split is None:
        return None
    split = tuple(split)
    if len(split) != world or any(b < accumulation for b in split) or sum(split) != global_batch:
        raise ValueError(f"{who}: split = {list(split)!r}: expected {world} integers of at least {accumulation} (one "
                         f"sample per micro-batch) adding up to the global batch {global_batch}")
    return split


def _caps(max_micro_batch, world, accumulation, who) -> list[int] | None:
    """Each rank's largest share: its largest micro-batch times the micro-batches."""
    if max_micro_batch is None:
        return None
    caps = [max_micro_batch] * world if _is_integer(max_micro_batch) else list(max_micro_batch)
    if len(caps) != world:
        raise ValueError(f"{who}: max_micro_batch = {max_micro_batch!r}: expected a positive integer, or one per "
                         f"rank ({world})")
    return [c * accumulation for c in caps]


def _check_caps_hold(caps, fixed, balance, global_batch, world, accumulation, max_micro_batch, who) -> None:
    """The shares fit the caps: the global batch, a fixed split, equal shares."""
    if sum(caps) < global_batch:
        raise ValueError(f"{who}: max_micro_batch = {max_micro_batch!r} x {accumulation} micro-batches holds at "
                         f"most {sum(caps)} samples over the {world} ranks, fewer than the global batch "
                         f"{global_batch}")
    if fixed is not None:
        shares, what = fixed, "split"
    elif balance == "equal":
        shares, what = equal_split(global_batch, world), "equal shares"
    else:
        return   # balancing starts from shares within the caps (BalancedBatches)
    if any(b > c for b, c in zip(shares, caps)):
        raise ValueError(f"{who}: {what} {list(shares)} of {global_batch} exceed max_micro_batch = "
                         f"{max_micro_batch!r} x {accumulation} micro-batches ({caps} per rank)")
