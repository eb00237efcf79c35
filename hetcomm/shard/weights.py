"""Fully sharded weights: each rank keeps only its own range of the flat weights; a
layer unit's weights are gathered from their owners before the unit's forward, freed
after it, gathered again before the unit's backward and freed once its gradients are in.

Gathering is one broadcast per owner of a piece of the unit, on a process group of its
own, into a buffer whose storage is freed (resized to nothing) in between. Every
parameter is a view of its unit's buffer for the whole run, so the tensors autograd
saves for the backward are views of that storage too: filling it again restores them,
without a version bump on the saved tensors (the copy goes through .data).

The next unit's gather is launched when a unit starts (the next in the forward, the
previous in the backward), so at most two layer units are gathered at a time, beside the
root unit (hetcomm.shard.units), which the model's forward and backward hold throughout.
The last layer stays gathered from its forward to its backward, which comes next.

Activation checkpointing (torch.utils.checkpoint, non-reentrant) recomputes a layer's
forward inside its backward, while the layer is gathered for it: the recompute gathers,
prefetches and frees nothing, so ranks that checkpoint and ranks that do not issue the
same collectives.

Collectives must come in the same order on every rank: every rank runs the same model
code on each micro-batch, and the loop gives every rank the same number of
micro-batches in a step (BalancedLoop pads a short share with a micro-batch whose loss
is multiplied by zero)."""

import contextlib
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten

from hetcomm.comm.collectives import wait
from hetcomm.shard.flat import FlatParameters
from hetcomm.shard.layout import ShardLayout
from hetcomm.shard.units import UnitPlan


@dataclass
class _Unit:
    index: int
    module: nn.Module
    start: int                  # the unit's elements [start, stop) of the flat space
    stop: int
    buffer: Tensor
    members: tuple[nn.Parameter, ...]   # its trained parameters, in flat order
    gathered: bool = False
    works: list = field(default_factory=list)   # broadcasts in flight into the buffer
    holders: int = 0            # forwards under way that use it
    grads_left: int = 0         # gradients still to come in this backward
    grads_sent: bool = False    # on_gradients was called for it in this backward

    @property
    def params(self) -> int:
        return len(self.members)

    @property
    def nbytes(self) -> int:
        return (self.stop - self.start) * self.buffer.element_size()


class ShardedWeights:
    """Shards the weights of `flat` (its parameters in `plan`'s unit order) by `layout`:
    this rank keeps elements layout.range_of(rank) in `local`, and every parameter
    becomes a view of its unit's buffer, filled only while the unit is in use.

    Outside a forward or backward the parameters hold no values: read or save the whole
    model inside `with weights.gathered():` (every rank enters it)."""

    who = "hetcomm.shard.ShardedWeights"

    def __init__(self, flat: FlatParameters, plan: UnitPlan, layout: ShardLayout, timeout: timedelta | None = None):
        if [id(p) for p in flat.params] != [id(p) for p in plan.flat_order()]:
            raise ValueError(f"{self.who}: the flat parameters must be in the units' order (UnitPlan.flat_order())")
        self.flat, self.layout, self.timeout = flat, layout, timeout
        self.rank = dist.get_rank()
        self.group = dist.new_group(backend=dist.get_backend())   # gathers keep their own order
        start, stop = layout.range_of(self.rank)
        self.local = flat.weights[start:stop].clone()
        self.range = (start, stop)
        self.units: list[_Unit] = []
        offset = 0
        for index, (module, params) in enumerate(zip(plan.modules, plan.params)):
            size = sum(p.numel() for p in params)
            buffer = torch.empty(size, dtype=flat.dtype, device=flat.device)
            unit = _Unit(index, module, offset, offset + size, buffer, tuple(params), grads_left=len(params))
            at = 0
            for p in params:
                p.data = buffer[at:at + p.numel()].view(p.shape)
                at += p.numel()
            buffer.untyped_storage().resize_(0)
            self.units.append(unit)
            offset += size
        flat.weights = None   # every parameter now lives in its unit's buffer
        flat.sharded = self
        self.peak_gathered = 0
        # Seconds this rank has spent blocked on gathers and on streamed gradients (which
        # add theirs here): waits for other ranks, not this rank's compute, which is what
        # balancing must time.
        self.waited = 0.0
        # Called with each unit once its gradients of a backward are in (every unit once a
        # backward, in the same order on every rank): hetcomm.shard.streamed sends them.
        self.on_gradients = None
        # Called with each unit before a gather of it fills its buffer: an optimizer that
        # defers each unit's update to then (ShardedAdamW's overlap) writes this rank's
        # part of the unit's weights there.
        self.before_gather = None
        self._in_backward = False
        self._handles = []
        for unit, params in zip(self.units, plan.params):
            self._handles.append(unit.module.register_forward_pre_hook(self._make_pre_forward(unit)))
            self._handles.append(unit.module.register_forward_hook(self._make_post_forward(unit)))
            if unit.index > 0:
                for p in params:
                    self._handles.append(p.register_post_accumulate_grad_hook(self._make_grad_in(unit)))

    # --- what the optimizer and the checkpoints use -----------------------------------

    def local_slice(self, start: int, stop: int) -> Tensor:
        """This rank's weights of flat elements [start, stop), within its range."""
        low, high = self.range
        if not low <= start <= stop <= high:
            raise IndexError(f"{self.who}: elements {start}-{stop} are outside this rank's range {low}-{high}")
        return self.local[start - low:stop - low]

    def gathered_bytes(self) -> int:
        """Bytes of gathered unit weights this rank holds now."""
        return sum(u.buffer.untyped_storage().nbytes() for u in self.units)

    def held_bytes(self) -> int:
        """Bytes of weights this rank holds now: its range, and the units gathered."""
        return self.local.numel() * self.local.element_size() + self.gathered_bytes()

    def largest_units(self, count: int) -> int:
        """Bytes of the `count` largest layer units (the root left out)."""
        sizes = sorted((u.nbytes for u in self.units[1:]), reverse=True)
        return sum(sizes[:count])

    @contextlib.contextmanager
    def gathered(self):
        """Every unit gathered (the whole model readable) inside the block; every rank
        must enter it, and must not change the weights there (the owners' ranges are
        what the next gather sends)."""
        for unit in self.units:
            self._gather(unit, now=True)
        try:
            yield
        finally:
            for unit in self.units:
                self._free(unit)

    def unit_by_unit(self):
        """Each unit gathered in turn, its trained parameters yielded while it is (every
        rank must go through all of it: each gather is a collective). At most one unit is
        held beyond what is gathered already, so that a model no card holds whole can
        still be read out, by a checkpoint for instance."""
        for unit in self.units:
            held = unit.gathered
            self._gather(unit, now=True)
            try:
                yield unit.members
            finally:
                if not held:
                    self._free(unit)

    # --- gathering --------------------------------------------------------------------

    def _gather(self, unit: _Unit, now: bool) -> None:
        if not unit.gathered:
            if self.before_gather is not None:
                # This rank's own work, the same whatever its samples: timed with the
                # waits, out of the compute the balancer splits by.
                start = time.perf_counter()
                self.before_gather(unit)
                self.waited += time.perf_counter() - start
            unit.buffer.untyped_storage().resize_(unit.nbytes)
            data = unit.buffer.data   # its own version counter: the saved views see no in-place change
            for owner in range(self.layout.world):
                low, high = self.layout.range_of(owner)
                a, b = max(low, unit.start), min(high, unit.stop)
                if a >= b:
                    continue
                piece = data[a - unit.start:b - unit.start]
                if owner == self.rank:
                    piece.copy_(self.local_slice(a, b))
                # The group holds every rank under its own number: `owner` is its rank in both.
                unit.works.append((a, b, owner, dist.broadcast(piece, src=owner, group=self.group, async_op=True)))
            unit.gathered = True
            self.peak_gathered = max(self.peak_gathered, self.gathered_bytes())
        if now:
            self._arrive(unit)

    def _arrive(self, unit: _Unit) -> None:
        if not unit.works:
            return
        start = time.perf_counter()
        for a, b, owner, work in unit.works:
            wait(work, self.timeout, f"{self.who}: the gather of elements {a}-{b} from rank {owner}")
        unit.works.clear()
        self.waited += time.perf_counter() - start

    def _free(self, unit: _Unit) -> None:
        if unit.gathered:
            self._arrive(unit)   # never free storage a broadcast is still writing
            unit.buffer.untyped_storage().resize_(0)
            unit.gathered = False

    # --- the hooks --------------------------------------------------------------------

    def _make_pre_forward(self, unit: _Unit):
        def pre_forward(module, args):
            self._gather(unit, now=True)
            if self._in_backward:
                # A checkpointed layer's recompute, for its own backward, which frees the layer
                # (grad_in): it holds nothing, as it may stop before its end (the
                # non-reentrant checkpoint stops once it has what the backward needs).
                return
            unit.holders += 1
            if unit.index + 1 < len(self.units):
                self._gather(self.units[unit.index + 1], now=False)   # the next layer's, while this one computes
        return pre_forward

    def _make_post_forward(self, unit: _Unit):
        def post_forward(module, args, output):
            if self._in_backward:
                return   # a recompute (see pre_forward)
            unit.holders -= 1
            if torch.is_grad_enabled():
                tensors = [t for t in tree_flatten(output)[0] if isinstance(t, Tensor) and t.requires_grad]
                for t in tensors:
                    t.register_hook(self._make_pre_backward(unit))
                if tensors and unit.index in (0, len(self.units) - 1):
                    # The root stays gathered until its backward is done, and the last layer,
                    # whose backward comes first, until its own: one gather fewer a micro-batch.
                    return
            if unit.holders == 0:
                self._free(unit)
        return post_forward

    def _make_pre_backward(self, unit: _Unit):
        def pre_backward(grad):
            if not self._in_backward:
                self._in_backward = True
                torch.autograd.Variable._execution_engine.queue_callback(self._after_backward)
            self._gather(unit, now=True)
            if unit.index > 1:
                self._gather(self.units[unit.index - 1], now=False)   # the layer whose backward comes next
            return grad
        return pre_backward

    def _make_grad_in(self, unit: _Unit):
        def grad_in(param):
            unit.grads_left -= 1
            if unit.grads_left == 0:
                unit.grads_left = unit.params
                self._gradients_in(unit)
                if unit.holders == 0:
                    self._free(unit)
        return grad_in

    def _gradients_in(self, unit: _Unit) -> None:
        if self.on_gradients is not None and not unit.grads_sent:
            unit.grads_sent = True
            self.on_gradients(unit)

    def _after_backward(self) -> None:
        """The end of a backward: the gradients of the units not yet passed on (the root,
        a unit some of whose parameters got none) go, in unit order; what is still
        gathered (the root, such a unit, a prefetch that was not used) is freed."""
        self._in_backward = False
        for unit in self.units:
            self._gradients_in(unit)
        for unit in self.units:
            unit.grads_left = unit.params
            unit.grads_sent = False
            if unit.holders == 0:
                self._free(unit)
