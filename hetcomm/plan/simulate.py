"""Stepping a plan through N iterations with noise and mid-run slowdowns, to show what
the trainer's rebalancer (hetcomm.balance.Rebalancer with the trainer's settings) would
do, against keeping the planned split and against the ideal split for the true speeds.

Each step, rank i's true compute time is the plan's t_i(b_i) divided by its speed
factor (1, times every slowdown that has started) and multiplied by exp(noise·z),
z standard normal: the same draws for both policies, so their difference is the
policy's alone. A step costs the slowest rank's compute plus the plan's exposed
all-reduce and update. The rebalancing policy also hands a straggler's samples off
within the step as the trainer does (hetcomm.balance.handoff), from the timed forward
of each rank's share."""

import math
from dataclasses import dataclass

import torch

from hetcomm.balance import Rebalancer, handoff, predict_rank_times, solve_split
from hetcomm.balance.rebalancer import THRESHOLD, TRAINING_SETTINGS
from hetcomm.plan.planner import Plan
from hetcomm.simulated import Slowdown


@dataclass(frozen=True)
class Rebalance:
    step: int
    predicted_gain: float
    sizes: tuple[int, ...]


@dataclass(frozen=True)
class Simulation:
    steps: int
    noise: float
    slowdowns: tuple[Slowdown, ...]
    static_s: float        # the planned split kept throughout
    rebalanced_s: float    # the rebalancer following the measurements
    ideal_s: float         # the best split for the true speeds of each step, without noise
    rebalances: tuple[Rebalance, ...]
    handoffs: tuple[int, ...]  # the steps in which a straggler handed samples off
    final_sizes: tuple[int, ...]
    static_step_s: tuple[float, ...]
    rebalanced_step_s: tuple[float, ...]


def _observed(sizes: tuple[int, ...], profiles: list, caps: list, slowness: torch.Tensor) -> list[float]:
    """Each rank's compute time for `sizes` this step: the model's, stretched."""
    return (torch.tensor(predict_rank_times(sizes, profiles, caps), dtype=torch.float64) * slowness).tolist()


def _handed_off(rebalancer: Rebalancer, measured: list[float], rates: list[float],
                caps: list) -> tuple[float, tuple[int, ...], bool]:
    """The step's compute seconds and the samples each rank did under the trainer's
    handoff, for compute times `measured` at the current split; `rates`: seconds per
    sample of a rank with no samples."""
    sizes = rebalancer.sizes
    planned = predict_rank_times(sizes, rebalancer.model(), caps)
    reports = []
    for b, t, rate, expected in zip(sizes, measured, rates, planned):
        # One micro-batch, its forward a third of the pass: the report predicts the measured time.
        reports.append(handoff.report(b, t / 3, b, 1 / 3, rate, expected, max(planned)))
    found = handoff.plan(reports)
    if found is None:
        return max(measured), sizes, False
    done = tuple(r.done + kept + taken for r, kept, taken in zip(reports, found.kept, found.received))
    return found.step_seconds, done, True


def simulate(plan: Plan, steps: int, *, noise: float = 0.05, slowdowns: tuple[Slowdown, ...] = (), seed: int = 0,
             threshold: float = THRESHOLD) -> Simulation:
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"--simulate {steps!r}: expected a positive number of steps")
    if not (isinstance(noise, (int, float)) and math.isfinite(noise) and 0 <= noise <= 1):
        raise ValueError(f"--noise {noise!r}: expected the relative spread of step times, between 0 and 1")
    ranks = len(plan.members)
    for slowdown in slowdowns:
        if not 0 <= slowdown.rank < ranks:
            raise ValueError(f"--slowdown {slowdown.rank}:{slowdown.step}:{slowdown.factor:g}: rank {slowdown.rank} "
                             f"does not exist; the plan has {ranks} training devices (ranks 0 to {ranks - 1})")
    profiles = [(m.cost.fixed, m.cost.per_sample) for m in plan.members]
    caps = [m.cost.cap for m in plan.members]
    overhead = plan.exposed_comm_s + plan.update_s
    rebalancer = Rebalancer(plan.global_batch, plan.split.sizes, profiles, memory_caps=caps, threshold=threshold,
                            **TRAINING_SETTINGS)
    generator = torch.Generator().manual_seed(seed)
    static_times, rebalanced_times, rebalances, handoffs = [], [], [], []
    ideal_total, ideal_cache = 0.0, {}
    for step in range(steps):
        speed = torch.ones(ranks, dtype=torch.float64)
        for slowdown in slowdowns:
            if step >= slowdown.step:
                speed[slowdown.rank] *= slowdown.factor
        slowness = torch.exp(noise * torch.randn(ranks, generator=generator, dtype=torch.float64)) / speed
        static = _observed(plan.split.sizes, profiles, caps, slowness)
        static_times.append(max(static) + overhead)
        measured = _observed(rebalancer.sizes, profiles, caps, slowness)
        rates = [c * float(slow) for (_, c), slow in zip(profiles, slowness)]
        compute, done, handed = _handed_off(rebalancer, measured, rates, caps)
        rebalanced_times.append(compute + overhead)
        if handed:
            handoffs.append(step)
            measured = _observed(done, profiles, caps, slowness)
        decision = rebalancer.observe(measured, done)
        if decision.changed:
            rebalances.append(Rebalance(step, decision.predicted_gain, decision.sizes))
        key = tuple(speed.tolist())
        if key not in ideal_cache:
            true = [(a / s, c / s) for (a, c), s in zip(profiles, key)]
            ideal_cache[key] = solve_split(plan.global_batch, true, caps, "accumulate").step_time + overhead
        ideal_total += ideal_cache[key]
    return Simulation(steps=steps, noise=noise, slowdowns=tuple(slowdowns), static_s=sum(static_times),
                      rebalanced_s=sum(rebalanced_times), ideal_s=ideal_total, rebalances=tuple(rebalances),
                      handoffs=tuple(handoffs),
                      final_sizes=rebalancer.sizes, static_step_s=tuple(static_times),
                      rebalanced_step_s=tuple(rebalanced_times))
