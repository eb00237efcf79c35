"""Rebalancing while training: smoothed per-rank speed from measured compute times,
and a new split only when it is predicted to pay off.

The model of rank i is its profiled shape a_i + c_i·b (one micro-step) divided by a
speed factor s_i: a card that throttles, or shares its host, slows down as a whole.
Each step, s_i is measured as the profile's prediction for the samples the rank
processed over the compute time it took (excluding any wait for other ranks). Without
profiles the shape is a = 0, c = 1 and s_i is plainly the rank's throughput in samples
per second. The estimate is the Hodges-Lehmann estimate (the median of the means of all
pairs, each measurement paired with itself too) of the measurements since the rank's
level was last set (its first measurement, or a confirmed shift) until 1/`smoothing` of
them are in, then an exponentially weighted moving average with weight `smoothing` of
the median of the rank's last three (so a step somewhat off, a page fault or a collector
pause, moves little). Not their mean: the first steps of a run carry warm-up that the
ranks do not share alike (in a BERT benchmark run one rank read 10% slower than its equal
twin in its first balanced step), and a mean holds such a step for the 20 steps it takes
to forget it; the first measurement after a confirmed shift is as suspect (below). A
step far off moves the Hodges-Lehmann estimate little (it takes 29% of the measurements
to carry it away), and on normal noise it is nearly as precise as the mean (its standard
error is sqrt(π/3) of the mean's; a plain median's is sqrt(π/2) of it). The moving
average keeps following slow drifts (a card warming up), while sudden changes are
handled apart (below), so it can be long (0.05: about the last 40 steps).

What every rank does alike in a step (the median of the ranks' deviations from their
estimates) is taken out of each measurement before it is folded in, and followed by a
level of the whole cluster instead, in the same way; the model is the estimates times
that level. Only the speeds relative to one another decide a split, and they must not
depend on when each rank's level was last set: a card that throttles starts a new estimate,
while the others' estimates still hold the slower first steps (warm-up, 5-10% on CPU) or a
speed they had before the throttle freed their shared cores; their relative speeds
were then off by as much, and a split one sample off was held for the rest of a run.

Two things keep the split from chasing noise. The predicted speed-up of the best
split over the current one must exceed `threshold` (0.5% by default; Cannikin uses 5%,
but a change costs nothing here but another count of samples per rank, while what a
split leaves on the table is lost on every step) with a noise margin on the ranks that
would get more samples: each such rank's predicted time is taken 1.5 standard errors
slower (of the difference between its estimate and the current slowest rank's; the
relative standard error of an estimate is sqrt(π/3 · v_i/n) for the Hodges-Lehmann
estimate of n measurements (sqrt(v_i/n) for n ≤ 2, where it is their mean),
sqrt(v_i·α/(2−α)) for the average with weight α, v_i being the averaged squared
relative deviation of one measurement). A new split can only lose by loading a rank
whose speed is over-estimated; the time the slowest rank saves by giving samples away is
as certain as its own per-sample time, and a noisy rank whose share stays put holds
nothing back. So on a quiet cluster the threshold alone decides, on a noisy one (CPU
processes sharing cores) a move onto a rank must stand out of the noise, and the margin
shrinks as measurements come in. The gain must hold on `patience` consecutive steps,
and after a change no other change happens for `cooldown` steps (the new split's
measurements have to come in first).

A split given to start from may rest on one timing that the rebalancer never saw: the
loop deals its first split from the first step's timed parts, which it leaves out of the
estimates (they carry one-time costs that the ranks do not share alike). That split is
as noisy as one measurement, yet the margin would hold it as if the estimates had chosen
it, until they are certain enough to leave it: two equal ranks dealt 36/38 by such a
timing stayed so for 18 steps of a GPT benchmark run, 2.7% slower each. With
`review_first`, once every rank's estimate holds FIRST_REVIEW measurements, the split in
use is reviewed once at the threshold alone, as after a level shift: the best split under
the estimates replaces it if it gains more than the threshold. Not by default: a split
given by the user, or one the estimates chose (after an equal phase), keeps the margin.

A level shift is handled apart, at once: a measurement at least 25% and five of the
rank's own standard deviations away from its estimate (a card that starts throttling,
or a stall) moves the estimate to it on trial, and the split follows on the next step
if that gains more than the threshold, with no patience and no cool-down. The rank's
next measurement settles the trial: still as far on the same side, the shift is real
and a new estimate starts from that measurement alone (the step after a handoff finds
the ranks that took samples over at sizes new to them, 3-10% slow in the benchmark runs,
and the correction for what every rank does alike then reads the shifted rank as fast by
as much; the robust estimate sets that measurement aside as the next ones come in),
which the split follows at once too, this time with the noise margin (the trial's first
split rested on one measurement, and the cool-down it started would hold a card that
throttled one sample too heavy for several steps); otherwise it was a stall, and the estimate (and with it
the split) goes back. The trial's measurement is left out because it is the one to
distrust: the card changed speed within that step, or it handed samples off and its
time was predicted from one micro-batch's forward (8% fast in a benchmark run, which
held the card two samples too heavy for 8 steps). Until the new estimate is long, the
split in use rests on it as much as any other does, so the shifted rank's uncertainty
widens no margin of a move that takes samples off it. A throttling card so costs
one slow step instead of several, and a stall two steps at a split that is off by the
stall's share; a slow step costs far more than a slightly uneven one.

A rank's noise estimate has a floor: the noise of the cluster's level, what every rank
does alike in a step (averaged as a rank's own is, from the same prior). Ranks that share
a host share its load, and load that hits one rank harder than another (a neighbour's
job on one core) comes in episodes of that size; the rank's own estimate, measured over
the calm steps with the trials left out, misses them. Two equal CPU ranks on the shared
2-core host (benchmarks/results/equal_ranks_cpu.json, at the equal split) had a common
part of 0.09-0.36 (RMS of the log) and an own part of 0.04-0.09 (robust sigma) with steps
up to 0.64 off: a shift bound of five own sigmas, 0.2-0.45, was crossed every few steps,
and each crossing moved the split at once and back (16/16 -> 22/10 -> 14/18, held). On
separate cards the level's noise is the ranks' own averaged down, below each one's, and
the floor does not bind: a card that throttles is still followed at once. And no trial
starts before a rank's estimate holds two measurements: a second measurement tested
against a first has twice the variance the bound assumes, and the first steps' warm-up
differs per rank.

While the estimate begun at a confirmed shift is young, a measurement back at the level from
before (within the shift bound of the estimate from before, and nearer it than the new
one) brings that estimate back whole, and the split follows at once: the shift was a
stall of more than one step (a shared host busy for two), or a throttle that ended.
"""

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

from hetcomm.balance.solver import predict_rank_times, solve_split

SPIKE_FILTER = 3   # measurements per rank whose median feeds the average
# What training uses (the trainer, and the planner's simulation of it): with level
# shifts handled apart, the noise margin keeps the remaining changes from chasing noise.
TRAINING_SETTINGS = {"patience": 2, "cooldown": 3}
# The least predicted speed-up worth a change, before the noise margin, the default everywhere
# (the trainer, BalancedLoop, the planner's simulation).
THRESHOLD = 0.005
# A level shift: a measurement this far from the estimate (at least 25%, and at least
# SHIFT_SIGMAS of the rank's own noise) moves the estimate to it on trial. Five sigmas:
# a rank measured every step must not see a false one in thousands of steps, although
# its noise is itself estimated from a few dozen measurements.
SHIFT_MIN_LOG = math.log(1.25)
SHIFT_SIGMAS = 5.0
# A rank's noise (the variance of a measurement's log around the estimate) is assumed
# to be 10% until measured; the assumption counts as PRIOR_WEIGHT measurements, and the
# estimate then averages over about the last VARIANCE_MEMORY measurements. One: the
# assumption errs on the safe side and must not hold the margin up for long.
VARIANCE_PRIOR = 0.1 ** 2
PRIOR_WEIGHT = 1
VARIANCE_MEMORY = 20
# The noise margin in relative standard errors of the difference between a rank that
# would get more samples and the current slowest one. Fed noisy times of the benchmark
# cluster's speeds (51:51:25:12 samples/s, 96 per step; 40 seeds, first split from a
# timing with 5% noise), 1.5 with threshold 1% and smoothing 0.05 left 0.6-1.8% of the
# step time on the table over 40 steps at 2-10% noise, and 0.06-0.25% over 400 steps
# (tests/test_balance_rebalancer.py checks such cases).
MARGIN_ERRORS = 1.5
# The measurements a first split is reviewed at (with review_first). Three: the
# Hodges-Lehmann estimate of three sets one odd step aside, and the cool-down after the
# first split holds no other change before then anyway. Replayed on the 87 logged
# benchmark runs (replay_rebalancer.py), against no review: the split's own loss fell
# from 2.08 to 0.83% of the step time in GPT runs 17-19 (steady), 1.14 to 1.01% in GPT
# runs 1-16, 1.75 to 1.61% in the BERT repeats, a little in the throttled runs; of the
# 78 older runs 41 better, 17 worse (by up to 2.1%), 0.4-0.6 more changes a run.
# Reviews at the first or second measurement lost 0.93 and 1.44% on runs 17-19.
FIRST_REVIEW = 3


def hodges_lehmann(values: Sequence[float]) -> float:
    """The median of the means of all pairs of values, each value paired with itself too."""
    return statistics.median([(a + b) / 2 for k, a in enumerate(values) for b in values[k:]])


@dataclass(frozen=True)
class RebalanceDecision:
    """The split to use from the next step on."""

    sizes: tuple[int, ...]
    changed: bool
    predicted_gain: float   # best split's predicted speed-up over the current split's, minus 1
    required_gain: float    # what it had to exceed: the threshold plus the noise margin


class Rebalancer:
    """The decision logic, free of torch.distributed: feed it every rank's compute time
    each step (update), ask for a decision (decide), apply one (adopt); or all three at
    once in a single process (observe). The global batch never changes.

    Args:
        global_batch, memory_caps, policy, min_per_rank: as for solve_split.
        sizes: the split in use now.
        profiles: per rank the profiled (fixed, per_sample) shape; None: throughput only.
        threshold: the least predicted speed-up, minus 1, worth a change (before the noise margin).
        smoothing: the moving average's weight of a new measurement (until 1/smoothing of them are in,
            their Hodges-Lehmann estimate instead).
        patience: consecutive steps the gain must hold. cooldown: steps after a change with no other.
        review_first: `sizes` rests on one timing the rebalancer does not see: review it once at
            the threshold alone when every rank's estimate holds FIRST_REVIEW measurements.
    """

    def __init__(self, global_batch: int, sizes: Sequence[int], profiles: Sequence | None = None, *,
                 memory_caps: Sequence[int | None] | None = None, policy: str = "accumulate",
                 min_per_rank: int = 1, threshold: float = THRESHOLD, smoothing: float = 0.05, patience: int = 3,
                 cooldown: int = 10, review_first: bool = False):
        ranks = len(sizes)
        if not (isinstance(threshold, (int, float)) and math.isfinite(threshold) and threshold >= 0):
            raise ValueError(f"threshold = {threshold!r}: expected a finite, non-negative fraction (0.02 for 2%)")
        if not (isinstance(smoothing, (int, float)) and 0 < smoothing <= 1):
            raise ValueError(f"smoothing = {smoothing!r}: expected the EWMA weight of a new measurement, in (0, 1]")
        if isinstance(patience, bool) or not isinstance(patience, int) or patience < 1:
            raise ValueError(f"patience = {patience!r}: expected a positive number of consecutive steps")
        if isinstance(cooldown, bool) or not isinstance(cooldown, int) or cooldown < 0:
            raise ValueError(f"cooldown = {cooldown!r}: expected a non-negative number of steps")
        if profiles is None:
            profiles = [(0.0, 1.0)] * ranks
        elif len(profiles) != ranks:
            raise ValueError(f"profiles has {len(profiles)} entries for {ranks} ranks in sizes; expected one per rank")
        # Fails here, at construction, on anything the solver would reject later.
        solve_split(global_batch, profiles, memory_caps, policy, min_per_rank=min_per_rank)
        self.global_batch = global_batch
        self.profiles = [(float(a), float(c)) for a, c in profiles]
        self.memory_caps, self.policy, self.min_per_rank = memory_caps, policy, min_per_rank
        self.threshold, self.smoothing, self.patience, self.cooldown = threshold, smoothing, patience, cooldown
        self.review_first = bool(review_first)
        self.sizes: tuple[int, ...] = ()
        self.speeds = [1.0] * ranks          # s_i over the cluster's level; 1 until the rank is first measured
        self.level = 0.0                     # L, the log of the cluster's level: 0 at the first measurements
        self.level_steps = 0                 # steps averaged into L
        self.level_variance = VARIANCE_PRIOR  # the level's noise, as v_i is a rank's: the floor of each v_i
        self.level_measured = 0              # steps folded into it
        self.recent: list[list[float]] = [[] for _ in range(ranks)]  # last SPIKE_FILTER measurements, common part out
        self.variances = [VARIANCE_PRIOR] * ranks  # v_i: averaged squared log-deviation of a measurement from s_i
        self.measured = [0] * ranks          # measurements folded into v_i
        self.level_count = [0] * ranks       # measurements folded into s_i since its level was last set
        self.since_level: list[list[float]] = [[] for _ in range(ranks)]  # those, while s_i is made of them
        self.trial_from: list[float | None] = [None] * ranks  # the estimate before a shift not yet confirmed
        self.since_shift = [False] * ranks   # the rank's level was last set by a confirmed shift
        # While that estimate is young: the estimate, its count, since_shift and since_level from before the shift.
        self.pre_shift: list[tuple[float, int, bool, list[float]] | None] = [None] * ranks
        self.shifted = False                 # an estimate jumped (or jumped back) in the last update
        self.settled = False                 # a shift was confirmed in the last update
        self.reviewing = False               # the last update brought the first split's review
        self.steps_since_change = 0
        self.streak = 0                      # consecutive decisions that found a gain above threshold
        self.adopt(sizes)
        predict_rank_times(self.sizes, self.profiles, memory_caps, policy)  # a split that breaks a hard cap fails here

    def model(self) -> list[tuple[float, float]]:
        """The current (fixed, per_sample) profiles: the profiled shape over the smoothed speed."""
        level = math.exp(self.level)
        return [(a / (s * level), c / (s * level)) for (a, c), s in zip(self.profiles, self.speeds)]

    def update(self, compute_times: Sequence[float], done: Sequence[int] | None = None) -> None:
        """Folds one step's compute time per rank (seconds for that rank's samples,
        excluding waits) into the speed estimates. `done`: the samples each rank
        processed, when a handoff moved some off the current split. A rank with no
        samples this step has nothing to measure and keeps its estimate."""
        if len(compute_times) != len(self.sizes):
            raise ValueError(f"compute_times has {len(compute_times)} entries for {len(self.sizes)} ranks")
        if done is None:
            done = self.sizes
        elif len(done) != len(self.sizes) or not 0 < sum(done) <= self.global_batch or \
                not all(isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in done):
            raise ValueError(f"done = {list(done)!r}: expected {len(self.sizes)} non-negative integers adding up to "
                             f"at most the global batch {self.global_batch} (less on an epoch's smaller last step)")
        measured = [i for i, size in enumerate(done) if size > 0]   # a rank with no samples has no time
        for i in measured:   # all checked before any is folded in: a bad time leaves the estimates as they were
            seconds = compute_times[i]
            if not (isinstance(seconds, (int, float)) and math.isfinite(seconds) and seconds > 0):
                raise ValueError(f"compute_times[{i}] = {seconds!r}: expected a positive, finite number of seconds "
                                 f"(rank {i} processed {done[i]} samples)")
        predicted = predict_rank_times(tuple(done), self.profiles, self.memory_caps, self.policy)
        # Each measurement in the estimates' units: over the cluster's level, then over what
        # every rank did alike this step (which the level then follows, as an estimate does).
        speeds = {i: predicted[i] / compute_times[i] / math.exp(self.level) for i in measured}
        common, unbias, ranks_in_common = self._common_deviation(speeds)
        self.shifted = self.settled = False
        for i in measured:
            self._measure(i, speeds[i] / math.exp(common), unbias)
        self.level_steps += 1
        self.reviewing = self.review_first and self.level_steps == FIRST_REVIEW \
            and all(n >= FIRST_REVIEW for n in self.level_count)
        self.level += max(self.smoothing, 1 / self.level_steps) * common
        if ranks_in_common >= 2:
            self.level_measured += 1
            weight = 1 / min(self.level_measured + PRIOR_WEIGHT, VARIANCE_MEMORY)
            self.level_variance = (1 - weight) * self.level_variance + weight * common ** 2
        self.steps_since_change += 1

    def _common_deviation(self, speeds: dict[int, float]) -> tuple[float, float, int]:
        """The part of this step's deviations from the estimates that every rank shares
        (log scale): their median over the n ranks with an estimate and no shift (a
        median, so that one noisy rank does not lend its noise to the quiet ones), and
        n / (n - 1), which makes the squared deviations from it estimates of each rank's
        own noise again, on the safe side (for n equally noisy ranks they hold about
        (n - 1) / n of it, a little more for n > 2). A machine
        or job that runs a step slower or faster as a whole (the first steps' warm-up,
        the load of a shared host) moves every rank alike and leaves the best split where
        it was; counted as each rank's own noise, it would widen the margins that hold a
        needed change back (two equal ranks split 39/32 by a noisy first timing stayed so
        for 12 steps). (0, 1) with fewer than two such ranks. Last, the number of ranks it
        was taken over."""
        logs = [math.log(speed / self.speeds[i]) for i, speed in speeds.items()
                if self.recent[i] and self.trial_from[i] is None and not self._beyond_shift_bound(i, speed)]
        return (statistics.median(logs), len(logs) / (len(logs) - 1), len(logs)) if len(logs) >= 2 \
            else (0.0, 1.0, len(logs))

    def _measure(self, i: int, speed: float, unbias: float = 1.0) -> None:
        """Folds rank i's speed measured this step, with what every rank did alike taken
        out, into its estimate."""
        if self.trial_from[i] is not None:
            before, jumped = self.trial_from[i], self.speeds[i]
            self.trial_from[i], self.speeds[i] = None, before
            if self._beyond_shift_bound(i, speed) and (speed > before) == (jumped > before):
                # Confirmed: a new estimate starts from this measurement alone. The trial's is
                # the one to distrust: the card changed speed within that step, or it handed
                # samples off and its time was predicted from one micro-batch's forward.
                self.pre_shift[i] = (before, self.level_count[i], self.since_shift[i], self.since_level[i])
                self._set_level(i, speed)
                self.since_shift[i], self.settled = True, True
                return
            self.shifted = True                              # a stall: back to the estimate from before
        if self.pre_shift[i] is not None and not self._newly_shifted(i):
            self.pre_shift[i] = None                         # the new estimate is long: the old level is history
        if self._back_before_shift(i, speed):
            self.speeds[i], self.level_count[i], self.since_shift[i], self.since_level[i] = self.pre_shift[i]
            self.recent[i], self.pre_shift[i], self.shifted = [speed], None, True
            return
        if self.level_count[i] >= 2 and self._beyond_shift_bound(i, speed):
            self.trial_from[i], self.speeds[i], self.shifted = self.speeds[i], speed, True
            return
        if not self.recent[i]:
            self._set_level(i, speed)                        # the first measurement
            return
        recent = self.recent[i] = (self.recent[i] + [speed])[-SPIKE_FILTER:]
        # The noise of a single measurement, which is what the shift bound tests (the
        # median's is smaller, so the noise margin built on it errs on the safe side).
        self.measured[i] += 1
        weight = 1 / min(self.measured[i] + PRIOR_WEIGHT, VARIANCE_MEMORY)
        deviation = math.log(speed / self.speeds[i])
        self.variances[i] = (1 - weight) * self.variances[i] + weight * unbias * deviation ** 2
        self.level_count[i] += 1
        if self._young(i):
            self.since_level[i] = self.since_level[i] + [speed]
            self.speeds[i] = hodges_lehmann(self.since_level[i])
        else:
            self.since_level[i] = []
            self.speeds[i] = (1 - self.smoothing) * self.speeds[i] + self.smoothing * statistics.median(recent)

    def _set_level(self, i: int, speed: float) -> None:
        """Rank i's level starts (again) from this one measurement."""
        self.speeds[i], self.recent[i], self.level_count[i], self.since_level[i] = speed, [speed], 1, [speed]

    def _young(self, i: int) -> bool:
        """Whether rank i's estimate is the Hodges-Lehmann estimate of the measurements
        since its level was set: until 1/smoothing of them are in."""
        return self.level_count[i] <= round(1 / self.smoothing)

    def noise(self, rank: int) -> float:
        """v_i as the shift bound and the margins take it: at least the level's noise."""
        return max(self.variances[rank], self.level_variance)

    def _shift_bound(self, rank: int) -> float:
        return max(SHIFT_MIN_LOG, SHIFT_SIGMAS * math.sqrt(self.noise(rank)))

    def _beyond_shift_bound(self, rank: int, speed: float) -> bool:
        return abs(math.log(speed / self.speeds[rank])) > self._shift_bound(rank)

    def _back_before_shift(self, rank: int, speed: float) -> bool:
        """Whether a measurement lands back at the level from before a confirmed shift
        while the estimate begun at the shift is still young: within the shift bound of the
        estimate from before, and nearer it than the new one. The shift was then a stall
        of more than one step (a shared host busy for two steps: three ranks read 25-35%
        slow twice in a GPT benchmark run), or a throttle that has ended, and the
        estimate from before comes back whole. An estimate begun at the stall's speed would
        take several steps to leave it, and a trial back up to the old level is undone
        as a stall when the next measurement falls short of the shift bound (the
        benchmark run held a rank at 20 samples where 23 were right for 10 steps after
        the stall)."""
        if self.pre_shift[rank] is None:
            return False
        before = self.pre_shift[rank][0]
        to_before, to_now = abs(math.log(speed / before)), abs(math.log(speed / self.speeds[rank]))
        return to_before < to_now and to_before <= self._shift_bound(rank)

    def relative_errors(self) -> list[float]:
        """Per rank, the relative standard error of its speed estimate: sqrt(π/3 · v_i / n)
        for the Hodges-Lehmann estimate of n measurements (its large-sample figure;
        sqrt(v_i / n) for n ≤ 2, where it is their mean), sqrt(v_i·α/(2−α)) for the
        moving average; v_i as noise() floors it."""
        average = self.smoothing / (2 - self.smoothing)
        errors = []
        for i, n in enumerate(self.level_count):
            v, n = self.noise(i), max(1, n)
            share = (1 / n if n <= 2 else math.pi / 3 / n) if self._young(i) else average
            errors.append(math.sqrt(v * share))
        return errors

    def _margins(self, current_times: list[float]) -> list[float]:
        """Per rank, the factor its predicted time is taken slower by when it would get
        more samples: 1 + MARGIN_ERRORS standard errors of the difference between its
        estimate and the current slowest rank's. A split goes wrong only by loading a
        rank whose speed is over-estimated, while the time a rank saves by giving samples
        away is as certain as the rank's own per-sample time."""
        errors = self.relative_errors()
        slowest = max(range(len(current_times)), key=current_times.__getitem__)
        held_up = 0.0 if self._newly_shifted(slowest) else errors[slowest]
        return [1 + MARGIN_ERRORS * math.hypot(e, held_up) for e in errors]

    def _newly_shifted(self, rank: int) -> bool:
        """Whether rank's estimate is still the one begun at a confirmed shift. The split
        in use then rests on that same young estimate (the trial's one or two
        measurements): it is no safer a place to stay than the split the estimate now
        points to, so the rank's own uncertainty is no reason to hold a move off it."""
        return self.since_shift[rank] and self._young(rank)

    def _predict(self, sizes: tuple[int, ...], model, margins: list[float]) -> tuple[float, float]:
        """The predicted step time of `sizes`, and the same with each rank that would get
        more samples than now taken slower by its margin."""
        times = predict_rank_times(sizes, model, self.memory_caps, self.policy)
        confident = max(t * m if b > now else t for t, m, b, now in zip(times, margins, sizes, self.sizes))
        return max(times), confident

    def decide(self) -> RebalanceDecision:
        """Solves for the best split under the current estimates; proposes it when its
        predicted gain has beaten the required gain for `patience` consecutive steps
        outside the cool-down, or right after a level shift when it beats the threshold
        (after a shift is confirmed, the required gain).
        Does not adopt it: call adopt with the decision's sizes."""
        model = self.model()
        solve = partial(solve_split, self.global_batch, memory_caps=self.memory_caps, policy=self.policy,
                        min_per_rank=self.min_per_rank)
        best = solve(model)
        current_times = predict_rank_times(self.sizes, model, self.memory_caps, self.policy)
        current = max(current_times)
        gain = current / best.step_time - 1
        # Right after a level shift, and at the first split's review, the estimates are taken as
        # they are; when the best split is the current one there is nothing to gain (no other
        # split is more certain to).
        if self.shifted or self.reviewing or best.sizes == self.sizes:
            required = self.threshold
        else:
            # The gain must hold with the ranks that would get more samples taken slower.
            # The best split under the estimates may load a noisy rank; the best one with
            # every rank taken slower by its margin does so only where that still pays.
            margins = self._margins(current_times)
            cautious = solve([(a * m, c * m) for (a, c), m in zip(model, margins)])
            candidates = [(*self._predict(split.sizes, model, margins), split) for split in (best, cautious)]
            predicted, confident, best = min(candidates, key=lambda candidate: candidate[1])   # the first on a tie
            gain = current / predicted - 1
            required = self.threshold + gain - (current / confident - 1)
        if (self.shifted or self.settled or self.reviewing) and gain > required:
            self.streak = self.patience
        elif self.steps_since_change < self.cooldown or gain <= required:
            self.streak = 0
        else:
            self.streak += 1
        changed = self.streak >= self.patience and best.sizes != self.sizes
        return RebalanceDecision(best.sizes if changed else self.sizes, changed, gain, required)

    def adopt(self, sizes: Sequence[int]) -> bool:
        """Makes `sizes` the current split; returns whether it differs from the last one
        (and if so restarts the cool-down)."""
        sizes = tuple(sizes)
        if len(self.sizes) and len(sizes) != len(self.sizes):
            raise ValueError(f"sizes has {len(sizes)} entries for {len(self.sizes)} ranks")
        counts = all(isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in sizes)
        if not counts or sum(sizes) != self.global_batch:
            raise ValueError(f"sizes = {list(sizes)}: expected non-negative integers adding up to the global batch "
                             f"{self.global_batch}, which stays fixed")
        if sizes == self.sizes:
            return False
        self.sizes, self.steps_since_change, self.streak = sizes, 0, 0
        return True

    def observe(self, compute_times: Sequence[float], done: Sequence[int] | None = None) -> RebalanceDecision:
        """update, decide and adopt in one process."""
        self.update(compute_times, done)
        decision = self.decide()
        self.adopt(decision.sizes)
        return decision

    def state_dict(self) -> dict:
        return {"sizes": list(self.sizes), "speeds": list(self.speeds), "recent": [list(r) for r in self.recent],
                "variances": list(self.variances), "measured": list(self.measured),
                "level_count": list(self.level_count), "since_level": [list(m) for m in self.since_level],
                "level": self.level, "level_steps": self.level_steps, "level_variance": self.level_variance,
                "level_measured": self.level_measured,
                "trial_from": list(self.trial_from), "since_shift": list(self.since_shift),
                "pre_shift": [None if p is None else [*p[:3], list(p[3])] for p in self.pre_shift],
                "shifted": self.shifted, "settled": self.settled, "reviewing": self.reviewing,
                "steps_since_change": self.steps_since_change, "streak": self.streak}

    def load_state_dict(self, state: dict) -> None:
        if len(state["speeds"]) != len(self.sizes) or len(state["recent"]) != len(self.sizes):
            raise ValueError(f"state_dict holds estimates for {len(state['speeds'])} ranks; this rebalancer has "
                             f"{len(self.sizes)}")
        self.adopt(state["sizes"])
        self.speeds = [float(s) for s in state["speeds"]]
        self.recent = [[float(s) for s in r] for r in state["recent"]]
        self.variances = [float(v) for v in state["variances"]]
        # States saved before level shifts were tried: no trial under way, the noise as measured.
        self.measured = [int(n) for n in state.get("measured", [VARIANCE_MEMORY] * len(self.sizes))]
        # States saved before the mean: their estimates are moving averages already.
        long_ago = round(1 / self.smoothing)
        self.level_count = [int(n) for n in state.get("level_count", [long_ago] * len(self.sizes))]
        if "since_level" in state:
            self.since_level = [[float(m) for m in since] for since in state["since_level"]]
        else:   # saved before the Hodges-Lehmann estimate: a young mean stands in for each of its measurements
            self.since_level = [[s] * n if self._young(i) else [] for i, (s, n) in enumerate(zip(self.speeds,
                                                                                                self.level_count))]
        self.trial_from = [None if s is None else float(s) for s in state.get("trial_from", [None] * len(self.sizes))]
        self.since_shift = [bool(b) for b in state.get("since_shift", [False] * len(self.sizes))]
        self.pre_shift = [None if p is None else (float(p[0]), int(p[1]), bool(p[2]),
                                                  [float(m) for m in (p[3] if len(p) > 3 else [p[0]] * p[1])])
                          for p in state.get("pre_shift", [None] * len(self.sizes))]
        # States saved before the cluster's level was taken apart hold it in their speeds.
        self.level, self.level_steps = float(state.get("level", 0.0)), int(state.get("level_steps", long_ago))
        # States saved before the level's noise was a floor: none, as they decided then.
        self.level_variance = float(state.get("level_variance", 0.0))
        self.level_measured = int(state.get("level_measured", self.level_steps))
        self.shifted = bool(state.get("shifted", False))
        self.settled = bool(state.get("settled", False))
        self.reviewing = bool(state.get("reviewing", False))
        self.steps_since_change, self.streak = int(state["steps_since_change"]), int(state["streak"])
