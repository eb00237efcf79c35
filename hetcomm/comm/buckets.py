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


# Like DDP: a small first bucket gets the wire busy while the next one is packed.
FIRST_BUCKET_BYTES = 2**20


def make_buckets(params: list[torch.nn.Parameter], cap_bytes: int) -> list[Bucket]:
    """Groups parameters into buckets of at most `cap_bytes` of gradient (1 MB for the
    first; a larger parameter gets a bucket of its own), in reverse order like DDP:
    backward produces the last layers' gradients first. Parameters on different
    devices never share a bucket."""
    buckets: list[Bucket] = []
    current: list[torch.nn.Parameter] = []
    current_bytes = 0
    for p in reversed(params):
        size = p.numel() * p.element_size()
        cap = min(cap_bytes, FIRST_BUCKET_BYTES) if not buckets else cap_bytes
        if current and (current_bytes + size > cap or p.device != current[0].device):
            buckets.append(Bucket(current, sum(q.numel() for q in current)))
            current, current_bytes = [], 0
        current.append(p)
        current_bytes += size
    if current:
        buckets.append(Bucket(current, sum(q.numel() for q in current)))
    return buckets
