"""Handing a straggler's samples to the other ranks within the step it straggles in.

The rebalancer reacts to a card that starts throttling on the step after: the step in
which it happens runs at the old split, and every other rank waits for the slow one (a
bottleneck card at a quarter of its speed makes that step four times as long). The
handoff catches it inside the step. Every rank times a first part of its share (its
check), then reports: how many samples it has done, in how many seconds, how many of
its own are left, what one more pass and one more sample would cost it now, and
whether it is a giver, a rank whose predicted finish is over the step's planned time
by more than a threshold. The reports are all-reduced asynchronously: a rank that is not a giver goes on with its own
samples and reads them only when done; a giver waits for them at once (the others
report a part into the step, so it seldom waits). Every rank then computes the same
plan from the same reports: which of the givers' remaining samples each giver keeps,
and how many of the rest each rank takes on after its own share.

A rank predicts the rest of its share from its check by the part of its compute the
check took in recent steps (CheckShare): that part holds the fixed cost of a pass,
which a rate per sample from the check alone would spread over its few samples (on a
small model, three times the real rate). The check and the predicted rest, two passes
of different sizes, give the line a + c·b of one pass: what a receiver pays for taking
on samples, and a giver for keeping some.

The plan is list scheduling of unit jobs on ranks of known speed, which is exact for
the makespan: each given-up sample in turn goes to the rank that would finish it first
(a giver only up to its own remaining samples; the first sample of a pass pays for the
pass), ties to the lower rank. It only uses comparisons and IEEE additions,
multiplications and divisions of the reported float64 numbers, so every host computes
the same plan bit for bit. It is adopted only when it shortens the step by MIN_GAIN;
otherwise every rank does its own share as dealt.

Free of torch and of torch.distributed: the trainer times, gathers and deals the samples.
"""

import heapq
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace

# A rank hands samples off when its predicted finish is this much over the step's
# planned time: far above the noise of a timed quarter of a share (a few percent on
# GPUs; on CPU processes sharing 2 cores, 25% was crossed once in 40 steps, and the
# move it made cost that step 20%), below a card that throttles hard. Milder
# slowdowns are the rebalancer's, one step later.
GIVER_THRESHOLD = 0.5
# The least shortening of the step, as a fraction, that a plan must bring.
MIN_GAIN = 0.1
# The first part of its share a rank times before it reports.
CHECK_FRACTION = 0.25
# Steps whose check share (their median) predicts the next step's rest, and how many
# it takes at least: one step's share, early in a run, was off enough to make a rank
# a giver that was not slow.
CHECK_SHARE_MEMORY = 5
CHECK_SHARE_LEAST = 3
# One report's fields, in order: what the all-reduce carries per rank.
REPORT_FIELDS = ("done", "seconds", "remaining", "rate", "pass_seconds", "giver")


def check_size(samples: int, cap: int | None = None) -> int:
    """The samples a rank with `samples` in the step times before it reports: a
    quarter, at least one (none when it has none); over a memory `cap`, its first
    micro-batch, so that the check costs no pass of its own."""
    if cap is not None and samples > cap:
        return cap
    return 0 if samples == 0 else max(1, math.ceil(samples * CHECK_FRACTION))


class CheckShare:
    """The part of a rank's compute time for its own share that its check takes, over
    the part of the share's samples it holds (1 when time follows samples; above 1 when
    a pass has a fixed cost): the median of the last CHECK_SHARE_MEMORY steps, once
    there are CHECK_SHARE_LEAST. A speed change scales both parts alike, so it does not
    move this."""

    def __init__(self):
        self.recent: list[float] = []

    def add(self, check_samples: int, check_seconds: float, samples: int, seconds: float) -> None:
        """One step's check and its whole own share (the check included)."""
        if 0 < check_samples < samples and 0 < check_seconds < seconds and math.isfinite(seconds):
            self.recent = (self.recent + [(check_seconds / seconds) / (check_samples / samples)])[-CHECK_SHARE_MEMORY:]

    def value(self) -> float | None:
        return statistics.median(self.recent) if len(self.recent) >= CHECK_SHARE_LEAST else None


@dataclass(frozen=True)
class Report:
    """One rank's report at its check."""

    done: int              # samples done so far in this step
    seconds: float         # compute seconds they took
    remaining: int         # own samples still to do
    rate: float            # seconds per further sample, now
    pass_seconds: float    # the fixed cost of a further pass, now
    giver: bool

    def cost(self, samples: int) -> float:
        """Seconds of one more pass over `samples` samples (none: no pass)."""
        return self.pass_seconds + samples * self.rate if samples > 0 else 0.0

    def finish(self) -> float:
        """Predicted compute seconds of the rank's own share."""
        return self.seconds + self.cost(self.remaining)

    def row(self) -> list[float]:
        return [float(self.done), self.seconds, float(self.remaining), self.rate, self.pass_seconds,
                float(self.giver)]

    @classmethod
    def from_row(cls, row: Sequence[float]) -> "Report":
        done, seconds, remaining, rate, pass_seconds, giver = row
        return cls(int(done), seconds, int(remaining), rate, pass_seconds, giver != 0.0)


def report(done: int, seconds: float, remaining: int, check_share: float | None, model_rate: float,
           planned_step: float) -> Report:
    """This rank's report after its check: `done` samples in `seconds`, `remaining` to
    go. The rest of its share is predicted by `check_share` (CheckShare.value(); None
    before it has one: no prediction yet, so not a giver), and the rank is a giver when
    its share would end more than GIVER_THRESHOLD over `planned_step`, the step's
    predicted compute time. `model_rate`: seconds per sample for a rank with no samples."""
    if not (math.isfinite(seconds) and seconds >= 0):
        raise ValueError(f"seconds = {seconds!r}: expected the check's finite, non-negative compute time")
    if not (math.isfinite(model_rate) and model_rate > 0):
        raise ValueError(f"model_rate = {model_rate!r}: expected positive seconds per sample")
    if check_share is not None and not (math.isfinite(check_share) and check_share > 0):
        raise ValueError(f"check_share = {check_share!r}: expected a positive ratio, or None")
    if done == 0 or seconds == 0:
        return Report(done, seconds, remaining, model_rate, 0.0, False)
    if check_share is None or remaining == 0:
        return Report(done, seconds, remaining, seconds / done, 0.0, False)
    rest = seconds / (check_share * done / (done + remaining)) - seconds
    # The pass line through the check (done, seconds) and the predicted rest (remaining, rest).
    rate, pass_seconds = rest / remaining, 0.0
    if remaining != done and rest > 0:
        slope = (rest - seconds) / (remaining - done)
        if slope > 0 and seconds - slope * done >= 0:
            rate, pass_seconds = slope, seconds - slope * done
    mine = Report(done, seconds, remaining, rate, pass_seconds, False)
    return replace(mine, giver=mine.finish() > (1 + GIVER_THRESHOLD) * planned_step)


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
    plan that shortens the step by MIN_GAIN."""
    givers = {i for i, r in enumerate(reports) if r.giver and r.remaining > 0}
    if not givers:
        return None
    without = max(r.finish() for r in reports)
    # A giver's samples so far, and a receiver's whole share, before its one more pass.
    bases = [r.seconds if i in givers else r.finish() for i, r in enumerate(reports)]
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
