"""The items a loss averages over, counted per micro-batch and over all ranks."""

from collections.abc import Mapping

import torch
import torch.distributed as dist

from hetcomm.comm.collectives import gather_floats

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
    first = _first_tensor(batch)
    if first is None:
        raise ValueError("count_items: the batch holds no tensor to count samples by; pass count_items=... "
                         "(a function of a micro-batch returning the items its loss averages over)")
    return int(first.shape[0])


def total_items(local: float) -> float:
    """This step's items summed over all ranks (one small all-reduce)."""
    if not (dist.is_available() and dist.is_initialized()):
        return float(local)
    return sum(row[0] for row in gather_floats([local]))


def _first_tensor(batch):
    if torch.is_tensor(batch):
        return batch
    values = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (list, tuple)) else ()
    for value in values:
        found = _first_tensor(value)
        if found is not None:
            return found
    return None
