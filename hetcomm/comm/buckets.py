"""Cutting a parameter list into buckets for the all-reduce."""

from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass
class Bucket:
    """Parameters reduced by one all-reduce, and the wire buffer it reuses each step."""

    params: list[torch.nn.Parameter]
    numel: int
    wire: Tensor | None = field(default=None, repr=False)


# Like DDP: a small first bucket gets the wire busy early.
FIRST_BUCKET_BYTES = 2**20


def make_buckets(params: list[torch.nn.Parameter], cap_bytes: int) -> list[Bucket]:
    """Groups parameters into buckets of at most `cap_bytes` of gradient (a larger
    parameter gets a bucket of its own), in reverse order like DDP: backward produces
    the last layers' gradients first. The first bucket closes as soon as it holds 1 MB
    (or the cap): big enough that sending it covers the packing of the next one, small
    enough to start the wire early. Parameters on different devices never share a bucket."""
    buckets: list[Bucket] = []
    current: list[torch.nn.Parameter] = []
    current_bytes = 0
    for p in reversed(params):
        size = p.numel() * p.element_size()
        if buckets:
            full = current_bytes + size > cap_bytes
        else:
            full = current_bytes >= min(cap_bytes, FIRST_BUCKET_BYTES)
        if current and (full or p.device != current[0].device):
            buckets.append(Bucket(current, sum(q.numel() for q in current)))
            current, current_bytes = [], 0
        current.append(p)
        current_bytes += size
    if current:
        buckets.append(Bucket(current, sum(q.numel() for q in current)))
    return buckets
