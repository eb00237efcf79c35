"""Plans kept from one call to the next: a training run passes the same gradients and
parameters to the same op every step, so each list's row table is built on the host
and copied to the device once, not once per call.

A plan is a pure function of its key: the device, the stream, and for every non-empty
tensor its source and destination addresses, dtypes and element count (multi_tensor's
Segment). The ops accept contiguous tensors only, so an address and a count describe
a tensor's memory exactly; strides and storage offsets add nothing (data_ptr already
includes the offset). A hit therefore returns exactly the plan that a rebuild would.

The cache holds integers and dtypes, never the tensors: keeping them would pin their
memory for as long as a plan lives. Nor does it need them. A tensor freed and another
allocated at the same address with the same dtype and count makes the same key and the
same plan, and that plan is right for the new tensor: the kernels read only addresses
and counts. A tensor moved, resized or cast makes another key, so a new plan.

Bounds: a step of hetcomm's reducer makes one pack and one unpack_ per bucket and
often one unscale_, so a cycle of 2 * buckets + 1 lists that recur in the same order
every step. An LRU smaller than that cycle would miss on every call, so MAX_PLANS
leaves room for a model of 100 25 MB buckets. What a plan holds on the device is 24
bytes per row of multi_tensor.CHUNK elements (0.04% of fp32 data), and MAX_ROWS caps
the sum over all plans at 24 MiB of GPU memory however many stale lists (a functional
pack whose output landed at a new address, say) come by; the oldest go first.
"""

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import NamedTuple, Protocol

MAX_PLANS = 256
MAX_ROWS = 1 << 20


class HasRows(Protocol):
    rows: int


class PlanCacheStats(NamedTuple):
    hits: int
    misses: int  # the number of plans built
    plans: int  # held now
    rows: int  # held now, summed over the plans


class PlanCache:
    """A least-recently-used map from key to plan, bounded in plans and in rows."""

    def __init__(self, max_plans: int = MAX_PLANS, max_rows: int = MAX_ROWS):
        self.max_plans = max_plans
        self.max_rows = max_rows
        self._plans: OrderedDict[Hashable, HasRows] = OrderedDict()
        self._rows = 0
        self._hits = 0
        self._misses = 0
        # Ops may run on several threads (one per device, say); the map and its
        # counters change together.
        self._lock = threading.Lock()

    def get(self, key: Hashable, build: Callable[[], HasRows]) -> HasRows:
        """The plan of key, built by build() on a miss."""
        with self._lock:
            plan = self._plans.get(key)
            if plan is not None:
                self._plans.move_to_end(key)
                self._hits += 1
                return plan
        plan = build()  # outside the lock: it copies to the device
        with self._lock:
            self._misses += 1
            if key not in self._plans:
                self._plans[key] = plan
                self._rows += plan.rows
            self._evict()
        return plan

    def _evict(self) -> None:
        # A plan larger than max_rows on its own is still kept (it is the newest, and
        # the caller is about to use it); everything older goes.
        while len(self._plans) > self.max_plans or (self._rows > self.max_rows and len(self._plans) > 1):
            _, oldest = self._plans.popitem(last=False)
            self._rows -= oldest.rows

    def clear(self) -> None:
        """Drops every plan and zeroes the counters."""
        with self._lock:
            self._plans.clear()
            self._rows = self._hits = self._misses = 0

    def stats(self) -> PlanCacheStats:
        with self._lock:
            return PlanCacheStats(self._hits, self._misses, len(self._plans), self._rows)
