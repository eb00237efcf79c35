"""The rebalancer across ranks: every rank learns every rank's compute time, rank 0
decides, and its split is broadcast, so all ranks switch on the same step to the same
split whatever their own floating-point state."""

import math

import torch
import torch.distributed as dist

from hetcomm.balance.rebalancer import RebalanceDecision, Rebalancer
from hetcomm.comm.collectives import control_device, gather_floats


class DistributedRebalancer:
    """Wraps a Rebalancer built identically on every rank. Call step() on every rank
    once per optimizer step, after the step's compute and before the next one starts.
    Checkpoint rank 0's rebalancer.state_dict(): its decision state (the streak) is
    the one that counts."""

    def __init__(self, rebalancer: Rebalancer, group=None):
        if dist.get_world_size(group) != len(rebalancer.sizes):
            raise ValueError(f"rebalancer: its split has {len(rebalancer.sizes)} ranks, the process group "
                             f"{dist.get_world_size(group)}")
        self.rebalancer = rebalancer
        self.group = group
        self.device = control_device(group)
        self.source = dist.get_global_rank(group, 0) if group is not None else 0

    def step(self, compute_time: float, all_times: list[float] | None = None,
             done: list[int] | None = None) -> RebalanceDecision:
        """Takes this rank's compute time for the step just done; returns the split for
        the next one (the same on every rank).

        One SUM all-reduce gathers the times (each rank fills its own slot), so every
        rank validates the same numbers and a bad one raises the same error everywhere,
        not a hang; then one broadcast of rank 0's split as int64. A caller that has
        already gathered every rank's time (identical on all ranks) passes it as
        all_times and saves the all-reduce; `done`, the samples each rank processed
        when a handoff moved some (every rank's, as for all_times). The predicted and
        required gains are known on rank 0 only (NaN elsewhere)."""
        world, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        if all_times is None:
            all_times = [row[0] for row in gather_floats([compute_time], self.group)]
        elif len(all_times) != world:
            raise ValueError(f"all_times has {len(all_times)} entries for {world} ranks")
        self.rebalancer.update(all_times, done)
        decision = self.rebalancer.decide() if rank == 0 else None
        split = torch.tensor(decision.sizes if decision else self.rebalancer.sizes, dtype=torch.int64,
                             device=self.device)
        dist.broadcast(split, src=self.source, group=self.group)
        sizes = tuple(split.tolist())
        changed = self.rebalancer.adopt(sizes)
        if decision is None:
            return RebalanceDecision(sizes, changed, predicted_gain=math.nan, required_gain=math.nan)
        return RebalanceDecision(sizes, changed, decision.predicted_gain, decision.required_gain)
