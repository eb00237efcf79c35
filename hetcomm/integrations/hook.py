"""The DDP communication hook of the integrations: hetcomm's weighted hook (pack for
the wire, all-reduce, unpack with the overflow check and norm in one pass), which also
tells the batches when this rank's compute of a step is done."""

import torch
import torch.distributed as dist
from torch import Tensor

from hetcomm.comm import WeightedHookState, weighted_hook
from hetcomm.comm.reducer import scalar_on
from hetcomm.integrations.settings import check_wire_dtype


class BalancedHookState(WeightedHookState):
    """Weights for gradients that are already terms of the global mean, or sums.

    per_item=False: equal weights 1/world, for losses scaled to a term of the mean over
    the global batch times the number of ranks (BalancedTrainer), so that the average
    DDP would take is the exact one. The ranks agree once, on the first step, that their
    wire dtypes and weights match; later steps send their buckets without waiting for
    one another in the backward. per_item=True: each micro-batch's mean loss is multiplied
    by scale_for(its items) = items / r, r the step's first micro-batch's items on this
    rank, so that the rank's gradient is of its items' summed losses over r, and the hook
    weights it by r / N, N every rank's items, agreed at each step's first bucket (a
    framework that hands its micro-batches over one at a time, as Lightning does, cannot
    know N before the last one). Dividing by r keeps the gradients at a mean's size: a sum
    would be N times larger in a 16-bit backward (on the H200 a GradScaler skipped 3 of 4
    steps) and on the wire. The loss scale is left to the framework (a GradScaler
    unscales, and sees an overflow on the wire as the inf it becomes).

    batches: the BalancedBatches it tells when a rank's compute is done (None until the
    framework builds them, before the first backward). Built after init_process_group."""

    who = "hetcomm.integrations hook"

    def __init__(self, batches, process_group=None, wire_dtype: torch.dtype = torch.float16, per_item: bool = False):
        if batches is not None and not callable(getattr(batches, "compute_done", None)):
            raise TypeError(f"{self.who}: batches = {type(batches).__name__}: expected the BalancedBatches the "
                            f"loader draws from (or None until they are built)")
        if not isinstance(per_item, bool):
            raise TypeError(f"{self.who}: per_item = {per_item!r}: expected a bool")
        check_wire_dtype(wire_dtype, self.who, process_group)
        if process_group is None and not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(f"{self.who}: torch.distributed is not initialised; build the hook's state after "
                               f"init_process_group (torchrun, accelerate and Lightning do it), for the DDP model's "
                               f"process group")
        super().__init__(process_group=process_group, wire_dtype=wire_dtype)
        self.batches, self.per_item = batches, per_item
        self.agreed = False
        self.step_items = 0.0             # per_item: this rank's items in the step so far
        self.reference: float | None = None   # per_item: r, the step's first micro-batch's items
        if not per_item:
            self.set_weight(1.0 / dist.get_world_size(process_group))

    def scale_for(self, items: float) -> float:
        """per_item: records a micro-batch's items (before its backward); returns what its
        mean loss is multiplied by. The first call after a step's reduction starts a step."""
        if not self.per_item:
            raise RuntimeError(f"{self.who}: scale_for is for per_item=True; equal weights take the loss as it is")
        items = float(items)
        if self.reference is None:
            self.step_items, self.reference = 0.0, items if items > 0 else 1.0
        self.step_items += items
        self.set_count(self.step_items)
        return items / self.reference

    def _begin_step(self, device: torch.device) -> None:
        if self.per_item or not self.agreed:
            super()._begin_step(device)
            self.agreed = True
        else:   # the equal weights and the settings were agreed on the first step and cannot change
            self.found_inf = torch.zeros(1, device=device)
            self.sq_norm = torch.zeros(1, device=device)
        if self.per_item:
            if self.reference is None:
                raise RuntimeError(f"{self.who}: call scale_for(items) for each micro-batch before its backward")
            self._scale = scalar_on(self.reference / self.total, device)
            self.reference = None


def balanced_hook(state: BalancedHookState, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
    """hetcomm's weighted hook, marking this rank's compute done: at the last bucket (the
    whole backward) where no bucket waits for the other ranks, else at the first, before
    its agreement waits."""
    if bucket.is_last() if state.agreed and not state.per_item else bucket.index() == 0:
        state.batches.compute_done(bucket.buffer().device)
    return weighted_hook(state, bucket)
