"""Giving each rank the share of the global batch it can finish in time: per-rank
step-time profiles and memory caps, the exact min-max split, rebalancing while
training, a straggler's handoff within a step, and a sampler that deals one
permutation per epoch by the current split.
Knows nothing of models or of the trainer; torch.distributed is used only to agree on
a rebalanced split."""

from hetcomm.balance.distributed import DistributedRebalancer
from hetcomm.balance.memory import CudaPeakMeter, MemoryProbe, PeakMeter, probe_memory, probe_memory_with
from hetcomm.balance.profile import (StepTimeProfile, fit_step_time, measure_step_times, profile_step,
                                    wait_for_compute)
from hetcomm.balance.rebalancer import RebalanceDecision, Rebalancer
from hetcomm.balance.sampler import WeightedDistributedSampler, proportional_shares
from hetcomm.balance.solver import (POLICIES, Split, equal_split, optimal_rank_times, predict_rank_times,
                                   solve_split)

__all__ = ["StepTimeProfile", "fit_step_time", "measure_step_times", "profile_step", "wait_for_compute",
           "MemoryProbe", "PeakMeter",
           "CudaPeakMeter", "probe_memory", "probe_memory_with", "POLICIES", "Split", "equal_split", "solve_split",
           "optimal_rank_times", "predict_rank_times", "Rebalancer", "RebalanceDecision", "DistributedRebalancer",
           "WeightedDistributedSampler", "proportional_shares"]
