"""The DDP communication hook of the integrations: hetcomm's weighted hook (pack for
the wire, all-reduce, unpack with the overflow check and norm in one pass), which also
tells the batches when this rank's compute of a step is done."""

import torch
import torch.distributed as dist
from torch import Tensor

from hetcomm.comm import WeightedHookState, weighted_hook
from hetcomm.comm.reducer import scalar_on


class BalancedHookState(WeightedHookState):
    """Weights for gradients that are already terms of the global mean, or sums.

    per_item=False: equal weights 1/world, for losses scaled to a term of the mean over
    the global batch times the number of ranks (BalancedTrainer), so that the average
    DDP would take is the exact one. The ranks agree once, on the first step, that their
    wire dtypes and weights match; later steps send their buckets without waiting for
    one another in the backward. per_item=True: each rank's gradient is of the sum of
    its items' losses (set_count(n_i) before the step's last backward) and is weighted
    by 1/N, N every rank's items, agreed at each step's first bucket (a framework that
    hands its micro-batches over one at a time, as Lightning does, cannot know N before
    the last one; packing the sum and dividing after the all-reduce would put N times
    the mean's values on a 16-bit wire). The loss scale is left to the framework (a
    GradScaler unscales, and sees an overflow on the wire as the inf it becomes)."""

    who = "hetcomm.integrations hook"

    def __init__(self, batches, process_group=None, wire_dtype: torch.dtype = torch.float16, per_item: bool = False):
        super().__init__(process_group=process_group, wire_dtype=wire_dtype)
        self.batches, self.per_item = batches, per_item
        self.agreed = False
        if not per_item:
            self.set_weight(1.0 / dist.get_world_size(process_group))

    def _begin_step(self, device: torch.device) -> None:
        if self.per_item or not self.agreed:
            super()._begin_step(device)
            self.agreed = True
        else:   # the equal weights and the settings were agreed on the first step and cannot change
            self.found_inf = torch.zeros(1, device=device)
            self.sq_norm = torch.zeros(1, device=device)
        if self.per_item:
            self._scale = scalar_on(1.0 / self.total, device)


def balanced_hook(state: BalancedHookState, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
    """hetcomm's weighted hook, marking this rank's compute done: at the last bucket (the
    whole backward) where no bucket waits for the other ranks, else at the first, before
    its agreement waits."""
    if bucket.is_last() if state.agreed and not state.per_item else bucket.index() == 0:
        state.batches.compute_done()
    return weighted_hook(state, bucket)
