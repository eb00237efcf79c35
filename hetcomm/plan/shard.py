"""The planner's model of sharded optimizer state (`hetcomm plan --shard`): the memory
model of the runtime (hetcomm.shard), whose own layout code sizes the ranges here.

Memory, per card:
- replicated: every trained parameter lives in one flat buffer of ONE weight dtype on
  every card (fp16; bf16 when every card is sm_80+ and computes in bf16; fp32 when every
  card computes in fp32 or tf32): the weights and the gradients (accumulated over
  micro-batches) whole, and a wire buffer of the whole size only when the wire's dtype
  differs from the weights' (otherwise the gradient buffer is reduced in place); and
  the CUDA context;
- sharded: the fp32 masters and AdamW's two fp32 moments of the card's own range only
  (12 bytes an element; 8 for fp32 weights, which are their own masters), and one
  bucket of fp32 scratch for the owner's overflow check (a bucket holds the 25 MiB cap
  in the weights' dtype: 13.1M elements, 50 MiB of fp32, for 16-bit weights);
- the activations of the card's planned micro-batch.

Ranges are proportional to each card's memory left for the state: usable memory less
the replicated part and its micro-batch's activations (the scratch comes off inside
hetcomm.shard.layout). The compute split (samples by speed) and the memory split (ranges
by memory) are separate decisions, made in this order:
1. with micro-batches of 1 every card has the most room; a card whose room cannot hold
   MIN_RANGE elements of state is left out, and the plan fails when the cards together
   cannot hold the state of every element;
2. the state then takes the share f = elements / (elements the rooms hold) of every
   card's room, and each card's micro-batch may grow into the rest: those are the caps
   under which the balancer's solver splits the global batch by speed;
3. each card's range is then proportional to what it has left beside its planned
   micro-batch (hetcomm.shard.layout.layout_by_memory, as the runtime calls it; the
   bytes it is given are what `hetcomm train --shard --state-memory` takes).

A step: the reduce-scatter (owner-wise reduces per bucket: (N-1)/N of the elements in
wire bytes per rank, half a ring all-reduce), the update of each owner's range (the fused
AdamW, 28 bytes an element at the card's memory bandwidth times the planner's efficiency
for memory-bound work), the all-gather (owner-wise broadcasts, the other half). The
update follows the reduction's barrier and the all-gather waits for the slowest owner,
so the step pays the slowest card's update once.
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from hetcomm.plan.catalog import Link
from hetcomm.plan.cost import BANDWIDTH_EFFICIENCY, BUCKET_BYTES, CONTEXT_BYTES, STORAGE, AllReduceCost
from hetcomm.plan.model_shape import ModelShape
from hetcomm.shard.layout import largest_range   # the runtime's own capacity rule
from hetcomm.shard.layout import bytes_needed, layout_by_memory, state_bytes_per_element

# The fused AdamW over an owner's range: the 16-bit reduced gradient read (2), the fp32
# master and both moments read and written (24), the 16-bit weight written (2).
UPDATE_BYTES_PER_ELEMENT = 2 + 24 + 2
# The smallest range worth a card: one with less room is left out of the shard.
MIN_RANGE = 1024
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
GIB = 2**30


class StateDoesNotFit(ValueError):
    """The cards together cannot hold the sharded state; `short` bytes are missing."""

    def __init__(self, message: str, short: float):
        super().__init__(message)
        self.short = short


@dataclass(frozen=True)
class CardShard:
    """One card's part of a sharded plan (bytes)."""

    micro_batch: int            # the planned micro-batch whose activations its range leaves room for
    weights_bytes: int
    gradient_bytes: int
    wire_bytes: int             # a wire buffer of its own (0: the gradients are reduced in place)
    context_bytes: float
    activation_bytes: float     # of its planned micro-batch
    free_bytes: int             # left for its range (state + scratch): what --state-memory gives the runtime
    elements: int               # its range of the flat parameter space
    state_bytes: int            # fp32 masters and moments of its range
    scratch_bytes: int          # the owner's fp32 scratch (one bucket at most)
    update_seconds: float       # the fused AdamW over its range

    @property
    def left_for_state(self) -> float:
        """Usable memory less the replicated part, the activations and the scratch."""
        return self.free_bytes - self.scratch_bytes

    @property
    def held_bytes(self) -> float:
        return (self.context_bytes + self.weights_bytes + self.gradient_bytes + self.wire_bytes + self.state_bytes
                + self.scratch_bytes + self.activation_bytes)


@dataclass(frozen=True)
class ShardPlan:
    """The sharded state of a plan: per training card its CardShard, in rank order."""

    weight_dtype: str
    bucket_elements: int
    state_bytes_per_element: int
    cards: tuple[CardShard, ...]
    reduce_scatter: AllReduceCost
    all_gather: AllReduceCost
    slowest_update: int          # the rank whose update the step waits for

    @property
    def elements(self) -> int:
        return sum(card.elements for card in self.cards)

    @property
    def state_memory_arg(self) -> str:
        """`hetcomm train --shard --state-memory` that gives the runtime these ranges."""
        return ",".join(str(card.free_bytes) for card in self.cards)


def weight_dtype(members) -> str:
    """The one dtype of the flat weights that every card shares."""
    if all(STORAGE[m.cost.precision] == "fp32" for m in members):
        return "fp32"
    if all(m.cost.precision == "bf16" and (m.device is None or m.device.capability >= (8, 0)) for m in members):
        return "bf16"
    return "fp16"


def replicated(parameters: int, weights: str, wire: str, wire_bytes: int) -> tuple[int, int, int]:
    """Every card's weights, gradients and wire buffer (0 when the wire is the gradients)."""
    item = DTYPES[weights].itemsize
    return parameters * item, parameters * item, 0 if wire == weights else parameters * wire_bytes


def bucket_elements(weights: str) -> int:
    """Elements of one bucket: the reducer's 25 MiB cap in the flat buffer's dtype."""
    return BUCKET_BYTES // DTYPES[weights].itemsize


def _free(member, held: float, micro: int) -> float:
    return member.cost.memory_bytes - held - member.cost.activation_bytes * micro


@dataclass(frozen=True)
class Room:
    """The first decision: who takes part, and each card's largest micro-batch."""

    members: list            # the cards in the shard, each with its cap set
    left_out: list           # (member, reason)
    weights: str
    held: tuple[int, int, int]   # weights, gradients, wire buffer
    capacity: list[int]      # elements each card's room holds at a micro-batch of 1


def shard_room(members, model: ModelShape, seq: int, wire: str, wire_bytes: int, who: str = "--shard") -> Room:
    """Steps 1 and 2 of the module's docstring. ValueError when no card has room, or
    when the cards together cannot hold the state (naming the bytes needed and short)."""
    missing = [m for m in members if not m.cost.memory_bytes]
    if missing:
        raise ValueError(f"{who} needs each card's memory, and {missing[0].label} has none known (a CPU rank, or a "
                         f"run's measured ranks: plan them with --cluster and --profile to calibrate)")
    parameters = model.parameters(seq)
    candidates = list(members)
    while True:   # leaving a card out can change the shared weight dtype (and so the room of the rest)
        weights = weight_dtype(candidates)
        held = replicated(parameters, weights, wire, wire_bytes)
        dtype, bucket = DTYPES[weights], bucket_elements(weights)
        least = bytes_needed(min(MIN_RANGE, parameters), dtype, bucket)
        fits = [m for m in candidates if _free(m, CONTEXT_BYTES + sum(held), 1) >= least]
        if not fits or len(fits) == len(candidates) or weight_dtype(fits) == weights:
            break
        candidates = fits
    left_out = []
    for m in members:
        if m not in fits:
            w, g, x = (b / GIB for b in held)
            free = _free(m, CONTEXT_BYTES + sum(held), 1)
            activations = m.cost.activation_bytes / GIB
            left_out.append((m, f"its weights ({w:.2f} GiB), gradients ({g:.2f} GiB)"
                                + (f", wire buffer ({x:.2f} GiB)" if x else "")
                                + f", the CUDA context and one sample's activations ({activations:.2f} GiB) leave "
                                  f"{max(free, 0) / GIB:.2f} GiB of its {m.cost.memory_bytes / GIB:.1f} GiB usable, "
                                  f"less than the {least:,} bytes of state of {MIN_RANGE} elements"))
    if not fits:
        return Room([], left_out, weights, held, [])
    dtype, bucket = DTYPES[weights], bucket_elements(weights)
    frees = [_free(m, CONTEXT_BYTES + sum(held), 1) for m in fits]
    capacity = [largest_range(int(f), dtype, bucket) for f in frees]
    if sum(capacity) < parameters:
        per = state_bytes_per_element(dtype)
        rooms = sum(max(0.0, f - 4 * min(c, bucket)) for f, c in zip(frees, capacity))
        cards = f"{len(fits)} cards have" if len(fits) > 1 else "card has"
        what = "fp32 moments" if weights == "fp32" else "fp32 masters and moments"
        raise StateDoesNotFit(f"{model.name} at --seq {seq} does not fit even with the optimizer state sharded: its "
                              f"{parameters:,} elements need {per} bytes each of {what}, "
                              f"{per * parameters / GIB:.2f} GiB, and the {cards} {rooms / GIB:.2f} GiB left for them "
                              f"once each holds its {weights} weights and gradients and one sample's activations "
                              f"({(per * parameters - rooms) / GIB:.2f} GiB short)", per * parameters - rooms)
    # Step 2: the state takes the same share of every card's room; micro-batches grow into the rest.
    share = parameters / sum(capacity)
    capped = []
    for member, free, room in zip(fits, frees, capacity):
        keep = min(room, max(min(MIN_RANGE, parameters), math.ceil(share * room)))
        activation = member.cost.activation_bytes
        micro = 1 + max(0, math.floor((free - bytes_needed(keep, dtype, bucket)) / activation)) if activation else 1
        while micro > 1 and largest_range(int(free - (micro - 1) * activation), dtype, bucket) < keep:
            micro -= 1
        capped.append(replace(member, cost=replace(member.cost, cap=micro)))
    return Room(capped, left_out, weights, held, capacity)


def shard_ranges(room: Room, micro_batches: Sequence[int], model: ModelShape, seq: int,
                 who: str = "hetcomm plan --shard") -> tuple[list, tuple[CardShard, ...]]:
    """Step 3: the ranges proportional to what each card has left beside its planned
    micro-batch; the members' costs with that memory (cap: the planned micro-batch) and
    their update over their range."""
    parameters = model.parameters(seq)
    dtype, bucket = DTYPES[room.weights], bucket_elements(room.weights)
    weights, gradients, wire = room.held
    frees = [int(_free(m, CONTEXT_BYTES + sum(room.held), micro)) for m, micro in zip(room.members, micro_batches)]
    layout = layout_by_memory(frees, parameters, dtype, bucket, who)
    members, cards = [], []
    for member, micro, free, size in zip(room.members, micro_batches, frees, layout.sizes()):
        state = size * state_bytes_per_element(dtype)
        scratch = bytes_needed(size, dtype, bucket) - state
        update = size * UPDATE_BYTES_PER_ELEMENT / (member.device.bandwidth_gbs * 1e9 * BANDWIDTH_EFFICIENCY)
        card = CardShard(micro, weights, gradients, wire, CONTEXT_BYTES, member.cost.activation_bytes * micro, free,
                         size, state, scratch, update)
        held = card.held_bytes - card.activation_bytes
        members.append(replace(member, cost=replace(member.cost, state_bytes=held, cap=micro, update_seconds=update)))
        cards.append(card)
    return members, tuple(cards)


def shard_collectives(ranks: int, parameters: int, weights: str, wire_bytes: int,
                      link: Link) -> tuple[AllReduceCost, AllReduceCost]:
    """The reduce-scatter and the all-gather: each half of a ring all-reduce's bytes,
    (N-1)/N of the elements per rank through the ring's slowest link, each bucket paying
    N-1 latencies; the buckets are the reducer's, cut at the owners' boundaries too."""
    if ranks < 2:
        none = AllReduceCost(0.0, 0.0, 0, "none")
        return none, none
    buckets = math.ceil(parameters / bucket_elements(weights)) + ranks - 1
    sent = (ranks - 1) / ranks * parameters * wire_bytes
    seconds = sent / (link.bandwidth_gbs * 1e9) + buckets * (ranks - 1) * link.latency_us * 1e-6
    return (AllReduceCost(seconds, sent, buckets, "owner-wise reduces"),
            AllReduceCost(seconds, sent, buckets, "owner-wise broadcasts"))
