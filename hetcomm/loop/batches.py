"""Samples to a device batch: fetch, collate, check the batch's size, move."""

from collections.abc import Callable, Mapping

import torch


def micro_batches(indices: list[int], cap: int | None, first: int | None = None) -> list[list[int]]:
    """`indices` in runs of at most `cap` (None: one run); nothing for no indices. With
    `first`, the first run holds at most that many and the rest is cut as by itself."""
    if first is not None and first < len(indices) and (cap is None or first < cap):
        return [indices[:first], *micro_batches(indices[first:], cap)]
    if cap is None or len(indices) <= cap:
        return [indices] if indices else []
    return [indices[i:i + cap] for i in range(0, len(indices), cap)]


def _to_device(batch, device: torch.device):
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):   # dicts, and Hugging Face's BatchEncoding
        return {key: _to_device(value, device) for key, value in batch.items()}
    if isinstance(batch, (list, tuple)):
        moved = [_to_device(value, device) for value in batch]
        return type(batch)(*moved) if hasattr(batch, "_fields") else type(batch)(moved)
    return batch


def first_tensor(batch) -> torch.Tensor | None:
    """The first tensor of a batch (a tensor, or nested mappings, lists and tuples), or None."""
    if isinstance(batch, torch.Tensor):
        return batch
    values = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (list, tuple)) else ()
    for value in values:
        found = first_tensor(value)
        if found is not None:
            return found
    return None


def load_batch(dataset, collate_fn: Callable, indices: list[int], device: torch.device):
    """collate_fn of the samples at `indices` (through the dataset's __getitems__ when it
    has one, as a DataLoader does), on `device`. A collate_fn whose batch does not hold
    len(indices) samples (its first tensor's first dimension) is refused: the step's
    weights count the samples dealt, and a batch padded or cut would break them."""
    getitems = getattr(dataset, "__getitems__", None)
    samples = getitems(indices) if getitems is not None else [dataset[i] for i in indices]
    batch = collate_fn(samples)
    first = first_tensor(batch)
    if first is not None and (first.dim() == 0 or first.shape[0] != len(indices)):
        size = "a scalar" if first.dim() == 0 else f"{first.shape[0]} samples"
        raise ValueError(f"BalancedLoop: collate_fn returned a batch of {size} (its first tensor, shape "
                         f"{tuple(first.shape)}) for the {len(indices)} samples it was given; it must keep one row "
                         f"per sample")
    return _to_device(batch, device)
