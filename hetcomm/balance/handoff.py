"""Handing a straggler's samples to the other ranks within the step it straggles in.

The rebalancer reacts to a card that starts throttling on the step after: the step in
which it happens runs at the old split, and every other rank waits for the slow one (a
bottleneck card at a quarter of its speed makes that step four times as long). The
handoff catches it inside the step, at no cost to a step without a straggler: every rank
times the forward of its first micro-batch (the time from drawing the micro-batch to
its backward call) and reports, before that backward, what its own share will cost at
the pace of that forward and whether it is a giver, a rank whose predicted share is
over the step's planned time by more than a threshold. The reports are all-reduced
asynchronously: a rank that is not a giver runs its backward and the rest of its share
and reads them only when done; a giver waits for them at once (the others report one
forward into the step, so it seldom waits). Every rank then computes the same plan from
the same reports: how many of its own samples each giver keeps, and how many of the
given-up rest each other rank takes on after its own share. A giver that keeps fewer
samples than its first micro-batch holds drops that forward (it runs no backward of
it) and does the ones it keeps in a new pass; one that keeps more backs the first
micro-batch up and goes on to the samples it keeps.

A rank predicts its share from the forward by the part of its compute that forward
took in recent steps (ForwardShare), so the pass's fixed costs and the backward's
weight are measured, not assumed. A speed change scales the forward and the rest
alike, so it does not move that part.

The plan is list scheduling of unit jobs on ranks of known speed, which is exact for
the makespan: each given-up sample in turn goes to the rank that would finish it first
(a giver only up to its own samples; the first sample of a pass pays for the pass),
ties to the lower rank. It only uses comparisons and IEEE additions, multiplications
and divisions of the reported float64 numbers, so every host computes the same plan bit
for bit. It is adopted only when it shortens the step by MIN_GAIN; otherwise every rank
does its own share as dealt (a giver backs its first micro-batch up after all).

Free of torch and of torch.distributed: the loop times, gathers and deals the samples.
"""

import heapq
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

# A rank hands samples off when its predicted share is this much over the step's
# planned time: far above the noise of a timed forward (a few percent on GPUs; on CPU
# processes sharing 2 cores, 25% was crossed once in 40 steps, and the move it made cost
# that step 20%), below a card that throttles hard. Milder slowdowns are the
# rebalancer's, one step later.
GIVER_THRESHOLD = 0.5
# The least shortening of the step, as a fraction, that a plan must bring.
MIN_GAIN = 0.1
# Steps whose forward share (their median) predicts the next step's share, and how many
# it takes at least: one step's part, early in a run, was off enough to make a rank a
# giver that was not slow.
FORWARD_SHARE_MEMORY = 5
FORWARD_SHARE_LEAST = 3
# One report's fields, in order: what the all-reduce carries per rank.
REPORT_FIELDS = ("done", "seconds", "remaining", "rate", "pass_seconds", "giver", "as_dealt")


class ForwardShare:
    """The part of a rank's compute time for its own share that the forward of its first
    micro-batch takes, over the part of the share's samples that micro-batch holds (about
    a third for one micro-batch: a backward costs about twice a forward): the median of
    the last FORWARD_SHARE_MEMORY steps, once there are FORWARD_SHARE_LEAST."""

    def __init__(self):
        self.recent: list[float] = []

    def add(self, first_samples: int, forward_seconds: float, samples: int, seconds: float) -> None:
        """One step's first forward and its whole own share (that forward included)."""
        if 0 < first_samples <= samples and 0 < forward_seconds < seconds and math.isfinite(seconds):
            self.recent = (self.recent + [(forward_seconds / seconds) / (first_samples / samples)]
                           )[-FORWARD_SHARE_MEMORY:]

    def value(self) -> float | None:
        return statistics.median(self.recent) if len(self.recent) >= FORWARD_SHARE_LEAST else None


@dataclass(frozen=True)
class Report:
    """One rank's report at the backward call of its first micro-batch. A giver has done
    none of its samples (`remaining` is its whole share, `seconds` the forward it may
    drop); any other rank reports its share as done (`done`) in its predicted `seconds`,
    the base to which samples taken on add."""

    done: int              # samples counted as done
    seconds: float         # compute seconds before any further pass
    remaining: int         # own samples still open to the plan (a giver's)
    rate: float            # seconds per further sample, now
    pass_seconds: float    # the fixed cost of a further pass, now
    giver: bool
    as_dealt: float        # predicted compute seconds of the rank's own share as dealt

    def cost(self, samples: int) -> float:
        """Seconds of one more pass over `samples` samples (none: no pass)."""
        return self.pass_seconds + samples * self.rate if samples > 0 else 0.0

    def row(self) -> list[float]:
        return [float(self.done), self.seconds, float(self.remaining), self.rate, self.pass_seconds,
                float(self.giver), self.as_dealt]

    @classmethod
    def from_row(cls, row: Sequence[float]) -> "Report":
        done, seconds, remaining, rate, pass_seconds, giver, as_dealt = row
        return cls(int(done), seconds, int(remaining), rate, pass_seconds, giver != 0.0, as_dealt)


def report(first: int, seconds: float, own: int, forward_share: float | None, model_rate: float,
           planned_rank: float, planned_step: float) -> Report:
    """This rank's report after the forward of its first micro-batch (`first` samples, in
    `seconds`) of a share of `own` samples. `forward_share`: ForwardShare.value() (None
    before it has one: the share is predicted by the model, `planned_rank` seconds, and
    the rank is no giver). The rank is a giver when its share would end more than
    GIVER_THRESHOLD over `planned_step`, the step's predicted compute time. `model_rate`:
    seconds per sample for a rank with no samples."""
    if not (math.isfinite(seconds) and seconds >= 0):
        raise ValueError(f"seconds = {seconds!r}: expected the forward's finite, non-negative compute time")
    if not (math.isfinite(model_rate) and model_rate > 0):
        raise ValueError(f"model_rate = {model_rate!r}: expected positive seconds per sample")
    if forward_share is not None and not (math.isfinite(forward_share) and forward_share > 0):
        raise ValueError(f"forward_share = {forward_share!r}: expected a positive ratio, or None")
    if not 0 <= first <= own or (first == 0) != (own == 0):
        raise ValueError(f"first = {first!r} of own = {own!r}: expected a first micro-batch of 1..own samples "
                         f"(0 of none)")
    if own == 0:
        return Report(0, 0.0, 0, model_rate, 0.0, False, 0.0)
    if forward_share is None or seconds == 0:
        predicted = planned_rank if math.isfinite(planned_rank) and planned_rank > 0 else own * model_rate
        return Report(own, predicted, 0, predicted / own, 0.0, False, predicted)
    predicted = seconds / (forward_share * first / own)
    rate = predicted / own
    if predicted > (1 + GIVER_THRESHOLD) * planned_step:
        return Report(0, seconds, own, rate, 0.0, True, predicted)
    return Report(own, predicted, 0, rate, 0.0, False, predicted)


@dataclass(frozen=True)
class Handoff:
    """A plan: per rank, how many of its own remaining samples it keeps (all, for a
    rank that gives none up) and how many of the given-up ones it takes on."""

    kept: tuple[int, ...]
    received: tuple[int, ...]
    step_seconds: float        # predicted compute time of the step under the plan
    without_seconds: float     # and as dealt

    @property
    def moved(self) -> int:
        return sum(self.received)

    def sources(self, remaining: Sequence[int], rank: int) -> list[tuple[int, int, int]]:
        """What `rank` takes on, as (giver, first, count): positions first..first+count-1
        of the giver's own remaining samples (their order as dealt). The given-up
        samples are the givers' tails, in rank order, dealt to the receivers in rank
        order."""
        pool = [(g, kept, r - kept) for g, (kept, r) in enumerate(zip(self.kept, remaining)) if r > kept]
        start = sum(self.received[:rank])
        stop = start + self.received[rank]
        out, offset = [], 0
        for giver, kept, count in pool:
            lo, hi = max(start, offset), min(stop, offset + count)
            if lo < hi:
                out.append((giver, kept + lo - offset, hi - lo))
            offset += count
        return out


def plan(reports: Sequence[Report]) -> Handoff | None:
    """The plan for these reports (the same on every rank), or None: no giver, or no
    plan that shortens the step by MIN_GAIN.

    A rank that reported itself a giver (over the planned step) gives only if its share
    is also more than GIVER_THRESHOLD over the quickest rank's: otherwise it is no
    straggler beside the others and takes samples on like any receiver, after its own
    share. A rank whose forward a hiccup slowed past the planned step, in the same step
    as a card that throttles, would else leave the throttled card nobody to give to (a
    trainer test's rank 0 read 1.53x its planned step, rank 1 17x: no plan)."""
    quickest = min(r.as_dealt for r in reports)
    givers = {i for i, r in enumerate(reports)
              if r.giver and r.remaining > 0 and r.as_dealt > (1 + GIVER_THRESHOLD) * quickest}
    if not givers:
        return None
    without = max(r.as_dealt for r in reports)
    # A giver's sunk seconds, and any other rank's whole share, before its one more pass.
    bases = [r.seconds if i in givers else r.as_dealt for i, r in enumerate(reports)]
    taken = [0] * len(reports)
    heap = [(base + r.cost(1), i) for i, (base, r) in enumerate(zip(bases, reports))]
    heapq.heapify(heap)
    for _ in range(sum(reports[g].remaining for g in givers)):
        _, i = heapq.heappop(heap)
        taken[i] += 1
        if not (i in givers and taken[i] == reports[i].remaining):
            heapq.heappush(heap, (bases[i] + reports[i].cost(taken[i] + 1), i))
    step = max(base + r.cost(n) for base, r, n in zip(bases, reports, taken))
    if not step <= (1 - MIN_GAIN) * without:
        return None
    kept = tuple(taken[i] if i in givers else r.remaining for i, r in enumerate(reports))
    received = tuple(0 if i in givers else taken[i] for i in range(len(reports)))
    return Handoff(kept, received, step, without)
