"""WeightedReducer: the weighted gradient all-reduce for custom training loops."""

import functools
import hashlib
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

from hetcomm import ops
from hetcomm.comm.buckets import Bucket, make_buckets
from hetcomm.comm.collectives import check_same_layout, control_device, launch_all_reduce, wait
from hetcomm.comm.weights import Agreement, Share, agree_share

WIRE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass
class ReduceResult:
    """What one reduce() found. Identical on every rank: it is computed from the
    all-reduced data."""

    found_inf: Tensor   # 1-element fp32: 1 if any reduced gradient is ±inf/NaN (skip the step)
    grad_norm: Tensor   # 0-dim fp32: L2 norm of the whole reduced, unscaled gradient (torch's clip API takes it)
    weight: float       # this rank's weight n_i / N
    total: float        # N when counts were given, else the sum of the weights
    gathered: list[list[float]] | None = None  # per rank, the gather= values it passed (gather_size > 0)


def _pack_weight(share: Share, grad_divisor: float | None) -> float:
    """The factor this rank's gradients are packed with: n_i / N for gradients of the
    mean over its n_i items, grad_divisor / N for their sum over grad_divisor."""
    return share.weight if grad_divisor is None else grad_divisor / share.total


def _same_settings(loss_scale: float | Tensor | None, expected_total: float | None = None) -> dict[str, float | Tensor]:
    """What every rank must pass alike in a step: the loss scale (the reduced gradient is
    unscaled by each rank's own, so another scale on one rank would leave its copy wrong,
    silently) and the expected total its buckets were packed by (0 for none: then they
    were packed by the agreed weight)."""
    return {"loss scales": 1.0 if loss_scale is None else loss_scale,
            "expected totals": 0.0 if expected_total is None else expected_total}


def _check_expected_total(expected_total, count, grad_divisor, who: str) -> None:
    if expected_total is None:
        return
    if count is None and grad_divisor is None:
        raise ValueError(f"{who}: expected_total goes with count= (and grad_divisor=), not weight=")
    if isinstance(expected_total, bool) or not isinstance(expected_total, (int, float)) \
            or not math.isfinite(expected_total) or expected_total <= 0:
        raise ValueError(f"{who}: expected_total = {expected_total!r}: expected a finite positive "
                         f"number (N's likely value, the same on every rank)")


def check_wire_dtype(wire_dtype: torch.dtype, group, who: str) -> None:
    if wire_dtype not in WIRE_DTYPES:
        raise ValueError(f"{who}: wire_dtype must be torch.float32, torch.float16 or torch.bfloat16; "
                         f"got {wire_dtype}")
    if wire_dtype == torch.bfloat16 and dist.get_backend(group) == "gloo":
        raise ValueError(f"{who}: the Gloo backend cannot all-reduce bfloat16; use wire_dtype=torch.float16 "
                         f"(with a loss scale) or torch.float32 on Gloo, or NCCL for a bfloat16 wire")


def scalar_on(value: float | Tensor, device: torch.device) -> Tensor:
    """A 1-element fp32 tensor on `device`; a fill kernel, not a host-to-device copy."""
    if isinstance(value, Tensor):
        return value.to(device=device, dtype=torch.float32).reshape(1)
    return torch.full((1,), float(value), dtype=torch.float32, device=device)


@dataclass
class _Step:
    """One reduction in progress, from begin() to finish()."""

    scale: Tensor            # this rank's weight, fused into pack
    inv_loss_scale: Tensor   # fused into unpack_
    found_inf: Tensor
    sq_norm: Tensor
    ready: list[set[int]]    # per bucket: the parameters whose gradient is final
    share: Share | None = None  # the agreed weights; before finish() at the latest
    works: list = field(default_factory=list)  # the launched all-reduces, in bucket order
    # With an expected total C: (the numerator the buckets are packed by over C, C).
    expected: tuple[float, float] | None = None
    may_send: Callable[[], bool] | None = None   # asked before the hooks send; None: they may


class WeightedReducer:
    """Reduces the gradients of `params` across the ranks of `process_group` so that
    every rank ends with sum_i w_i g_i, w_i = n_i / N: the gradient of the mean loss over
    the union of all ranks' samples, however unevenly they were split.

    Each bucket of gradients (about `bucket_cap_mb` MB) is packed onto the wire with
    the weight fused in, its all-reduce is launched at once so packing the next bucket
    overlaps it, and it is unpacked with the loss scale removed, the overflow check
    and the squared norm fused in.

    Without overlap, call ``reduce(weight=...)`` after backward. With ``overlap=True``
    the buckets are launched during backward, as soon as all their gradients are
    final (in bucket order, the same on every rank, as DDP does): call
    ``begin(weight=...)`` before the backward of the step's last micro-batch and
    ``finish()`` after it. A parameter that gets no gradient in a step holds its bucket,
    and the buckets after it, until finish(); leave such parameters out of `params`
    when they are never used.

    With counts, the weights n_i / N need N, which the ranks agree on; before that, a
    bucket can go packed by n_i / C, C an expected total that every rank passes alike
    (the previous step's N, say): the sum of the ranks' buckets is then off from the
    weighted one by the common factor N / C, which unpacking takes out. So with
    ``expected_total=C`` the agreement (and with it the counts, which may be known only
    after backward, and the gathered numbers) comes after the buckets, not before them:
    with overlap=True, ``begin(grad_divisor=d, expected_total=C)`` before the last
    backward and ``reduce(count=n, grad_divisor=d, expected_total=C, ...)`` after it,
    with no round trip between the ranks before backward. Keep C near N: with a 16-bit
    wire, a C far under N scales the packed values up by N / C towards overflow.

    Args:
        params: the parameters, in the same order on every rank (checked at the first reduce).
        process_group: the group to reduce over (default: the world).
        wire_dtype: float32, float16 or bfloat16 (not on Gloo). A 16-bit wire halves the bytes;
            use a loss scale with float16 so small gradients do not underflow.
        bucket_cap_mb: gradient megabytes per all-reduce at most; the first holds 1 MB, the others
            equal shares, except that without overlap a gradient within the cap goes as one
            (hetcomm.comm.buckets: cut at exact byte counts, across parameters).
        overlap: launch buckets from gradient hooks during backward.
        master_params: fp32 copies of the parameters that require grad (same order and shapes;
            the optimizer's), for a model that computes in 16-bit: the reduced gradient is
            unpacked into the masters' .grad, where the unscaled values keep fp32's range and
            precision; the 16-bit parameters' own gradients keep their local values.
        timeout: how long to wait for any collective before raising CollectiveTimeout
            (default: the process group's own timeout).
        gather_size: how many numbers each rank sends along with every step's agreement on the
            weights (reduce(..., gather=[...]) or begin(...)); every rank gets all ranks' numbers in
            result.gathered, exactly as sent (float64), without a collective of their own: per-step
            statistics such as compute times, which a trainer would otherwise gather in an extra
            round trip. Checked equal on every rank at the first reduce.
    """

    who = "hetcomm.WeightedReducer"

    def __init__(self, params: Iterable[torch.nn.Parameter], process_group=None,
                 wire_dtype: torch.dtype = torch.float16, bucket_cap_mb: float = 25.0, overlap: bool = False,
                 timeout: timedelta | None = None, master_params: Iterable[Tensor] | None = None,
                 gather_size: int = 0):
        if not dist.is_initialized():
            raise RuntimeError(f"{self.who}: torch.distributed is not initialised; call "
                               f"dist.init_process_group first (torchrun sets up its environment)")
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError(f"{self.who}: params holds no parameter that requires grad")
        if not (isinstance(bucket_cap_mb, (int, float)) and math.isfinite(bucket_cap_mb) and bucket_cap_mb > 0):
            raise ValueError(f"{self.who}: bucket_cap_mb must be a finite positive number; got {bucket_cap_mb!r}")
        self.group = process_group
        self.control_group = None   # made at the first reduce, once every rank has shown up
        check_wire_dtype(wire_dtype, process_group, self.who)
        self.wire_dtype = wire_dtype
        self.overlap = overlap
        self.timeout = timeout
        self.masters = None if master_params is None else self._check_masters(list(master_params))
        if isinstance(gather_size, bool) or not isinstance(gather_size, int) or gather_size < 0:
            raise ValueError(f"{self.who}: gather_size must be a non-negative integer; got {gather_size!r}")
        self.gather_size = gather_size
        self.bucket_cap_mb = bucket_cap_mb
        self.buckets: list[Bucket] = self._make_buckets()
        self._layout_checked = False
        self._step: _Step | None = None
        self._next_launch = 0
        self._hooks = []
        if overlap:
            # A parameter may span several buckets; its hook marks it ready in each.
            holders: dict[int, list[int]] = {}
            for index, bucket in enumerate(self.buckets):
                for p in bucket.params:
                    holders.setdefault(id(p), []).append(index)
            self._hooks = [p.register_post_accumulate_grad_hook(functools.partial(self._grad_ready, holders[id(p)]))
                           for p in self.params]

    def _make_buckets(self) -> list[Bucket]:
        return make_buckets(self.params, int(self.bucket_cap_mb * 2**20), small_first=self.overlap)

    def reduce(self, weight: float | None = None, *, count: float | None = None, grad_divisor: float | None = None,
               loss_scale: float | Tensor | None = None, gather: Iterable[float] | None = None,
               while_in_flight: Callable[[list[list[float]] | None], None] | None = None,
               expected_total: float | None = None) -> ReduceResult:
        """begin() and finish() in one call, after backward. With overlap=True, after
        begin(grad_divisor=..., expected_total=...) it ends that step; without it, the
        buckets all go now, as without overlap.

        With weight= the buckets are sent at once and the ranks' agreement on the weights
        travels ahead of them, read before anything is unpacked, so its round trip is not
        on the critical path; a bad verdict still raises on every rank with every gradient
        as it was. With count= the agreement must come first, as it yields N, unless
        expected_total= is given (see the class): then it goes as with weight=.

        while_in_flight: called with every rank's gathered numbers (result.gathered; None
        without gather_size) once the agreement is in and checked, while the buckets are
        still travelling, so that bookkeeping which needs only those numbers (a trainer's
        choice of the next split, itself a collective) hides behind the all-reduce. Every
        rank must pass one. Should it raise, the all-reduces are waited for, no gradient
        has been unpacked, and its exception propagates.
        """
        if self._step is not None and self._step.expected is not None:
            # The buckets may be on their way: a fault goes through the agreement, to every rank.
            fault = None if weight is None and count is not None and expected_total is not None else \
                "after begin(grad_divisor=..., expected_total=...), reduce() takes count= and the same " \
                "grad_divisor= and expected_total="
            return self._reduce_by_expected(0.0 if count is None else float(count), grad_divisor,
                                            self._step.expected[1] if expected_total is None else float(expected_total),
                                            loss_scale, gather, while_in_flight, fault)
        self._check_start(weight, count, grad_divisor)
        _check_expected_total(expected_total, count, grad_divisor, self.who)
        if expected_total is not None:
            return self._reduce_by_expected(float(count), grad_divisor, float(expected_total), loss_scale, gather,
                                            while_in_flight)
        # After backward the gradients present are known, so which parameters no rank has a
        # gradient for rides in the agreement instead of a collective of its own.
        agreement = Agreement(float(weight if count is None else count), count is not None, self.control_group,
                              self.who, [p.grad is not None for p in self.params], gather,
                              self.gather_size, same=_same_settings(loss_scale))
        missing = [p for p in self.params if p.grad is None]
        if count is None:
            self._step = self._new_step(float(weight), loss_scale)
            self._launch_all()
            try:
                self._step.share = agreement.result(self.timeout)
            except ValueError:
                self._abandon(missing)
                raise
        else:
            try:
                share = agreement.result(self.timeout)
            except ValueError:
                if agreement.mixed or agreement.others_sent_early:
                    # The ranks that passed weight= or expected_total= have sent their buckets already:
                    # send as many so that every rank has issued the same collectives and the group
                    # stays usable.
                    self._abandon([], [self._send(b) for b in self.buckets])
                raise
            self._step = self._new_step(_pack_weight(share, grad_divisor), loss_scale)
            self._step.share = share
            if while_in_flight is not None:
                self._launch_all()
        if while_in_flight is not None:
            try:
                while_in_flight(self._step.share.gathered)
            except BaseException:
                self._abandon(missing)
                raise
        return self.finish()

    def _reduce_by_expected(self, count: float, grad_divisor: float | None, expected_total: float,
                            loss_scale, gather, while_in_flight, problem: str | None = None) -> ReduceResult:
        """reduce() with buckets packed by (grad_divisor or count) / expected_total, sent
        before the agreement, and unpacked with expected_total / N taken out."""
        numerator = float(count if grad_divisor is None else grad_divisor)
        step = self._step
        if step is None:
            step = self._step = self._new_step(numerator / expected_total, loss_scale)
            step.expected = (numerator, expected_total)
        elif problem is None and step.expected != (numerator, expected_total):
            problem = (f"reduce(grad_divisor={grad_divisor}, expected_total={expected_total}) does not match "
                       f"begin(grad_divisor={step.expected[0]:g}, expected_total={step.expected[1]:g}), by which "
                       f"the buckets were packed")
        if loss_scale is not None:
            step.inv_loss_scale = scalar_on(loss_scale, step.inv_loss_scale.device).reciprocal()
        used_here = [p.grad is not None for p in self.params]
        missing = [p for p in self.params if p.grad is None]
        agreement = Agreement(count, True, self.control_group, self.who, used_here, gather, self.gather_size,
                              same=_same_settings(loss_scale, expected_total), problem=problem)
        self._launch_all()
        try:
            step.share = agreement.result(self.timeout)
        except ValueError:
            self._abandon(missing)
            raise
        # Packed by numerator / C where numerator / N was due, the same C on every rank.
        step.inv_loss_scale.mul_(expected_total / step.share.total)
        if while_in_flight is not None:
            try:
                while_in_flight(step.share.gathered)
            except BaseException:
                self._abandon(missing)
                raise
        return self.finish()

    def _launch_all(self) -> None:
        while self._next_launch < len(self.buckets):
            self._launch_next(self._step)

    def begin(self, weight: float | None = None, *, count: float | None = None, grad_divisor: float | None = None,
              loss_scale: float | Tensor | None = None, gather: Iterable[float] | None = None,
              expected_total: float | None = None, may_send: Callable[[], bool] | None = None) -> None:
        """Agrees with the other ranks on this step's weights; with overlap=True, arms
        the gradient hooks for the coming backward. With expected_total (and grad_divisor
        alone), only arms them, for buckets packed by grad_divisor / expected_total: no
        collective; reduce(count=..., grad_divisor=..., expected_total=...) ends the step,
        or disarm() while no bucket has left.

        Args:
            weight: this rank's share n_i / N of the global batch; the weights of all ranks
                must add up to 1.
            count: instead of weight, this rank's n_i (samples, or tokens that carry loss);
                N is obtained in the same tiny all-reduce.
            grad_divisor: with count, what the local gradients were divided by, when that
                is not n_i: they hold the loss summed over the n_i items / grad_divisor (a
                divisor fixed before backward, when n_i is known only after it, as for
                masked tokens); they are weighted by grad_divisor / N.
            loss_scale: the factor the local gradients carry (the loss was multiplied by
                it before backward); divided out while unpacking.
            gather: gather_size numbers of this rank's, returned to every rank in the
                result's gathered (see the class).
            expected_total: N's likely value, the same on every rank (see the class).
            may_send: with expected_total, asked at each gradient hook until it says True:
                till then the final buckets wait (for a fact the rank learns during backward,
                such as whether more samples are to come); reduce() sends what is left.

        Raises the same ValueError on every rank if any rank's weight, count or gather is bad.
        """
        if expected_total is not None:
            if weight is not None or count is not None or gather is not None or loss_scale is not None \
                    or grad_divisor is None or (may_send is not None and not callable(may_send)):
                raise ValueError(f"{self.who}: begin(expected_total=...) takes grad_divisor= alone; count=, "
                                 f"loss_scale= and gather= go to reduce() after backward")
            if not self.overlap:
                raise ValueError(f"{self.who}: begin(expected_total=...) arms the gradient hooks of overlap=True; "
                                 f"without overlap pass expected_total to reduce()")
            self._check_start(None, 1.0, grad_divisor)
            _check_expected_total(expected_total, None, grad_divisor, self.who)
            self._step = self._new_step(grad_divisor / expected_total, None)
            self._step.expected = (float(grad_divisor), float(expected_total))
            self._step.may_send = may_send
            return
        if may_send is not None:
            raise ValueError(f"{self.who}: may_send goes with expected_total")
        self._check_start(weight, count, grad_divisor)
        share = agree_share(float(weight if count is None else count), count is not None, self.control_group,
                            self.timeout, self.who, gathered=gather, gather_size=self.gather_size,
                            same=_same_settings(loss_scale))
        self._step = self._new_step(_pack_weight(share, grad_divisor), loss_scale)
        self._step.share = share

    def _check_start(self, weight, count, grad_divisor) -> None:
        if (weight is None) == (count is None):
            raise ValueError(f"{self.who}: pass exactly one of weight= and count=")
        if grad_divisor is not None:
            if count is None:
                raise ValueError(f"{self.who}: grad_divisor goes with count=, not weight=")
            if isinstance(grad_divisor, bool) or not isinstance(grad_divisor, (int, float)) \
                    or not math.isfinite(grad_divisor) or grad_divisor <= 0:
                raise ValueError(f"{self.who}: grad_divisor = {grad_divisor!r}: expected a finite positive number")
        if self._step is not None:
            raise RuntimeError(f"{self.who}: begin() called twice; call finish() to end the previous step")
        if not self._layout_checked:
            check_same_layout(self.params, self.group, self.timeout, self.who, self.gather_size, self._settings())
            self._layout_checked = True
            # The ranks agree on their weights over connections of their own: on the gradients'
            # connections that tiny all-reduce queues behind megabytes of buckets (measured on a
            # 1 Gbit/s link: about 2% of a 4-rank sync). Made after the layout check, which every
            # rank has just passed, so no rank can be missing; only the group's ranks take part.
            ranks = dist.get_process_group_ranks(self.group or dist.group.WORLD)
            self.control_group = dist.new_group(ranks, backend=dist.get_backend(self.group),
                                                use_local_synchronization=True)

    def _settings(self) -> dict[str, tuple[int, str]]:
        """What every rank must have set alike before any bucket is sent: a bucket of
        another size or dtype on one rank would make the all-reduce fail or mix
        unrelated values. Name -> (a number to compare, this rank's setting in words)."""
        layout = hashlib.sha256(repr([b.numel for b in self.buckets]).encode()).digest()
        return {"wire_dtype": (WIRE_DTYPES.index(self.wire_dtype), str(self.wire_dtype)),
                "overlap": (int(self.overlap), str(self.overlap)),
                "bucket layout (bucket_cap_mb)": (int.from_bytes(layout[:8], "little") >> 2,
                                                  f"{len(self.buckets)} buckets of {self.bucket_cap_mb:g} MB at most")}

    def _new_step(self, weight: float, loss_scale: float | Tensor | None) -> _Step:
        device = self.params[0].device
        self._next_launch = 0
        return _Step(scale=scalar_on(weight, device),
                     inv_loss_scale=scalar_on(1.0 if loss_scale is None else loss_scale, device).reciprocal(),
                     found_inf=torch.zeros(1, device=device), sq_norm=torch.zeros(1, device=device),
                     ready=[set() for _ in self.buckets])

    def _abandon(self, missing: list[torch.nn.Parameter], works: list | None = None) -> None:
        """After a refused agreement: waits for the all-reduces already sent (the group
        must stay in step), gives back None to the gradients that were None, and forgets
        the step. The gradients themselves were only read."""
        pending = self._step.works if works is None else works
        for index, work in enumerate(pending):
            wait(work, self.timeout, f"{self.who}: the all-reduce of bucket {index}")
        for p in missing:
            p.grad = None
        self._step = None

    def _wire(self, bucket: Bucket) -> Tensor:
        if bucket.wire is None:
            bucket.wire = torch.empty(bucket.numel, dtype=self.wire_dtype, device=bucket.segments[0].param.device)
        return bucket.wire

    def finish(self) -> ReduceResult:
        """Launches the buckets not launched yet, waits for all, unpacks them into the
        gradients and returns what the step found (the same on every rank).

        A parameter whose grad is None on this rank contributes zeros; one whose grad is
        None on every rank keeps grad None, as under DDP.
        """
        step = self._step
        if step is None:
            raise RuntimeError(f"{self.who}: finish() without begin()")
        users = step.share.users
        if users is None:
            # With overlap, begin() came before backward: agree now on which parameters no rank
            # has a gradient for, queued behind the gradients so that unpacking hides it.
            flags = torch.tensor([p.grad is not None for p in self.params], dtype=torch.int32,
                                 device=control_device(self.group))
        self._launch_all()
        flags_work = launch_all_reduce(flags, self.group) if users is None else None
        if self.masters is not None:
            for master in self.masters.values():
                if master.grad is None or not master.grad.is_contiguous():
                    master.grad = torch.empty_like(master)   # every element is unpacked into
        for index, (bucket, work) in enumerate(zip(self.buckets, step.works)):
            wait(work, self.timeout, f"{self.who}: the all-reduce of bucket {index}")
            ops.unpack_(bucket.wire, bucket.grads(self.masters), step.inv_loss_scale, step.found_inf, step.sq_norm)
        if flags_work is not None:
            wait(flags_work, self.timeout, f"{self.who}: the agreement on unused parameters")
            users = flags.tolist()
        for p, count in zip(self.params, users):
            if count == 0:
                p.grad = None
                if self.masters is not None:
                    self.masters[id(p)].grad = None
        self._step = None
        return ReduceResult(found_inf=step.found_inf, grad_norm=step.sq_norm.sqrt().reshape(()),
                            weight=step.share.weight, total=step.share.total, gathered=step.share.gathered)

    def _check_masters(self, masters: list[Tensor]) -> dict[int, Tensor]:
        """master_params by the id of the parameter each stands for, after checking that
        they can: one contiguous float tensor per parameter, of its shape, on its device."""
        if len(masters) != len(self.params):
            raise ValueError(f"{self.who}: master_params holds {len(masters)} tensors for {len(self.params)} "
                             f"parameters that require grad; expected one per parameter, in the same order")
        for i, (p, m) in enumerate(zip(self.params, masters)):
            if not (isinstance(m, Tensor) and m.is_floating_point() and m.is_contiguous() and m.shape == p.shape
                    and m.device == p.device):
                got = f"{tuple(m.shape)} {m.dtype} on {m.device}" if isinstance(m, Tensor) else type(m).__name__
                raise ValueError(f"{self.who}: master_params[{i}] is {got}; expected a contiguous float tensor "
                                 f"of its parameter's shape {tuple(p.shape)} on {p.device}")
        return {id(p): m for p, m in zip(self.params, masters)}

    def disarm(self) -> None:
        """Undoes begin(grad_divisor=..., expected_total=...) before any bucket has left
        (the gradients are to change: more samples came). Nothing armed: nothing to do."""
        step = self._step
        if step is None:
            return
        if step.expected is None or step.works:
            raise RuntimeError(f"{self.who}: disarm() undoes begin(expected_total=...) before any bucket has left; "
                               f"{'buckets have left' if step.works else 'this step was begun with its weights'}")
        self._step = None

    def remove_hooks(self) -> None:
        """Detaches the gradient hooks of overlap=True."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def _grad_ready(self, indices: list[int], param: torch.nn.Parameter) -> None:
        """Gradient hook: marks `param` final in the buckets that hold it and launches
        every bucket, in order, whose gradients are all final. Hooks outside
        begin()..finish() (earlier micro-batches of an accumulation) are ignored."""
        step = self._step
        if step is None:
            return
        if indices[0] < self._next_launch:
            raise RuntimeError(f"{self.who}: a gradient of bucket {indices[0]} changed after the bucket was sent; "
                               f"call begin() before the backward of the step's last micro-batch only")
        for index in indices:
            step.ready[index].add(id(param))
        if step.may_send is not None:
            if not step.may_send():
                return
            step.may_send = None
        while (self._next_launch < len(self.buckets)
               and len(step.ready[self._next_launch]) == len(self.buckets[self._next_launch].params)):
            self._launch_next(step)

    def _launch_next(self, step: _Step) -> None:
        bucket = self.buckets[self._next_launch]
        self._prepare_grads(bucket)
        self._pack(bucket, step.scale)
        step.works.append(self._send(bucket))
        self._next_launch += 1

    def _prepare_grads(self, bucket: Bucket) -> None:
        for p in bucket.params:
            # Zeros for a gradient this rank did not produce; contiguous for the kernels and
            # for the ranges of it that buckets take. A parameter spanning buckets is made
            # so in the first of them, before any range of it is read.
            if p.grad is None:
                p.grad = torch.zeros_like(p, memory_format=torch.contiguous_format)
            elif not p.grad.is_contiguous():
                p.grad = p.grad.contiguous()

    def _pack(self, bucket: Bucket, scale: Tensor) -> None:
        ops.pack(bucket.grads(), scale, out=self._wire(bucket))

    def _send(self, bucket: Bucket):
        """Launches the bucket's collective (its wire packed)."""
        return launch_all_reduce(self._wire(bucket), self.group)
