"""Cutting a parameter list into buckets for the all-reduce, at exact byte counts.

The gradients are taken in reverse order, like DDP (backward produces the last layers'
gradients first), as one stream of bytes per device, and cut into buckets of a planned
size regardless of where one parameter ends and the next begins: a parameter may span
two or more buckets, each holding a contiguous range of its flattened gradient. So the
sizes are what the pipeline wants, not what the layer shapes allow:

- the first bucket is small (1 MB): packing it is quick, so the wire starts early
  (during backward with overlap). Without overlap, a gradient that fits one bucket of the
  cap goes as one: it is all ready at once, packing it is quick, and one all-reduce fewer
  saves more (4 Gloo processes on 2 cores, 1.9 MB: 9.4 ms instead of 13.1 ms);
- the others are equal shares of the rest, at most the cap each: as few all-reduces as
  the cap allows (each costs its ring's 2(N-1) message latencies; a small last bucket
  to shorten the final unpack measured slower at 4 ranks on a 1 Gbit/s link), and no
  short remainder bucket.
"""

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property

import torch
from torch import Tensor

# The first bucket: big enough that sending it covers packing the next, small enough to
# start the wire early.
FIRST_BUCKET_BYTES = 2**20


@dataclass(frozen=True)
class Segment:
    """Elements [start, stop) of one parameter's flattened gradient."""

    param: torch.nn.Parameter
    start: int
    stop: int

    def grad(self) -> Tensor:
        """The range of the parameter's (contiguous) gradient, as a view that writes through."""
        return self.range_of(self.param.grad)

    def range_of(self, tensor: Tensor) -> Tensor:
        """The range of `tensor`, contiguous and of the parameter's size (its gradient, or
        its master copy's), as a view that writes through."""
        if self.start == 0 and self.stop == tensor.numel():
            return tensor
        return tensor.view(-1)[self.start:self.stop]


@dataclass
class Bucket:
    """Gradient ranges reduced by one all-reduce, and the wire buffer it reuses each step."""

    segments: list[Segment]
    numel: int
    wire: Tensor | None = field(default=None, repr=False)

    @cached_property
    def params(self) -> list[torch.nn.Parameter]:
        """The distinct parameters with a range here, in bucket order."""
        return list({id(s.param): s.param for s in self.segments}.values())

    def grads(self, masters: Mapping[int, Tensor] | None = None) -> list[Tensor]:
        """The ranges of the parameters' gradients; with `masters` (a tensor standing in
        for each parameter, by the parameter's id), of the masters' gradients instead."""
        if masters is None:
            return [s.grad() for s in self.segments]
        return [s.range_of(masters[id(s.param)].grad) for s in self.segments]


def bucket_budgets(total_bytes: int, cap_bytes: int, small_first: bool = True) -> list[int]:
    """The planned byte size of each bucket: a small first one, then equal shares of at
    most cap_bytes; without small_first, one bucket when the total fits the cap."""
    first = min(FIRST_BUCKET_BYTES, cap_bytes)
    if total_bytes <= first or (not small_first and total_bytes <= cap_bytes):
        return [total_bytes]
    rest = total_bytes - first
    count = math.ceil(rest / cap_bytes)
    share, extra = divmod(rest, count)
    return [first] + [share + 1] * extra + [share] * (count - extra)


def _cut(params: list[torch.nn.Parameter], cap_bytes: int, small_first: bool) -> list[Bucket]:
    """Buckets for parameters of one device, already in reverse order."""
    budgets = bucket_budgets(sum(p.numel() * p.element_size() for p in params), cap_bytes, small_first)
    buckets: list[Bucket] = []
    segments: list[Segment] = []
    room = budgets[0]
    for p in params:
        start, size = 0, p.element_size()
        while start < p.numel():
            # At least one element, so a bucket always advances; at most what fills it.
            take = min(p.numel() - start, max(1, room // size))
            segments.append(Segment(p, start, start + take))
            start += take
            room -= take * size
            if room <= 0 and len(buckets) + 1 < len(budgets):
                buckets.append(Bucket(segments, sum(s.stop - s.start for s in segments)))
                segments, room = [], budgets[len(buckets)]
    if segments:
        buckets.append(Bucket(segments, sum(s.stop - s.start for s in segments)))
    return buckets


def make_buckets(params: list[torch.nn.Parameter], cap_bytes: int, small_first: bool = True) -> list[Bucket]:
    """The buckets of `params`, in the order they are reduced (see the module
    docstring; small_first=False without overlap). Parameters on different devices
    never share a bucket."""
    buckets: list[Bucket] = []
    run: list[torch.nn.Parameter] = []
    for p in reversed(params):
        if run and p.device != run[0].device:
            buckets += _cut(run, cap_bytes, small_first)
            run = []
        run.append(p)
    if run:
        buckets += _cut(run, cap_bytes, small_first)
    return buckets
