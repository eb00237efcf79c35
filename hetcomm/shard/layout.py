"""Which rank owns which range of the flat parameter space: sized by each rank's memory
left for the sharded state, not in equal shares.

Every rank keeps the model's weights and gradients whole (they are needed for its
forward and backward), unless the weights are fully sharded too (hetcomm.shard.weights:
then each rank keeps only its range of them); the state of the optimizer (fp32 masters
and AdamW's two moments) is kept only by the owner of each element. A rank's range is
proportional to the memory it has left for what it keeps per element, so that every
card's share fills the same part of what it has: a 32 GB card takes about three times an 11 GB card's range.

With the optimizer state offloaded (Shard(offload="optimizer")) the owner keeps its
range's masters and moments in host memory instead (host_bytes_per_element), and the
device pays only for what it still keeps per element: with full sharding the range's
weights and the fp32 gradient sum; with the state alone sharded, nothing. Those ranges
are then sized by `memory` read as each rank's share of its host's memory for the
offloaded state (layout_by_host_memory), or cut equal when none is given."""

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

# Range boundaries fall on multiples of this many elements (the last one excepted), so
# that every owner's slices start 16-byte aligned for the vectorised kernels.
ALIGN = 16


def state_bytes_per_element(weight_dtype: torch.dtype, weights: bool = False, streamed: bool = False,
                            offload: bool = False) -> int:
    """What the owner keeps per element on its device: fp32 masters and two fp32 moments
    for 16-bit weights; the moments alone for fp32 weights (the flat weights are the
    masters); none of them with `offload` (they are in host memory:
    host_bytes_per_element); with `weights` (full sharding) the weight itself, which no
    other rank keeps; with `streamed` gradients the fp32 sum of the gradients reduced
    onto it in a step."""
    state = 0 if offload else 8 if weight_dtype == torch.float32 else 12
    return state + (weight_dtype.itemsize if weights else 0) + (4 if streamed else 0)


def host_bytes_per_element(weight_dtype: torch.dtype) -> int:
    """What the owner keeps per element in host memory with the optimizer state offloaded
    (hetcomm.shard.ShardedAdamW(offload=True)): the fp32 params AdamW steps (the masters
    of 16-bit weights; of fp32 weights, a host copy of them), the two fp32 moments, the
    fp32 staging of the reduced gradient copied down, and for 16-bit weights their
    staging on the way up (the fused step writes them there): 18 bytes for 16-bit
    weights, 16 for fp32."""
    return 16 + (0 if weight_dtype == torch.float32 else weight_dtype.itemsize)


def scratch_elements(range_size: int, bucket_elements: int) -> int:
    """The owner's fp32 scratch for the overflow check and norm of its reduced range:
    one bucket's piece at a time."""
    return min(range_size, bucket_elements)


def bytes_needed(range_size: int, weight_dtype: torch.dtype, bucket_elements: int, weights: bool = False,
                 streamed: bool = False, offload: bool = False) -> int:
    """Device bytes a range of that many elements takes on its owner."""
    per = state_bytes_per_element(weight_dtype, weights, streamed, offload)
    return range_size * per + 4 * scratch_elements(range_size, bucket_elements)


@dataclass(frozen=True)
class ShardLayout:
    """The ranks' ranges of the flat parameter space: rank r owns elements
    [bounds[r], bounds[r + 1]); together they tile [0, total)."""

    bounds: tuple[int, ...]

    @property
    def total(self) -> int:
        return self.bounds[-1]

    @property
    def world(self) -> int:
        return len(self.bounds) - 1

    def range_of(self, rank: int) -> tuple[int, int]:
        return self.bounds[rank], self.bounds[rank + 1]

    def sizes(self) -> list[int]:
        return [b - a for a, b in zip(self.bounds, self.bounds[1:])]

    def owner_of(self, index: int) -> int:
        """The rank whose range holds element `index`."""
        for rank in range(self.world):
            if index < self.bounds[rank + 1]:
                return rank
        raise IndexError(f"element {index} is past the {self.total} elements")


def layout_from_sizes(sizes: Sequence[int], total: int, who: str) -> ShardLayout:
    """The layout of explicit range sizes (elements per rank, in rank order), which must
    cover the `total` parameters exactly, each rank owning at least one element."""
    sizes = list(sizes)
    if any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in sizes) or sum(sizes) != total:
        raise ValueError(f"{who}: ranges = {sizes!r}: expected one positive element count per rank adding up to "
                         f"the model's {total} trained elements (they add up to "
                         f"{sum(s for s in sizes if isinstance(s, int))})")
    return ShardLayout(tuple([0, *_running(sizes)]))


def layout_by_memory(memory: Sequence[int], total: int, weight_dtype: torch.dtype, bucket_elements: int,
                     who: str, weights: bool = False, streamed: bool = False, offload: bool = False) -> ShardLayout:
    """Ranges proportional to each rank's memory left for the sharded state (bytes, in
    rank order), each within what its rank can hold.

    Raises ValueError, naming the rank and the bytes it would need, when a rank cannot
    hold even the smallest range (ALIGN elements), and naming the shortfall when the
    ranks together cannot hold the state of all `total` elements."""
    capacity = []
    for rank, free in enumerate(memory):
        least = bytes_needed(min(ALIGN, total), weight_dtype, bucket_elements, weights, streamed, offload)
        if free < least:
            raise ValueError(f"{who}: rank {rank} has {_size(free)} left for the sharded optimizer state; its "
                             f"smallest range ({min(ALIGN, total)} elements) needs {least:,} bytes. Give that rank "
                             f"more memory (a smaller micro-batch, fewer other tensors) or leave it out")
        capacity.append(largest_range(free, weight_dtype, bucket_elements, weights, streamed, offload))
    if sum(capacity) < total:
        per = state_bytes_per_element(weight_dtype, weights, streamed, offload)
        raise ValueError(f"{who}: the ranks' memory left for the sharded state ({_size(sum(memory))} in all) holds the "
                         f"state of {sum(capacity):,} of the {total:,} trained elements; {per} bytes per element are "
                         f"needed, {_size((total - sum(capacity)) * per)} more. Add a card or train a smaller model")
    return _proportional(capacity, total, who)


def layout_by_host_memory(memory: Sequence[int] | None, world: int, total: int, weight_dtype: torch.dtype,
                          who: str) -> ShardLayout:
    """With the state alone sharded and offloaded, the device keeps nothing per element:
    ranges proportional to each rank's share of its host's memory for the offloaded state
    (bytes, in rank order: a machine's memory over its ranks), or equal ones (memory
    None). Raises ValueError, naming the shortfall, when the hosts cannot hold it all."""
    if memory is None:
        return _proportional([total] * world, total, who)
    per = host_bytes_per_element(weight_dtype)
    capacity = [int(free) // per for free in memory]
    if sum(capacity) < total:
        raise ValueError(f"{who}: the ranks' host memory for the offloaded optimizer state ({_size(sum(memory))} in "
                         f"all) holds the state of {sum(capacity):,} of the {total:,} trained elements; {per} bytes "
                         f"per element are needed, {_size((total - sum(capacity)) * per)} more")
    return _proportional(capacity, total, who)


def _proportional(capacity: Sequence[int], total: int, who: str) -> ShardLayout:
    """Ranges proportional to `capacity` (elements each rank can hold, adding up to at
    least `total`), floored to ALIGN, each within its capacity."""
    # Proportional shares floored to ALIGN (capacity >= share, as the capacities add up to
    # at least total); what flooring leaves goes ALIGN at a time to the ranks furthest
    # below their share.
    ideal = [total * c / sum(capacity) for c in capacity]
    sizes = [int(x) // ALIGN * ALIGN for x in ideal]
    left = total - sum(sizes)
    while left > 0:
        rank = max((r for r in range(len(sizes)) if sizes[r] < capacity[r]), key=lambda r: ideal[r] - sizes[r])
        more = min(left, ALIGN, capacity[rank] - sizes[rank])
        sizes[rank] += more
        left -= more
    if any(s == 0 for s in sizes):
        empty = [r for r, s in enumerate(sizes) if s == 0]
        raise ValueError(f"{who}: the model's {total} trained elements are too few to give ranks {empty} a range; "
                         f"train with fewer ranks or without sharding")
    return ShardLayout(tuple([0, *_running(sizes)]))


def largest_range(free: int, weight_dtype: torch.dtype, bucket_elements: int, weights: bool = False,
                  streamed: bool = False, offload: bool = False) -> int:
    """The most elements whose state fits `free` bytes (bytes_needed is monotone)."""
    per = state_bytes_per_element(weight_dtype, weights, streamed, offload)
    if per == 0:   # the scratch alone: any range once a bucket's scratch fits
        return free // 4 if free < 4 * bucket_elements else 2**62
    size = free // (per + 4)
    if size > bucket_elements:   # the scratch stops growing at one bucket
        size = max(bucket_elements, (free - 4 * bucket_elements) // per)
    return size


def _running(sizes: Sequence[int]) -> list[int]:
    out, total = [], 0
    for s in sizes:
        total += s
        out.append(total)
    return out


def _size(count: float) -> str:
    if count < 2**20:
        return f"{int(count):,} bytes"
    exponent = min(3, int(math.log(count, 1024)))
    return f"{count / 1024**exponent:.2f} {('B', 'KiB', 'MiB', 'GiB')[exponent]}"
