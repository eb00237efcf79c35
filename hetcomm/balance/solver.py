"""The integer split of a global batch across ranks of different speeds and memory
that minimises the slowest rank's step time, exactly.

Rank i's compute time for b samples per optimizer step is

    t_i(b) = k_i(b)·a_i + c_i·b,   k_i(b) = ceil(b / m_i) micro-steps (0 when b = 0),

where m_i is the largest micro-batch the rank runs at once: its memory cap under
policy "accumulate" (more samples become more micro-steps, each paying a_i again), and
the whole global batch under policy "move" (the cap is a hard bound on b instead, and
what does not fit goes to ranks with room). A rank given no samples does no forward or
backward pass and takes no time; it still joins the gradient all-reduce.

Each t_i is non-decreasing in b, so "every rank finishes within T" allows rank i at
most n_i(T) samples, and the best split is reached at the smallest T with
Σ n_i(T) ≥ B. That T is one of the finitely many values t_i(b), and n_i(T) only changes
there. A bracket search (interpolation, safeguarded by bisection; each n(T) a few
vector operations over the ranks) narrows T down until at most a few samples per rank
separate the bracket's ends; the samples in between are then listed with the time at
which their rank finishes each, and the one that brings the total to B gives T exactly.
Every time is evaluated by the same float formula that reports it, so "exact" means
exact for the model as evaluated, not up to a tolerance.

Among the optimal splits the solver returns the one in which every rank takes the most
samples it can finish strictly before the optimum T, and the samples still missing go,
one at a time, to the ranks that finish exactly at T in rank order: lower ranks first.
"""

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor

from hetcomm.balance.profile import StepTimeProfile

POLICIES = ("accumulate", "move")

# The bracket search stops once at most this many samples per rank separate its ends;
# the samples in between are then enumerated and sorted.
ENUMERATION_LIMIT_PER_RANK = 4


@dataclass(frozen=True)
class Split:
    """One optimizer step's split of the global batch, and what the model predicts for it."""

    sizes: tuple[int, ...]                      # samples per rank; they sum to the global batch
    micro_batches: tuple[tuple[int, ...], ...]  # per rank, the micro-batch of each micro-step (() when 0)
    rank_times: tuple[float, ...]               # predicted compute seconds per rank
    step_time: float                            # the slowest rank's: max(rank_times)
    equal_step_time: float                      # the same for an equal split (accumulating where over a cap)
    policy: str

    @property
    def global_batch(self) -> int:
        return sum(self.sizes)

    @property
    def throughput(self) -> float:
        """Predicted samples per second of compute."""
        return self.global_batch / self.step_time

    @property
    def speedup_over_equal(self) -> float:
        """equal_step_time / step_time; with a_i = 0 and an evenly divisible batch, the
        mean of the ranks' throughputs over the slowest one's."""
        return self.equal_step_time / self.step_time


def _times(sizes: Tensor, fixed: Tensor, per_sample: Tensor, micro: Tensor) -> Tensor:
    """ceil(b / m)·a + c·b, elementwise: the one formula every time is evaluated by."""
    steps = (sizes + micro - 1) // micro
    return steps.to(torch.float64) * fixed + per_sample * sizes.to(torch.float64)


@contextmanager
def _one_thread() -> Iterator[None]:
    """The solver's work is many small vector operations: split across threads, each
    waits for every thread, and a busy core stalls it (torch.floor on 10,000 elements
    took 1.5 ms instead of 2 us with the other core busy; 10,000 GPUs were planned in
    2-7 s instead of 0.5 s). One thread while it runs; the caller's count restored."""
    threads = torch.get_num_threads()
    if threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _miscounted(values: Sequence) -> Iterator[tuple[int, object]]:
    """(index, value) of each entry that is not a non-negative integer; plain ints are
    checked inline, which keeps 10,000 ranks' validation to a millisecond."""
    for i, value in enumerate(values):
        if not (value.__class__ is int or _is_count(value)) or value < 0:
            yield i, value


class _Ranks:
    """The validated problem as vectors over the ranks."""

    def __init__(self, global_batch: int, profiles: Sequence, memory_caps: Sequence | None, policy: str,
                 min_per_rank: int | Sequence[int]):
        if policy not in POLICIES:
            raise ValueError(f"policy = {policy!r}: expected one of {POLICIES}")
        if not _is_count(global_batch) or global_batch < 1:
            raise ValueError(f"global_batch = {global_batch!r}: expected a positive integer")
        per_rank = not _is_count(min_per_rank)
        if per_rank and not (isinstance(min_per_rank, Sequence) and all(_is_count(m) and m >= 0
                                                                          for m in min_per_rank)):
            raise ValueError(f"min_per_rank = {min_per_rank!r}: expected a non-negative integer, or one per rank")
        if not per_rank and min_per_rank < 0:
            raise ValueError(f"min_per_rank = {min_per_rank!r}: expected a non-negative integer")
        if len(profiles) == 0:
            raise ValueError("profiles is empty: expected one (fixed, per_sample) profile per rank")
        try:
            table = torch.tensor(profiles, dtype=torch.float64)
        except (TypeError, ValueError, RuntimeError):
            table = None
        if table is None or table.shape != (len(profiles), 2):
            raise ValueError("profiles: expected a sequence of (fixed, per_sample) pairs of numbers, one per rank")
        fixed, per_sample = table[:, 0].contiguous(), table[:, 1].contiguous()
        bad = ~(fixed.isfinite() & per_sample.isfinite() & (fixed >= 0) & (per_sample > 0))
        if bad.any():
            i = int(bad.nonzero()[0])
            raise ValueError(f"profiles[{i}] = (fixed={fixed[i].item()!r}, per_sample={per_sample[i].item()!r}): "
                             f"fixed must be finite and >= 0, per_sample finite and > 0 (seconds)")
        ranks = len(profiles)
        if per_rank:
            if len(min_per_rank) != ranks:
                raise ValueError(f"min_per_rank has {len(min_per_rank)} entries for {ranks} ranks; expected one per "
                                 f"rank, or one integer for all")
            if sum(min_per_rank) > global_batch:
                raise ValueError(f"global_batch = {global_batch} is smaller than the sum of min_per_rank, "
                                 f"{sum(min_per_rank)}")
        elif ranks * min_per_rank > global_batch:
            raise ValueError(f"global_batch = {global_batch} is smaller than {ranks} ranks × min_per_rank = "
                             f"{min_per_rank}; pass a larger global batch, or min_per_rank=0 to let a rank "
                             f"sit a step out")
        low = list(min_per_rank) if per_rank else [min_per_rank] * ranks
        caps = self._caps(memory_caps, ranks, global_batch)
        for i, (cap, least) in enumerate(zip(caps.tolist(), low)):
            # A cap bounds a rank's share under "move", its micro-batch under "accumulate".
            if cap < least and (policy == "move" or cap == 0):
                named = f"min_per_rank[{i}]" if per_rank else "min_per_rank"
                raise ValueError(f"memory_caps[{i}] = {cap} is below {named} = {least}: that rank cannot hold its "
                                 f"minimum share; pass min_per_rank=0 to let it sit out")
        if policy == "move":
            high = caps.clamp(max=global_batch)
            micro = torch.full_like(caps, global_batch)
            if int(high.sum()) < global_batch:
                raise ValueError(f"memory_caps add up to {int(caps.sum())} samples, fewer than global_batch = "
                                 f"{global_batch}: the ranks cannot hold one global batch at once; use "
                                 f"policy='accumulate' or a smaller global batch")
        else:
            high = torch.where(caps > 0, global_batch, 0)
            micro = caps.clamp(min=1, max=global_batch)
            if int(high.sum()) < global_batch:
                raise ValueError(f"memory_caps are all 0: no rank can hold a single sample, so global_batch = "
                                 f"{global_batch} cannot be placed")
        self.global_batch, self.policy = global_batch, policy
        self.fixed, self.per_sample = fixed, per_sample
        self.caps, self.micro, self.high = caps, micro, high
        self.low = torch.tensor(low, dtype=torch.int64)

    @staticmethod
    def _caps(memory_caps: Sequence | None, ranks: int, global_batch: int) -> Tensor:
        """Caps as int64, None (no cap) becoming the global batch."""
        if memory_caps is None:
            return torch.full((ranks,), global_batch, dtype=torch.int64)
        if len(memory_caps) != ranks:
            raise ValueError(f"memory_caps has {len(memory_caps)} entries for {ranks} ranks; expected one per "
                             f"rank (None for no cap)")
        caps = [global_batch if cap is None else cap for cap in memory_caps]
        for i, cap in _miscounted(caps):
            raise ValueError(f"memory_caps[{i}] = {cap!r}: expected a non-negative integer or None")
        return torch.tensor(caps, dtype=torch.int64)

    def times(self, sizes: Tensor, micro: Tensor | None = None) -> Tensor:
        """t_i(sizes_i) in seconds, micro-steps of at most `micro` samples (self.micro by default)."""
        return _times(sizes, self.fixed, self.per_sample, self.micro if micro is None else micro)

    def most_within(self, deadline: float) -> Tensor:
        """Per rank, the most samples in [low, high] it finishes within `deadline`
        seconds, raised to `low` where even that takes longer."""
        micro, high = self.micro.to(torch.float64), self.high.to(torch.float64)
        full_step = self.fixed + self.per_sample * micro
        # A closed-form estimate (full micro-steps, then a partial one), corrected below
        # against the very formula times() evaluates, so rounding cannot make it wrong.
        whole = torch.floor(deadline / full_step).clamp(min=0).minimum(high)
        partial = torch.floor((deadline - whole * full_step - self.fixed) / self.per_sample)
        partial = partial.clamp(min=0).minimum(micro - 1)
        sizes = (whole * micro + partial).minimum(high).to(torch.int64)
        while True:
            grow = (sizes < self.high) & (self.times(sizes + 1) <= deadline)
            if not grow.any():
                break
            sizes += grow.to(torch.int64)
        while True:
            shrink = (sizes > 0) & (self.times(sizes) > deadline)
            if not shrink.any():
                break
            sizes -= shrink.to(torch.int64)
        return torch.maximum(sizes, self.low)

    def optimal_deadline(self) -> float:
        """T*: the smallest T at which the ranks hold B samples (Σ low < B)."""
        # A bracket: by `early` the ranks finish fewer than B samples, by `late` at least B.
        # T = 0 admits nothing beyond the minimum, since every t_i(1) > 0.
        early, late = 0.0, self.times(self.high).max().item()
        early_count, late_count = int(self.low.sum()), int(self.most_within(late).sum())
        # Narrow it until few samples separate its ends. The count grows about linearly
        # in T, so interpolating for B usually lands within a few samples; a bisection
        # follows any step that did not halve the gap, which bounds the worst case.
        bisect = False
        while late_count - early_count > ENUMERATION_LIMIT_PER_RANK * len(self.fixed):
            gap = late_count - early_count
            middle = early + (late - early) * (0.5 if bisect else (self.global_batch - 0.5 - early_count) / gap)
            if not early < middle < late:
                middle = early + (late - early) / 2
                if not early < middle < late:
                    break  # adjacent floats: nothing lies between them
            count = int(self.most_within(middle).sum())
            if count >= self.global_batch:
                late, late_count = middle, count
            else:
                early, early_count = middle, count
            bisect = late_count - early_count > gap / 2
        # Each sample the ranks take between the two ends comes with the time at which its
        # rank finishes it; T* is the one that brings the total to B.
        first = self.most_within(early)
        added = self.most_within(late) - first
        rank = torch.repeat_interleave(added)   # rank i listed added[i] times
        nth = torch.arange(len(rank)) - (torch.cumsum(added, 0) - added)[rank] + 1
        finish = _times(first[rank] + nth, self.fixed[rank], self.per_sample[rank], self.micro[rank])
        return torch.kthvalue(finish, self.global_batch - early_count).values.item()

    def optimal_sizes(self) -> Tensor:
        if int(self.low.sum()) == self.global_batch:
            return self.low.clone()
        deadline = self.optimal_deadline()
        base = self.most_within(math.nextafter(deadline, 0.0))   # finished strictly before T*
        room = self.most_within(deadline) - base                           # reaching T* exactly
        missing = self.global_batch - int(base.sum())
        before = torch.cumsum(room, 0) - room
        return base + torch.minimum((missing - before).clamp(min=0), room)

    def micro_batches(self, sizes: Tensor) -> tuple[tuple[int, ...], ...]:
        """Each rank's samples as ceil(b / m) micro-steps of near-equal size (larger
        first): the same time under the model as filling each to m, less peak memory."""
        steps = ((sizes + self.micro - 1) // self.micro).tolist()
        plan = []
        for size, count in zip(sizes.tolist(), steps):
            if count == 0:
                plan.append(())
                continue
            quotient, remainder = divmod(size, count)
            plan.append((quotient + 1,) * remainder + (quotient,) * (count - remainder))
        return tuple(plan)

    def equal_step_time(self) -> float:
        """The slowest rank's time under an equal split (the first B mod n ranks one more),
        run as it would have to be: accumulating micro-steps wherever a share exceeds a cap."""
        sizes = torch.tensor(equal_split(self.global_batch, len(self.fixed)), dtype=torch.int64)
        times = self.times(sizes, micro=self.caps.clamp(min=1, max=self.global_batch))
        times[(self.caps == 0) & (sizes > 0)] = math.inf
        return times.max().item()


def equal_split(global_batch: int, ranks: int) -> tuple[int, ...]:
    """The global batch split as evenly as integers allow: the first B mod n ranks one more."""
    base, extra = divmod(global_batch, ranks)
    return tuple(base + (r < extra) for r in range(ranks))


def solve_split(global_batch: int, profiles: Sequence[StepTimeProfile | tuple[float, float]],
                memory_caps: Sequence[int | None] | None = None, policy: str = "accumulate", *,
                min_per_rank: int | Sequence[int] = 1) -> Split:
    """The integer split b_1..b_n of `global_batch` (Σ b_i = B exactly) that minimises the
    slowest rank's compute time max_i t_i(b_i); exact and deterministic (see the module
    docstring for the model, the algorithm and the tie rule).

    Args:
        global_batch: B, samples per optimizer step over all ranks.
        profiles: per rank a StepTimeProfile or (fixed, per_sample) pair, seconds.
        memory_caps: per rank the largest micro-batch it can hold, or None for no cap.
        policy: "accumulate" (a rank may take more than its cap as extra micro-steps) or
            "move" (caps are hard bounds; the excess goes to ranks with room).
        min_per_rank: samples every rank must get. The default 1 keeps every rank
            working, so B must be at least the number of ranks; 0 lets the solver give
            a card too slow to help nothing at all (it still joins the all-reduce). Or
            one minimum per rank (samples some ranks have already done, say).

    Raises ValueError naming the argument: an unknown policy, B < 1, an empty profile
    list, a negative, zero-speed or non-finite profile, B < ranks × min_per_rank (or
    their sum), a minimum a rank's cap cannot hold (a cap of 0; any smaller cap under
    policy "move"), or caps that cannot hold B under policy "move".
    """
    with _one_thread():
        ranks = _Ranks(global_batch, profiles, memory_caps, policy, min_per_rank)
        sizes = ranks.optimal_sizes()
        times = ranks.times(sizes)
        return Split(sizes=tuple(sizes.tolist()), micro_batches=ranks.micro_batches(sizes),
                     rank_times=tuple(times.tolist()), step_time=times.max().item(),
                     equal_step_time=ranks.equal_step_time(), policy=policy)


def optimal_rank_times(global_batch: int, profiles: Sequence[StepTimeProfile | tuple[float, float]],
                       memory_caps: Sequence[int | None] | None = None, policy: str = "accumulate", *,
                       min_per_rank: int | Sequence[int] = 1) -> tuple[float, ...]:
    """solve_split(...).rank_times alone, for a caller that weighs many candidate
    clusters by their step time (the planner's slow-card analysis re-plans 10,000 GPUs
    sixteen times): the same split and times, without the micro-batches and the equal
    split's time, which cost as much again. Same arguments and errors as solve_split."""
    with _one_thread():
        ranks = _Ranks(global_batch, profiles, memory_caps, policy, min_per_rank)
        return tuple(ranks.times(ranks.optimal_sizes()).tolist())


def predict_rank_times(sizes: Sequence[int], profiles: Sequence[StepTimeProfile | tuple[float, float]],
                       memory_caps: Sequence[int | None] | None = None,
                       policy: str = "accumulate") -> tuple[float, ...]:
    """Each rank's predicted compute time for a given split, under the same model and
    policy as solve_split. Raises ValueError if a size is not a non-negative integer, or
    the split breaks a cap that the policy treats as hard."""
    if len(sizes) != len(profiles):
        raise ValueError(f"sizes has {len(sizes)} entries for {len(profiles)} profiles; expected one per rank")
    for i, size in _miscounted(sizes):
        raise ValueError(f"sizes[{i}] = {size!r}: expected a non-negative integer")
    with _one_thread():
        ranks = _Ranks(sum(sizes), profiles, memory_caps, policy, min_per_rank=0)
        split = torch.tensor(sizes, dtype=torch.int64)
        over = split > ranks.high
        if over.any():
            i = int(over.nonzero()[0])
            raise ValueError(f"sizes[{i}] = {sizes[i]} exceeds memory_caps[{i}] = {int(ranks.caps[i])}, a hard "
                             f"bound under policy {policy!r}")
        return tuple(ranks.times(split).tolist())
