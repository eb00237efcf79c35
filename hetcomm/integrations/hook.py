"""The DDP communication hook of the integrations: hetcomm's weighted hook (pack for
the wire, all-reduce, unpack with the overflow check and norm in one pass), which also
tells the batches when this rank's compute of a step is done."""

import torch
import torch.distributed as dist
from torch import Tensor

from hetcomm.comm import WeightedHookState, weighted_hook


class BalancedHookState(WeightedHookState):
    """Equal weights 1/world: the integrations make each rank's loss a term of the mean
    over the global batch themselves (scaled by world / N), so the average DDP takes is
    the exact one. The loss scale is left to the framework (a GradScaler unscales, and
    sees an overflow on the wire as the inf it becomes)."""

    who = "hetcomm.integrations hook"

    def __init__(self, batches, process_group=None, wire_dtype: torch.dtype = torch.float16):
        super().__init__(process_group=process_group, wire_dtype=wire_dtype)
        self.batches = batches
        self.set_weight(1.0 / dist.get_world_size(process_group))


def balanced_hook(state: BalancedHookState, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
    if bucket.index() == 0:
        state.batches.compute_done()   # before the hook's agreement waits for the other ranks
    return weighted_hook(state, bucket)
