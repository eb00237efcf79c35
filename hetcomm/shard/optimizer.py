"""ShardedAdamW: AdamW whose fp32 masters and moments live only on the owner of each
range, stepped by the fused adamw_ op straight from the reduced 16-bit gradient, the new
16-bit weights written into the flat weight buffer and all-gathered from there; or, with
offload=True, the masters and moments in host memory, stepped there by the CPU kernel
(see ShardedAdamW)."""

import math
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from hetcomm import ops
from hetcomm.comm.collectives import wait
from hetcomm.optim.adamw import _check_hyper
from hetcomm.shard.reducer import ShardedReducer

STATE_NAMES = ("master", "exp_avg", "exp_avg_sq")


class ShardedAdamW(torch.optim.Optimizer):
    """torch.optim.AdamW's update (decoupled weight decay) over the parameters a
    ShardedReducer reduces, each rank stepping only its own range.

    Param groups, learning-rate schedulers and per-group hyperparameters work as with
    any torch optimizer; every trained parameter must be in exactly one group. Each
    group's step count moves on together on every rank (as hetcomm.optim.AdamW's).

    Call step() after the reducer's reduce(), unless it found an overflow; grad_scale
    is what the gradient is multiplied by beyond the loss scale (a clipping coefficient,
    StepResult.clip_coefficient). step() ends with every rank holding the new weights.

    State per rank: for its range only, fp32 masters (not for fp32 weights: the flat
    weights are the masters) and the two fp32 moments: state_bytes() counts them.

    initial_masters: for 16-bit weights, the fp32 values the masters start from, one
    tensor per parameter of the reducer in its order (the model's weights before they
    were cast to 16 bits, on any device); the masters then start where an unsharded
    optimizer's fp32 masters do. Without it they start from the 16-bit weights, widened.

    offload: keep the range's state in host memory (pinned when the weights are on a
    GPU), with the loop's Shard(offload="optimizer") (which sizes the ranges for it):
    the fp32 params AdamW steps (the masters; for fp32 weights a host copy of the
    weights, which is then the one that counts, as the masters are), the two moments,
    an fp32 staging buffer that each step's reduced gradient range is copied down into
    and, for 16-bit weights, a staging buffer the fused step writes the new weights
    into, copied up into the flat weights from there (host_bytes():
    hetcomm.shard.layout.host_bytes_per_element per element). The step is the same
    adamw_ op, its CPU kernel: on CPU ranks bit for bit the step without offload. The
    copy down is waited for; the copy up is not (on a GPU it is ordered before the
    next gather by the stream). On CPU ranks the host is the device, and the copies
    are made all the same.

    overlap: offloaded with fully sharded weights, step() only copies the gradient
    down; each layer unit's part of the range is stepped and copied up just before
    the unit's next gather (ShardedWeights.before_gather), so that the host's update of
    the later units runs while the device computes the forward of the earlier ones. The
    same adamw_ on the same elements: bit for bit the step done at once. Anything that
    reads the state or the weights outside a gather (shard_state, the next step) first
    finishes what is left (flush()). None (the default): on where it can help, with the
    weights on a GPU; on CPU ranks the forward and the update share the host."""

    def __init__(self, params: Iterable, reducer: ShardedReducer, lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2,
                 initial_masters: Sequence[Tensor] | None = None, offload: bool = False,
                 overlap: bool | None = None):
        _check_hyper(lr, betas, eps, weight_decay)
        if not isinstance(offload, bool):
            raise ValueError(f"ShardedAdamW: offload = {offload!r}: expected True (the state in host memory) or "
                             f"False")
        if not isinstance(reducer, ShardedReducer):
            raise TypeError(f"ShardedAdamW: reducer must be a hetcomm.shard.ShardedReducer (BalancedLoop(..., "
                            f"shard=...).reducer); got {type(reducer).__name__}")
        if overlap not in (None, True, False):
            raise ValueError(f"ShardedAdamW: overlap = {overlap!r}: expected True, False or None")
        if overlap and (not offload or reducer.flat.sharded is None):
            raise ValueError("ShardedAdamW: overlap=True defers each layer unit's update to its next gather: it needs "
                             "offload=True and fully sharded weights (Shard(weights=True, offload=\"optimizer\"))")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.reducer = reducer
        flat = reducer.flat
        self.flat = flat
        group_of = self._group_of_each_parameter()
        start, stop = reducer.range
        self.range = (start, stop)
        self.offload = offload
        # Where the state lives: the device, or the host (pinned beside a GPU: the copies are DMA).
        home = torch.device("cpu") if offload else flat.device
        pin = offload and flat.device.type == "cuda"

        def zeros(size: int, dtype: torch.dtype = torch.float32) -> Tensor:
            return torch.zeros(size, dtype=dtype, device=home, pin_memory=pin)

        size = stop - start
        sixteen = flat.dtype != torch.float32
        self.masters = zeros(size) if sixteen else None
        if self.masters is not None:
            self.masters.copy_(flat.weights_of(start, stop))
        if initial_masters is not None:
            self._start_masters_from(initial_masters)
        self.exp_avg = zeros(size)
        self.exp_avg_sq = zeros(size)
        self.steps = [zeros(1) for _ in self.param_groups]
        # Offloaded: what AdamW steps on the host, and the staging of the copies down and up.
        self._host_params = self._grads_down = self._weights_up = self._scalars = None
        self._uploaded = None   # the event of the last copy up (GPU weights)
        if offload:
            self._host_params = self.masters if sixteen else zeros(size)
            if not sixteen:
                self._host_params.copy_(flat.weights_of(start, stop))
            self._grads_down = zeros(size)
            self._weights_up = zeros(size, flat.dtype) if sixteen else None
            if self._weights_up is not None:
                self._weights_up.copy_(flat.weights_of(start, stop))
            self._scalars = zeros(2)   # the step's gradient scale and skip flag, copied down together
        # This rank's range cut at the parameters' ends (for their groups) and the buckets' (for the wire).
        wires = reducer.reduced_range()
        cuts = sorted({start, stop, *(a for a, _, _ in wires), *flat.offsets})
        pieces: list[list[tuple[int, int]]] = [[] for _ in self.param_groups]
        for a, b in zip(cuts, cuts[1:]):
            if start <= a and b <= stop:
                pieces[group_of[flat.pieces(a, b)[0].index]].append((a, b))
        self._gather_order = sorted(reducer.buckets, key=lambda b: b.start)   # the forward's order
        # Per group, the views adamw_ takes, made once: the step is one call per group.
        self._views = [self._views_of(group_pieces, wires) for group_pieces in pieces]
        self._by_unit = self._overlapped_views(overlap, pieces, wires)
        self._pending: dict[int, list[tuple]] = {}   # unit index -> each group's hyperparameters of the step
        self._pending_scalars: tuple[Tensor, Tensor] | None = None

    def _overlapped_views(self, overlap, pieces, wires) -> dict[int, list[dict]] | None:
        """With overlap, per layer unit that this rank owns a part of, each group's views
        of that part (the pieces are cut at the parameters' ends, hence at the units')."""
        sharded = self.flat.sharded
        if overlap is None:
            overlap = self.offload and sharded is not None and self.flat.device.type == "cuda"
        if not overlap:
            return None
        by_unit: dict[int, list[list[tuple[int, int]]]] = {}
        for g, group_pieces in enumerate(pieces):
            for a, b in group_pieces:
                unit = next(u for u in sharded.units if u.start <= a and b <= u.stop)
                by_unit.setdefault(unit.index, [[] for _ in pieces])[g].append((a, b))
        sharded.before_gather = self._before_gather
        return {index: [self._views_of(group_pieces, wires) for group_pieces in groups]
                for index, groups in by_unit.items()}

    def _start_masters_from(self, initial: Sequence[Tensor]) -> None:
        if self.masters is None:
            raise ValueError("ShardedAdamW: initial_masters is for 16-bit weights; these are fp32, their own masters")
        shapes = [tuple(p.shape) for p in self.flat.params]
        if len(initial) != len(shapes) or any(not isinstance(t, Tensor) or t.dtype != torch.float32
                                              or tuple(t.shape) != shape for t, shape in zip(initial, shapes)):
            raise ValueError(f"ShardedAdamW: initial_masters must be {len(shapes)} fp32 tensors of the reducer's "
                             f"parameters' shapes, in its order ({shapes[:3]}...)")
        start = self.range[0]
        for piece in self.flat.pieces(*self.range):
            offset = self.flat.offsets[piece.index]
            source = initial[piece.index].reshape(-1)[piece.start - offset:piece.stop - offset]
            self.masters[piece.start - start:piece.stop - start].copy_(source)

    def _views_of(self, pieces: list[tuple[int, int]], wires) -> dict[str, list[Tensor]]:
        start = self.range[0]
        local = [(a - start, b - start) for a, b in pieces]
        if self.offload:
            return {"grads": [self._grads_down[a:b] for a, b in local],
                    "params": [self._host_params[a:b] for a, b in local],
                    "exp_avgs": [self.exp_avg[a:b] for a, b in local],
                    "exp_avg_sqs": [self.exp_avg_sq[a:b] for a, b in local],
                    "copies": [] if self._weights_up is None else [self._weights_up[a:b] for a, b in local]}
        weights = [self.flat.weights_of(a, b) for a, b in pieces]
        return {"grads": [_slice_of(wires, a, b) for a, b in pieces],
                "params": weights if self.masters is None else [self.masters[a:b] for a, b in local],
                "exp_avgs": [self.exp_avg[a:b] for a, b in local],
                "exp_avg_sqs": [self.exp_avg_sq[a:b] for a, b in local],
                "copies": [] if self.masters is None else weights}

    def _group_of_each_parameter(self) -> list[int]:
        index_of = {id(p): i for i, p in enumerate(self.flat.params)}
        group_of: list[int | None] = [None] * len(self.flat.params)
        for g, group in enumerate(self.param_groups):
            for p in group["params"]:
                i = index_of.get(id(p))
                if i is None:
                    raise ValueError(f"ShardedAdamW: param group {g} holds a tensor of shape {tuple(p.shape)} that "
                                     f"the reducer does not reduce; pass the trained parameters of its model")
                group_of[i] = g
        missing = [i for i, g in enumerate(group_of) if g is None]
        if missing:
            raise ValueError(f"ShardedAdamW: trained parameters {missing[:8]} are in no param group; every "
                             f"parameter the reducer reduces must be in one (their state is sharded with it)")
        return group_of

    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "reducer", None) is not None:
            raise RuntimeError("ShardedAdamW: param groups are fixed at construction (the sharded state is cut by "
                               "them)")
        super().add_param_group(param_group)

    @torch.no_grad()
    def step(self, closure=None, *, grad_scale: Tensor | float = 1.0, found_inf: Tensor | None = None):
        """Steps this rank's range of every group and all-gathers the new weights.
        grad_scale: a 1-element float32 tensor or a float (a clipping coefficient).
        found_inf: a 1-element float32 tensor; when non-zero nothing changes."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        device = self.flat.device
        if not isinstance(grad_scale, Tensor):
            if not math.isfinite(grad_scale):
                raise ValueError(f"ShardedAdamW.step: grad_scale = {grad_scale!r}: expected a finite number")
            grad_scale = torch.full((1,), float(grad_scale), device=device)
        scale = self.reducer.reduced_scale() * grad_scale.to(device=device, dtype=torch.float32).reshape(1)
        skip = torch.zeros(1, device=device) if found_inf is None else found_inf.to(device).reshape(1)
        if self.offload:
            self.flush()   # the last step's units no gather has asked for: before their staging is reused
            scale, skip = self._copy_down(scale, skip)
        moved = 1.0 - (skip != 0).float()
        deferred = self._by_unit is not None and not skip.item()   # offloaded: a host tensor
        for group, views, count in zip(self.param_groups, self._views, self.steps):
            _check_hyper(group["lr"], group["betas"], group["eps"], group["weight_decay"])
            count.add_(moved)
            if deferred or not views["grads"]:
                continue
            beta1, beta2 = group["betas"]
            ops.adamw_(views["grads"], views["params"], views["exp_avgs"], views["exp_avg_sqs"], views["copies"],
                       grad_scale=scale, found_inf=skip, step=count, lr=group["lr"], beta1=beta1, beta2=beta2,
                       eps=group["eps"], weight_decay=group["weight_decay"])
        if deferred:
            # The hyperparameters as they are now: a scheduler may change them before the gathers.
            hyper = [(group["lr"], *group["betas"], group["eps"], group["weight_decay"]) for group in self.param_groups]
            self._pending = {index: hyper for index in self._by_unit}
            self._pending_scalars = (scale, skip)
        elif self.offload and not skip.item():   # a host tensor: no wait on the device
            self._copy_up()
        self.all_gather()
        return loss

    def _before_gather(self, unit) -> None:
        """ShardedWeights' call before it gathers `unit`: its deferred update, if any."""
        hyper = self._pending.pop(unit.index, None)
        if hyper is not None:
            self._step_unit(unit.index, hyper)

    def flush(self) -> None:
        """Every deferred unit's update, now (overlap)."""
        while self._pending:
            index = min(self._pending)
            self._step_unit(index, self._pending.pop(index))

    def _step_unit(self, index: int, hyper: list[tuple]) -> None:
        """One unit's part of the range: stepped on the host, its new weights copied up."""
        scale, skip = self._pending_scalars
        low, high = self.range
        sharded = self.flat.sharded
        unit = sharded.units[index]
        for views, count, (lr, beta1, beta2, eps, weight_decay) in zip(self._by_unit[index], self.steps, hyper):
            if views["grads"]:
                ops.adamw_(views["grads"], views["params"], views["exp_avgs"], views["exp_avg_sqs"], views["copies"],
                           grad_scale=scale, found_inf=skip, step=count, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                           weight_decay=weight_decay)
        a, b = max(low, unit.start), min(high, unit.stop)
        source = self._weights_up if self._weights_up is not None else self._host_params
        self.flat.weights_of(a, b).copy_(source[a - low:b - low], non_blocking=True)
        if self.flat.device.type == "cuda":
            self._uploaded = torch.cuda.Event()
            self._uploaded.record(torch.cuda.current_stream(self.flat.device))

    def _copy_down(self, scale: Tensor, skip: Tensor) -> tuple[Tensor, Tensor]:
        """The reduced gradient range into the host's fp32 staging, and the step's scale
        and skip flag beside it (one 2-element copy), waited for: their host views."""
        low = self.range[0]
        for a, b, wire in self.reducer.reduced_range():
            self._grads_down[a - low:b - low].copy_(wire, non_blocking=True)
        self._scalars.copy_(torch.cat([scale.reshape(1).float(), skip.reshape(1).float()]), non_blocking=True)
        if self.flat.device.type == "cuda":
            # On the current stream, after the last copy up: the host's buffers are free again too.
            torch.cuda.current_stream(self.flat.device).synchronize()
        return self._scalars[0:1], self._scalars[1:2]

    def _copy_up(self) -> None:
        """The new weights of the range from the host into the flat weights, not waited
        for: the next gather or all-gather comes after it on the current stream."""
        source = self._weights_up if self._weights_up is not None else self._host_params
        self.flat.weights_of(*self.range).copy_(source, non_blocking=True)
        if self.flat.device.type == "cuda":
            self._uploaded = torch.cuda.Event()
            self._uploaded.record(torch.cuda.current_stream(self.flat.device))

    def _wait_up(self) -> None:
        """Before the host's buffers are written outside a step: the copy up from them is done."""
        if self._uploaded is not None:
            self._uploaded.synchronize()
            self._uploaded = None

    def all_gather(self) -> None:
        """Every rank gets every owner's weights: one broadcast per bucket of the flat
        weights from its owner, in the forward's order. Fully sharded weights are
        gathered by each layer's next forward instead (hetcomm.shard.weights)."""
        if self.flat.sharded is not None:
            return
        reducer = self.reducer
        works = [(b, dist.broadcast(self.flat.weights[b.start:b.stop], src=reducer._owners[b.owner],
                                    group=reducer.group, async_op=True))
                 for b in self._gather_order]
        for bucket, work in works:
            wait(work, reducer.timeout, f"ShardedAdamW: the all-gather of elements {bucket.start}-{bucket.stop} from "
                                        f"rank {bucket.owner}")

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank keeps on its device (its range's masters and
        moments; none when they are offloaded: host_bytes())."""
        if self.offload:
            return 0
        kept = [self.exp_avg, self.exp_avg_sq] + ([self.masters] if self.masters is not None else [])
        return sum(t.numel() * t.element_size() for t in kept)

    def host_bytes(self) -> int:
        """Bytes this rank keeps in host memory for its offloaded range: the params AdamW
        steps, the two moments and the staging of the copies down and up (0 without
        offload)."""
        if not self.offload:
            return 0
        kept = [self._host_params, self.exp_avg, self.exp_avg_sq, self._grads_down] + \
            ([self._weights_up] if self._weights_up is not None else [])
        return sum(t.numel() * t.element_size() for t in kept)

    def shard_state(self) -> dict[str, Tensor]:
        """This rank's range of the state, by name (hetcomm.shard.checkpoint saves it):
        with fully sharded fp32 weights, which are their own masters, the weights too
        (no other rank holds them)."""
        self.flush()
        state = {"exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}
        if self.masters is not None:
            state["master"] = self.masters
        elif self.flat.sharded is not None:
            state["weight"] = self.flat.weights_of(*self.range)
        return state

    def load_shard_state(self, state: dict[str, Tensor]) -> None:
        """Takes this rank's range of the state (as shard_state() gives it, of any layout
        that was resharded to this rank's range) and writes the masters' 16-bit values
        into the weights, so that every rank's weights follow the masters."""
        size = self.range[1] - self.range[0]
        self._wait_up()
        for name, tensor in self.shard_state().items():
            given = state.get(name)
            if given is None or given.numel() != size:
                raise ValueError(f"ShardedAdamW.load_shard_state: {name} holds "
                                 f"{None if given is None else given.numel()} elements; this rank's range has {size}")
            tensor.copy_(given.reshape(-1))
        if self.masters is not None:
            self.flat.weights_of(*self.range).copy_(self.masters)
        if self.offload:   # the host's copies follow the weights (fp32: the copy that is stepped)
            (self._weights_up if self._weights_up is not None else self._host_params).copy_(
                self.flat.weights_of(*self.range))
        self.all_gather()

    def state_dict(self) -> dict:
        """The hyperparameters and step count of each group (the same on every rank); the
        ranged tensors are in shard_state()."""
        groups = [{key: value for key, value in group.items() if key != "params"} | {"step": count.item()}
                  for group, count in zip(self.param_groups, self.steps)]
        return {"param_groups": groups, "total": self.flat.total}

    def load_state_dict(self, state_dict: dict) -> None:
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups) or state_dict.get("total") != self.flat.total:
            raise ValueError(f"ShardedAdamW.load_state_dict: the state has {len(groups)} groups over "
                             f"{state_dict.get('total')} elements; this optimizer {len(self.param_groups)} over "
                             f"{self.flat.total}")
        for group, saved, count in zip(self.param_groups, groups, self.steps):
            group.update({key: value for key, value in saved.items() if key != "step"})
            count.fill_(float(saved["step"]))


def _slice_of(wires: list[tuple[int, int, Tensor]], a: int, b: int) -> Tensor:
    for start, stop, wire in wires:
        if start <= a and b <= stop:
            return wire[a - start:b - start]
    raise AssertionError(f"elements {a}-{b} are in none of this rank's buckets")
