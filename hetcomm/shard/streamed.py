"""StreamedReducer: full sharding's gradients, never whole on any rank. As soon as a
layer unit's gradients of a micro-batch are in (hetcomm.shard.weights calls back), they
are packed into one wire buffer of the unit, the parameters' .grad are dropped, and
each owner's piece is reduced onto it; the owner adds what arrives into an fp32 sum of
its range. At most two units' wires are in flight: launching a third first waits for
the oldest and folds it in.

Weighting: a rank's micro-batch gradient must count as the loss summed over its items
divided by N, the step's items over all ranks, which is known only once every rank is
done. The loop divides each micro-batch's summed loss by C instead, an expected total
every rank passes alike before the step (hetcomm.comm.reducer's expected_total: the
previous step's N, or the step's samples), and the owner's sum is corrected by C / N
when it is unpacked, so the weighting is exact whatever C was; the handoff's and the
first step's changes of a rank's sample count change nothing already sent.

Every rank issues the same reduces in the same order: each unit once per backward,
every rank running as many micro-batches (hetcomm.loop pads a short share), on a
process group of their own."""

import time
from collections import deque

import torch
import torch.distributed as dist
from torch import Tensor

from hetcomm import ops
from hetcomm.comm.collectives import launch_all_reduce, wait
from hetcomm.comm.reducer import ReduceResult, _same_settings, scalar_on
from hetcomm.comm.weights import Agreement
from hetcomm.shard.flat import FlatParameters
from hetcomm.shard.layout import ShardLayout
from hetcomm.shard.reducer import ShardedReducer
from hetcomm.shard.weights import ShardedWeights

IN_FLIGHT = 2   # unit wires on their way at once


class StreamedReducer(ShardedReducer):
    """A ShardedReducer whose gradients are reduced onto their owners layer by layer
    during every micro-batch's backward (see the module). reduce() takes count=,
    grad_divisor= and expected_total= (the C the losses were divided by, and
    grad_divisor equal to it), and ends the step: the agreement, the correction by C / N,
    the overflow check and the norm of the owner's range. reduced_range() and
    reduced_scale() serve ShardedAdamW as the ShardedReducer's do."""

    who = "hetcomm.shard.StreamedReducer"
    streams = True   # the loop divides each micro-batch's loss by the expected total

    def __init__(self, flat: FlatParameters, layout: ShardLayout, weights: ShardedWeights, process_group=None,
                 wire_dtype: torch.dtype = torch.float16, bucket_cap_mb: float = 25.0, timeout=None,
                 gather_size: int = 0):
        if flat.grads is not None:
            raise ValueError(f"{self.who}: the flat parameters keep a whole gradient; make them with "
                             f"whole_grads=False")
        super().__init__(flat, layout, process_group, wire_dtype, bucket_cap_mb, overlap=False, timeout=timeout,
                         gather_size=gather_size)
        self.weights = weights
        self.grad_group = dist.new_group(backend=dist.get_backend(process_group))
        start, stop = self.range
        self.accumulator = torch.zeros(stop - start, dtype=torch.float32, device=flat.device)
        self._one = torch.ones(1, dtype=torch.float32, device=flat.device)
        self._in_flight: deque = deque()
        self.peak_wire_bytes = 0   # the most bytes of unit wires held at once
        weights.on_gradients = self._send_unit

    def _send_unit(self, unit) -> None:
        """Packs the unit's gradients into its wire, drops them, and launches the reduce
        of each owner's piece onto it."""
        while len(self._in_flight) >= IN_FLIGHT:
            self._fold(self._in_flight.popleft())
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in unit.members]
        wire = torch.empty(unit.stop - unit.start, dtype=self.wire_dtype, device=self.flat.device)
        if wire.numel():
            ops.pack([g.reshape(-1) for g in grads], self._one, out=wire)
        for p in unit.members:
            p.grad = None
        works = []
        for owner in range(self.layout.world):
            low, high = self.layout.range_of(owner)
            a, b = max(low, unit.start), min(high, unit.stop)
            if a < b:
                piece = wire[a - unit.start:b - unit.start]
                works.append((a, b, owner, dist.reduce(piece, dst=owner, group=self.grad_group, async_op=True)))
        self._in_flight.append((unit.start, wire, works))
        held = sum(w.numel() * w.element_size() for _, w, _ in self._in_flight)
        self.peak_wire_bytes = max(self.peak_wire_bytes, held)

    def _fold(self, entry) -> None:
        """Waits for a unit's reduces and adds this rank's pieces into its sum."""
        unit_start, wire, works = entry
        low = self.range[0]
        for a, b, owner, work in works:
            start = time.perf_counter()
            wait(work, self.timeout, f"{self.who}: the reduce of gradient elements {a}-{b} onto rank {owner}")
            self.weights.waited += time.perf_counter() - start
            if owner == self.rank:
                self.accumulator[a - low:b - low].add_(wire[a - unit_start:b - unit_start])

    def _fold_all(self) -> None:
        while self._in_flight:
            self._fold(self._in_flight.popleft())

    def zero_grads(self) -> None:
        """Before a step (or after a warm-up that must leave no trace): what is still on
        its way lands first, then the sum starts from zero."""
        self._fold_all()
        self.accumulator.zero_()
        self.flat.zero_grads()

    def begin(self, *args, **kwargs) -> None:
        raise RuntimeError(f"{self.who}: the gradients stream during every backward; call reduce() after the "
                           f"step's micro-batches, nothing before")

    def reduce(self, weight: float | None = None, *, count: float | None = None, grad_divisor: float | None = None,
               loss_scale: float | Tensor | None = None, gather=None, while_in_flight=None,
               expected_total: float | None = None) -> ReduceResult:
        if weight is not None or count is None or expected_total is None or grad_divisor != expected_total:
            raise ValueError(f"{self.who}: reduce() takes count=, and grad_divisor= and expected_total= both equal "
                             f"to the total the micro-batches' summed losses were divided by")
        self._check_start(None, float(count), grad_divisor)
        agreement = Agreement(float(count), True, self.control_group, self.who, None, gather, self.gather_size,
                              same=_same_settings(loss_scale, expected_total))
        self._fold_all()
        share = agreement.result(self.timeout)
        device = self.flat.device
        inv_scale = scalar_on(1.0 if loss_scale is None else loss_scale, device).reciprocal()
        inv_scale.mul_(float(expected_total) / share.total)   # divided by C where N was due
        if while_in_flight is not None:
            while_in_flight(share.gathered)
        found_inf, sq_norm = torch.zeros(1, device=device), torch.zeros(1, device=device)
        for start, stop, piece in self.reduced_range():
            ops.unpack_(piece, [self._scratch[:stop - start]], inv_scale, found_inf, sq_norm)
        verdict = torch.cat([found_inf, sq_norm]).to(torch.float64)
        wait(launch_all_reduce(verdict, self.group), self.timeout, f"{self.who}: the agreement on overflow and norm")
        self._inv_scale = inv_scale
        return ReduceResult(found_inf=(verdict[:1] > 0).to(torch.float32),
                            grad_norm=verdict[1].sqrt().to(torch.float32), weight=share.weight, total=share.total,
                            gathered=share.gathered)

    def reduced_range(self) -> list[tuple[int, int, Tensor]]:
        """(start, stop, values) of this rank's summed gradient, by bucket, in flat order:
        still multiplied by the loss scale and C / N (reduced_scale() undoes both)."""
        low = self.range[0]
        return sorted(((b.start, b.stop, self.accumulator[b.start - low:b.stop - low]) for b in self._mine),
                      key=lambda piece: piece[0])
