"""Triton kernels for pack, unpack_ and unscale_: a second GPU back end, registered as
torch.ops.hetcomm_triton.* with the schemas of torch.ops.hetcomm.*.

Importing this package imports triton and registers the ops; hetcomm.ops imports it
only when the triton back end is asked for, so hetcomm works without triton.
"""

from hetcomm.triton import pack, unpack, unscale  # noqa: F401  (registers the ops)
from hetcomm.triton.multi_tensor import PLANS
from hetcomm.triton.plan_cache import PlanCacheStats

OPS = ("pack", "pack.out", "unpack_", "unscale_")


def plan_cache_stats() -> PlanCacheStats:
    """Hits, misses (plans built) and what the cache of tensor-list plans holds now."""
    return PLANS.stats()


def clear_plan_cache() -> None:
    """Drops every kept plan (and its device table) and zeroes the counters."""
    PLANS.clear()
