"""What a training loop asks of sharding (Shard), and the ranks' agreement on the
layout: from memory given per rank, probed on each GPU, or explicit ranges."""

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from hetcomm.comm.collectives import control_device
from hetcomm.shard.flat import FlatParameters
from hetcomm.shard.layout import ShardLayout, layout_by_host_memory, layout_by_memory, layout_from_sizes

# What a probe leaves unclaimed of a GPU's free memory: the allocator's fragmentation and
# the transient buffers of a step (measured peaks move by a few percent between steps).
PROBE_MARGIN = 0.05


@dataclass(frozen=True)
class Shard:
    """Shard the optimizer state across the ranks (BalancedLoop(..., shard=Shard(...))).

    Args:
        memory: bytes each rank has left for the sharded state (fp32 masters and AdamW's
            moments of its range), in rank order, the same list on every rank. None: on
            GPUs, each rank measures its own after the model, its gradients and one
            micro-batch's activations; CPU ranks must be given it.
        ranges: instead of memory, the elements each rank owns, in rank order, adding up
            to the model's trained elements.
        micro_batch: the samples of the micro-batch whose activations a probe leaves room
            for; the memory caps probed afterwards fit what the state leaves.
        weights: shard the 16-bit weights too (hetcomm.shard.weights): each rank keeps
            its range of them, and each layer unit's weights are gathered for its forward
            and its backward only; `memory` then also pays for the range's weights.
        units: with weights, the layer modules gathered one at a time (default: the
            blocks of the model's largest nn.ModuleList; hetcomm.shard.units).
        gradients: with weights, "streamed" (each layer's gradient of each micro-batch
            is reduced onto its owners as soon as it is in, and freed: no rank holds the
            whole gradient; the owner sums its range in fp32) or "whole" (each rank
            accumulates the whole gradient over its micro-batches and reduces it once:
            fewer reductions when a step has several micro-batches, where memory allows).
        offload: "optimizer": the optimizer state of each range (fp32 masters, AdamW's
            moments) lives in the owner's host memory and is stepped there
            (ShardedAdamW(..., offload=True), which must be given it too). The ranges are
            then sized by what the device still keeps per element: with weights, the
            range's weights and the streamed gradients' fp32 sum (`memory` is device
            bytes, as without offload); with the state alone sharded the device keeps
            nothing per element, and `memory` is each rank's share of its host's memory
            for the offloaded state (18 bytes an element for 16-bit weights, 16 for
            fp32; hetcomm.shard.layout.host_bytes_per_element), or, without memory=,
            the ranges are equal (nothing is probed). A string and not a flag: it names
            what goes to the host, as `hetcomm plan`'s and `hetcomm train`'s
            `--offload optimizer` do.
    """

    memory: Sequence[int] | None = None
    ranges: Sequence[int] | None = None
    micro_batch: int = 1
    weights: bool = False
    units: Sequence[nn.Module] | None = None
    gradients: str = "streamed"
    offload: str | None = None

    @property
    def streamed(self) -> bool:
        """Whether the gradients are streamed onto their owners (full sharding's default)."""
        return self.weights and self.gradients == "streamed"

    @property
    def offloaded(self) -> bool:
        """Whether the optimizer state is kept in host memory (offload="optimizer")."""
        return self.offload == "optimizer"

    def __post_init__(self):
        if self.memory is not None and self.ranges is not None:
            raise ValueError("Shard: pass memory= or ranges=, not both")
        if self.memory is not None and any(isinstance(m, bool) or not isinstance(m, (int, float))
                                           or not math.isfinite(m) or m < 0 for m in self.memory):
            raise ValueError(f"Shard: memory = {list(self.memory)!r}: expected bytes per rank, finite and "
                             f"non-negative")
        if isinstance(self.micro_batch, bool) or not isinstance(self.micro_batch, int) or self.micro_batch < 1:
            raise ValueError(f"Shard: micro_batch = {self.micro_batch!r}: expected a positive integer")
        if not isinstance(self.weights, bool):
            raise ValueError(f"Shard: weights = {self.weights!r}: expected True (shard the weights too) or False")
        if self.gradients not in ("streamed", "whole"):
            raise ValueError(f"Shard: gradients = {self.gradients!r}: expected 'streamed' or 'whole'")
        if self.offload not in (None, "optimizer"):
            raise ValueError(f"Shard: offload = {self.offload!r}: expected None or 'optimizer' (the optimizer state "
                             f"in host memory)")
        if self.units is not None and not self.weights:
            raise ValueError("Shard: units are the layers whose weights are gathered; pass weights=True with them")


def probe_state_memory(device: torch.device, step: Callable[[], None] | None) -> int:
    """Bytes this GPU has left for the sharded state once `step` (one micro-batch's
    forward and backward) has run: what is free, less the step's peak beyond what it
    leaves allocated, less PROBE_MARGIN."""
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    if step is not None:
        step()
        torch.cuda.synchronize(device)
    activations = torch.cuda.max_memory_allocated(device) - before
    free, total = torch.cuda.mem_get_info(device)
    reserved = torch.cuda.memory_reserved(device)
    available = free + reserved - torch.cuda.memory_allocated(device)
    # A process held to part of the card (set_per_process_memory_fraction: a smaller card
    # emulated, or a GPU shared by several jobs) may allocate up to that part only.
    fraction = torch.cuda.get_per_process_memory_fraction(device)
    available = min(available, int(fraction * total) - torch.cuda.memory_allocated(device))
    return max(0, int((1 - PROBE_MARGIN) * available) - activations)


def agree_layout(shard: Shard, flat: FlatParameters, bucket_elements: int, who: str,
                 probe: Callable[[], int] | None = None) -> ShardLayout:
    """The layout every rank computes alike: from shard.ranges, shard.memory (checked the
    same on every rank), or every rank's probe() gathered. Errors are raised on every
    rank alike, before any step."""
    world = dist.get_world_size()
    host_sized = shard.offloaded and not shard.weights   # the device keeps nothing per element
    given = shard.ranges if shard.ranges is not None else shard.memory
    if given is not None:
        if len(given) != world:
            name = "ranges" if shard.ranges is not None else "memory"
            raise ValueError(f"{who}: shard.{name} has {len(given)} entries for {world} ranks; expected one per rank")
        # MAX of (x, -x): every rank learns the largest and the smallest, and judges alike.
        mine = torch.tensor([float(v) for v in given], dtype=torch.float64)
        bounds = torch.cat([mine, -mine]).to(control_device(None))
        dist.all_reduce(bounds, op=dist.ReduceOp.MAX)
        if not torch.equal(bounds[:world].cpu(), -bounds[world:].cpu()):
            raise ValueError(f"{who}: shard.{'ranges' if shard.ranges is not None else 'memory'} differs between "
                             f"ranks (this rank: {list(given)}); every rank must pass the same list")
        if shard.ranges is not None:
            return layout_from_sizes(list(shard.ranges), flat.total, who)
        memory = [int(m) for m in given]
    elif host_sized:
        return layout_by_host_memory(None, world, flat.total, flat.dtype, who)
    else:
        if flat.device.type != "cuda" or probe is None:
            raise ValueError(f"{who}: shard.memory is needed on {flat.device.type} ranks (bytes each rank has left "
                             f"for its range of the optimizer state); only GPUs are probed")
        memory = [0] * world
        dist.all_gather_object(memory, probe())
    if host_sized:
        return layout_by_host_memory(memory, world, flat.total, flat.dtype, who)
    return layout_by_memory(memory, flat.total, flat.dtype, bucket_elements, who, weights=shard.weights,
                            streamed=shard.streamed, offload=shard.offloaded)
