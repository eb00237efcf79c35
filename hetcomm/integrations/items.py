"""The items a loss averages over, counted per micro-batch and over all ranks."""

from collections.abc import Mapping

import torch
import torch.distributed as dist

from hetcomm.comm.collectives import gather_floats
from hetcomm.loop.batches import first_tensor

IGNORE_INDEX = -100


def count_items(batch, shifted: bool = False) -> int:
    """Label positions that count (not -100) when the batch has labels (`shift_labels`
    as given, or labels[..., 1:] for a loss that shifts them, as a causal LM's does),
    else its samples: the first dimension of its first tensor."""
    if isinstance(batch, Mapping) and "labels" in batch and torch.is_tensor(batch["labels"]):
        labels = batch["shift_labels"] if "shift_labels" in batch else batch["labels"]
        if shifted and "shift_labels" not in batch:
            labels = labels[..., 1:]
        return int(labels.ne(IGNORE_INDEX).sum())
    first = first_tensor(batch)
    if first is None:
        raise ValueError("count_items: the batch holds no tensor to count samples by; pass count_items=... "
                         "(a function of a micro-batch returning the items its loss averages over)")
    return int(first.shape[0])


def total_items(local: float) -> float:
    """This step's items summed over all ranks (one small all-reduce)."""
    if not (dist.is_available() and dist.is_initialized()):
        return float(local)
    return sum(row[0] for row in gather_floats([local]))

