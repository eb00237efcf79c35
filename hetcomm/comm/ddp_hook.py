"""A DDP communication hook that reduces with per-rank weights:

    state = hetcomm.WeightedHookState(process_group=None, wire_dtype=torch.float16)
    ddp.register_comm_hook(state, hetcomm.weighted_hook)
    for batch in loader:
        state.set_weight(n_local / n_global)     # or state.set_count(n_local)
        loss_scaled.backward()                   # the hook runs per bucket inside backward
        if state.found_inf.item() == 0: ...      # same verdict on every rank

With a hook registered DDP does not divide by the world size: the hook's weights do
the averaging (equal weights 1/world reproduce DDP's default).
"""

from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

from hetcomm import ops
from hetcomm.comm.collectives import launch_all_reduce
from hetcomm.comm.reducer import WIRE_DTYPES, check_wire_dtype, scalar_on
from hetcomm.comm.weights import agree_share


class WeightedHookState:
    """What weighted_hook needs across buckets and steps.

    Args:
        process_group: the DDP model's process group (default: the world).
        wire_dtype: float32, float16 or bfloat16 (not on Gloo).
        loss_scale: the factor the gradients carry; divided out while unpacking. May be
            changed between steps with set_loss_scale.
        timeout: deadline for the per-step weight agreement (default: the group's timeout).
    """

    who = "hetcomm.weighted_hook"

    def __init__(self, process_group=None, wire_dtype: torch.dtype = torch.float16,
                 loss_scale: float | Tensor = 1.0, timeout: timedelta | None = None):
        check_wire_dtype(wire_dtype, process_group, self.who)
        self.process_group = process_group
        self.wire_dtype = wire_dtype
        self.timeout = timeout
        self.loss_scale = loss_scale
        self._value: float | None = None
        self._by_count = False
        self.weight: float | None = None   # agreed at the first bucket of each step
        self.total: float | None = None
        self.found_inf: Tensor | None = None
        self.sq_norm: Tensor | None = None

    def set_weight(self, weight: float) -> None:
        """This rank's share n_i / N for the coming backward; all ranks' must add up to 1."""
        self._value, self._by_count = float(weight), False

    def set_count(self, count: float) -> None:
        """This rank's n_i for the coming backward; N is obtained by the hook."""
        self._value, self._by_count = float(count), True

    def set_loss_scale(self, loss_scale: float | Tensor) -> None:
        self.loss_scale = loss_scale

    def grad_norm(self) -> Tensor:
        """L2 norm of the whole reduced, unscaled gradient of the last backward (0-dim,
        as torch.nn.utils.clip_grads_with_norm_ takes it)."""
        return self.sq_norm.sqrt().reshape(())

    def _begin_step(self, device: torch.device) -> None:
        """At the first bucket of a backward: agree on the weights (every rank raises
        the same error if they are wrong) and reset the step's flags."""
        if self._value is None:
            raise RuntimeError(f"{self.who}: call state.set_weight(...) or state.set_count(...) before backward")
        # The wire dtype and the loss scale must be every rank's: buckets of another dtype
        # would fail the all-reduce, and another scale would unpack a wrong gradient silently.
        same = {"loss scales": self.loss_scale,
                "wire dtypes (0 = float32, 1 = float16, 2 = bfloat16)": WIRE_DTYPES.index(self.wire_dtype)}
        share = agree_share(self._value, self._by_count, self.process_group, self.timeout, self.who, same=same)
        self.weight, self.total = share.weight, share.total
        self._scale = scalar_on(share.weight, device)
        self._inv_loss_scale = scalar_on(self.loss_scale, device).reciprocal()
        self.found_inf = torch.zeros(1, device=device)
        self.sq_norm = torch.zeros(1, device=device)


def weighted_hook(state: WeightedHookState, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
    """Packs the bucket with this rank's weight, all-reduces it (SUM) and unpacks it in
    place with the loss scale removed, accumulating found_inf and the squared norm."""
    flat = bucket.buffer()
    if bucket.index() == 0:
        state._begin_step(flat.device)
    wire = ops.pack([flat], state._scale, state.wire_dtype)
    work = launch_all_reduce(wire, state.process_group)

    def unpack(future: torch.futures.Future) -> Tensor:
        ops.unpack_(future.value()[0], [flat], state._inv_loss_scale, state.found_inf, state.sq_norm)
        return flat

    return work.get_future().then(unpack)
