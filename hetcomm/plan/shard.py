"""The planner's model of sharded optimizer state (`hetcomm plan --shard`), the same
memory model the runtime (hetcomm.shard) keeps:

- every card holds the 16-bit weights and gradients (fp32 when the plan computes in
  fp32), a wire buffer of its own only when the wire's dtype differs from theirs, and the
  CUDA context;
- the fp32 masters and AdamW's two moments (12 bytes an element; 8 for fp32 weights,
  which are their own masters) live only on the owner of each range, plus one bucket of
  fp32 scratch for the owner's overflow check;
- each card's range is proportional to the memory it has left for that state once it
  holds its replicated part and one sample's activations, as the runtime's probe
  measures it (hetcomm.shard.layout sizes it, here as there); what the state leaves
  sets its largest micro-batch;
- a step reduce-scatters the gradients (owner-wise reduces: a ring all-reduce's first
  half of the bytes, overlapped with backward where the buckets go during it), each owner
  updates its range (the fused AdamW: 28 bytes an element, 16-bit or fp32 weights alike,
  at the card's memory bandwidth), and the new weights are all-gathered (the second half, after the update,
  never hidden). The update follows the reduction's barrier and the all-gather waits for
  the slowest owner: the step pays the slowest card's update once.
"""

from dataclasses import dataclass, replace

import torch

from hetcomm.plan.cost import BANDWIDTH_EFFICIENCY, BUCKET_BYTES, CONTEXT_BYTES, STORAGE, micro_batch_cap
from hetcomm.plan.model_shape import ModelShape
from hetcomm.shard.layout import ALIGN, bytes_needed, layout_by_memory

# The fused AdamW of an owner's range: the 16-bit reduced gradient read, the fp32 master
# and both moments read and written, the 16-bit weight written.
UPDATE_BYTES_PER_ELEMENT = 2 + 24 + 2


@dataclass(frozen=True)
class CardShard:
    """One card's part of a sharded plan."""

    weights_bytes: float
    gradient_bytes: float       # its gradients, and a wire buffer of its own if the dtypes differ
    state_bytes: float          # the masters and moments of its range, with the scratch
    elements: int               # its range
    left_for_state: float       # what it had for the state, as the runtime probe measures it


def weight_dtype(precision: str) -> torch.dtype:
    return torch.float32 if STORAGE[precision] == "fp32" else torch.float16


def replicated(parameters: int, precision: str, wire_bytes: int) -> tuple[float, float]:
    """Every card's weights, and its gradients with a wire buffer of their own if any."""
    item = 4 if STORAGE[precision] == "fp32" else 2
    return parameters * item, parameters * (item + (wire_bytes if wire_bytes != item else 0))


def shard_members(members, model: ModelShape, seq: int, wire_bytes: int):
    """The members' costs with the state sharded: (members that train, their CardShard,
    (member, reason) left out). ValueError when the cards together cannot hold the state."""
    parameters = model.parameters(seq)
    bucket = BUCKET_BYTES // 4
    fits, left_out, left = [], [], []
    for member in members:
        cost = member.cost
        weights, gradients = replicated(parameters, cost.precision, wire_bytes)
        dtype = weight_dtype(cost.precision)
        room = cost.memory_bytes - CONTEXT_BYTES - weights - gradients - cost.activation_bytes
        least = bytes_needed(min(ALIGN, parameters), dtype, bucket)
        if room < least:
            held = (CONTEXT_BYTES + weights + gradients) / 2**30
            left_out.append((member, f"its weights and gradients ({held:.1f} GiB with the context) and one sample's "
                                     f"activations ({cost.activation_bytes / 2**30:.2f} GiB) leave no room for a "
                                     f"range of the state in {cost.memory_bytes / 2**30:.1f} GiB"))
            continue
        fits.append(member)
        left.append(room)
    if not fits:
        return [], [], left_out
    dtypes = {weight_dtype(m.cost.precision) for m in fits}
    dtype = torch.float32 if dtypes == {torch.float32} else torch.float16
    layout = layout_by_memory([int(r) for r in left], parameters, dtype, bucket, "hetcomm plan --shard")
    trained, shards = [], []
    for member, room, size in zip(fits, left, layout.sizes()):
        cost = member.cost
        weights, gradients = replicated(parameters, cost.precision, wire_bytes)
        state = bytes_needed(size, dtype, bucket)
        held = CONTEXT_BYTES + weights + gradients + state
        # A measured card (a profile's) keeps its measured update, for its share of the elements.
        update = size * UPDATE_BYTES_PER_ELEMENT / (member.device.bandwidth_gbs * 1e9 * BANDWIDTH_EFFICIENCY) \
            if member.device else cost.update_seconds * size / parameters
        trained.append(replace(member, cost=replace(cost, state_bytes=held, update_seconds=update,
                                                    cap=micro_batch_cap(cost.memory_bytes, held,
                                                                        cost.activation_bytes))))
        shards.append(CardShard(weights, gradients, state, size, room))
    return trained, shards, left_out
