"""The in-step handoff plan: exact against a brute-force search of every way to place
the given-up samples, every sample placed once, and no plan where none pays."""

import itertools
import math

import pytest

from hetcomm.balance import handoff
from hetcomm.balance.handoff import (FORWARD_SHARE_LEAST, GIVER_THRESHOLD, MIN_GAIN, ForwardShare, Handoff, Report,
                                    plan, report)


def rank(done, rate, remaining, giver=False, pass_seconds=0.0):
    seconds = done * rate
    return Report(done, seconds, remaining, rate, pass_seconds, giver,
                  seconds + (pass_seconds + remaining * rate if remaining else 0.0))


def givers_of(reports):
    """The ranks that give: reported givers whose share is also over the threshold
    beside the quickest rank's."""
    quickest = min(r.as_dealt for r in reports)
    return [i for i, r in enumerate(reports)
            if r.giver and r.remaining > 0 and r.as_dealt > (1 + GIVER_THRESHOLD) * quickest]


def brute_force(reports):
    """The least makespan over every placement of the givers' remaining samples: each
    giver keeps 0..remaining of its own, each receiver takes any count, all placed."""
    givers = givers_of(reports)
    pool = sum(reports[g].remaining for g in givers)
    best = math.inf
    for counts in itertools.product(range(pool + 1), repeat=len(reports)):
        if sum(counts) != pool or any(counts[g] > reports[g].remaining for g in givers):
            continue
        ends = []
        for i, r in enumerate(reports):
            # A giver's kept samples and a receiver's taken ones: one more pass, if any.
            start = r.seconds if i in givers else r.seconds + (r.pass_seconds + r.remaining * r.rate
                                                               if r.remaining else 0.0)
            ends.append(start + (r.pass_seconds + counts[i] * r.rate if counts[i] else 0.0))
        best = min(best, max(ends))
    return best


def test_no_giver_no_plan():
    assert plan([rank(2, 0.1, 6), rank(1, 0.2, 3)]) is None


@pytest.mark.parametrize("reports", [
    # A card at a quarter of its speed among three at their planned pace.
    [rank(9, 0.02, 26), rank(9, 0.08, 26, giver=True), rank(5, 0.04, 12), rank(2, 0.08, 6)],
    # Two givers, receivers with a pass cost, one receiver already late.
    [rank(3, 0.5, 5, giver=True, pass_seconds=0.3), rank(2, 0.1, 6, pass_seconds=0.05), rank(1, 0.6, 2, giver=True),
     rank(2, 0.1, 7, pass_seconds=0.2)],
    # A rank over its planned step, but not beside the quickest one: it takes samples on.
    [rank(2, 0.5, 8, giver=True), rank(2, 0.1, 6, giver=True), rank(2, 0.08, 6)],
    # A receiver with no samples of its own (rate from the model).
    [rank(4, 1.0, 4, giver=True), Report(0, 0.0, 0, 0.25, 0.1, False, 0.0), rank(2, 0.2, 6)],
])
def test_the_plan_is_the_least_makespan_and_places_every_sample_once(reports):
    found = plan(reports)
    assert found is not None
    assert found.step_seconds == pytest.approx(brute_force(reports), rel=1e-12)
    assert found.without_seconds == max(r.seconds + (r.pass_seconds + r.remaining * r.rate if r.remaining else 0)
                                        for r in reports)
    assert found.step_seconds <= (1 - MIN_GAIN) * found.without_seconds
    remaining = [r.remaining for r in reports]
    givers = givers_of(reports)
    for i, r in enumerate(reports):
        assert 0 <= found.kept[i] <= r.remaining
        if i not in givers:
            assert found.kept[i] == r.remaining
        else:
            assert found.received[i] == 0
    # The givers' tails, position by position, each taken by exactly one receiver.
    taken = [(g, first + k) for receiver in range(len(reports))
             for g, first, count in found.sources(remaining, receiver) for k in range(count)]
    tails = [(g, p) for g in givers for p in range(found.kept[g], reports[g].remaining)]
    assert sorted(taken) == tails
    assert len(taken) == found.moved == sum(found.received)
    for receiver in range(len(reports)):
        assert sum(count for _, _, count in found.sources(remaining, receiver)) == found.received[receiver]


def test_no_plan_when_every_rank_is_slow_or_the_gain_is_small():
    # A common slowdown: every rank a giver, nobody to take anything on.
    assert plan([rank(2, 0.4, 6, giver=True), rank(2, 0.4, 6, giver=True)]) is None
    # The only receiver would finish the moved samples barely sooner (a pass costs it more).
    assert plan([rank(2, 0.1, 8, giver=True), rank(8, 0.1, 1, pass_seconds=0.05)]) is None


def test_a_rank_a_little_over_its_plan_takes_on_a_straggler_s_samples():
    # The reports of a trainer test's throttled step: both ranks over the planned 0.102 s,
    # rank 0 by a hiccup (1.53x), rank 1 throttled (17x). Rank 0 keeps its share and takes
    # on rank 1's; before, both gave and neither took anything.
    hiccup = report(8, 0.0671, 8, 0.4313, 0.01, 0.1, 0.10196)
    throttled = report(8, 0.7939, 8, 0.4469, 0.01, 0.1, 0.10196)
    assert hiccup.giver and throttled.giver
    found = plan([hiccup, throttled])
    assert found.kept == (8, 0) and found.received == (8, 0)
    # The step ends with rank 1's forward, already spent (rank 0 is done by then).
    assert hiccup.as_dealt + 8 * hiccup.rate < throttled.seconds == found.step_seconds


def test_ties_go_to_the_lower_rank():
    found = plan([rank(1, 1.0, 3, giver=True), rank(3, 0.1, 0), rank(3, 0.1, 0)])
    assert found.kept == (0, 0, 0) and found.received == (0, 2, 1)


def test_report_predicts_the_share_from_the_forward_s_part_of_the_compute():
    planned_step = 1.0
    # A share of 8 samples in two micro-batches of 4: the first one's forward took 0.2 s of
    # the share's 1.0 s, so it is 0.2 of the time for half the samples: a part of 0.4.
    share = ForwardShare()
    for _ in range(FORWARD_SHARE_LEAST):
        share.add(4, 0.2, 8, 1.0)
    assert share.value() == pytest.approx(0.4)
    same = report(4, 0.2, 8, share.value(), 0.5, 1.0, planned_step)
    assert not same.giver and (same.done, same.remaining) == (8, 0)
    assert same.as_dealt == pytest.approx(1.0) and same.seconds == same.as_dealt
    assert same.rate == pytest.approx(1.0 / 8) and same.pass_seconds == 0.0
    # Twice as slow: the share predicted twice as long, 2.0 s > 1.5 x the planned 1.0 s: a
    # giver, with none of its samples done and its forward's 0.4 s sunk.
    slow = report(4, 0.4, 8, share.value(), 0.5, 1.0, planned_step)
    assert slow.giver and (slow.done, slow.seconds, slow.remaining) == (0, 0.4, 8)
    assert slow.as_dealt == pytest.approx(2.0) and slow.rate == pytest.approx(0.25)
    # Only over the threshold: 1.4 x the planned step is the rebalancer's, not the handoff's.
    assert not report(4, 0.28, 8, share.value(), 0.5, 1.0, planned_step).giver
    # No part measured yet: the model's prediction, never a giver.
    unknown = report(4, 5.0, 8, None, 0.5, 0.9, planned_step)
    assert not unknown.giver and unknown.as_dealt == 0.9 and unknown.rate == pytest.approx(0.9 / 8)
    nothing = report(0, 0.0, 0, share.value(), 0.3, 0.0, planned_step)   # no samples: the model's rate
    assert nothing.rate == 0.3 and not nothing.giver and nothing.as_dealt == 0.0


def test_a_giver_s_plan_counts_its_dropped_forward_and_moves_its_samples():
    """Rank 1 at a quarter of its speed: its forward of 24 samples says 4x the planned
    share; the plan moves most of them to the ranks still at pace, and the step ends far
    sooner than waiting for the whole slow share."""
    share = 0.35
    reports = [report(24, 0.35 * 0.42, 24, share, 0.0175, 0.42, 0.42),
               report(24, 4 * 0.35 * 0.42, 24, share, 0.0175, 0.42, 0.42),
               report(11, 0.35 * 0.40, 11, share, 0.036, 0.40, 0.42),
               report(5, 0.35 * 0.38, 5, share, 0.076, 0.38, 0.42)]
    assert [r.giver for r in reports] == [False, True, False, False]
    found = plan(reports)
    assert found.without_seconds == pytest.approx(4 * 0.42)
    assert found.moved == 24 - found.kept[1] > 0
    # The giver's step: its sunk forward plus a pass over what it keeps at its slow rate.
    giver = reports[1]
    assert found.step_seconds >= giver.seconds + giver.cost(found.kept[1]) - 1e-12
    assert found.step_seconds == pytest.approx(brute_force(reports), rel=1e-12)
    assert found.step_seconds < 0.6 * found.without_seconds


def test_the_forward_share_is_a_median_of_recent_steps():
    share = ForwardShare()
    for forward in (0.3, 3.0):
        share.add(8, forward, 8, forward + 0.6)
        assert share.value() is None   # too few steps yet
    for forward in (0.3, 0.3, 0.3, 0.3):   # one stall in a forward, out of the last five
        share.add(8, forward, 8, forward + 0.6)
    assert share.value() == pytest.approx(1 / 3)
    share.add(8, 0.9, 8, 0.9)   # a forward that was the whole compute says nothing
    share.add(0, 0.1, 8, 0.9)   # nor one of no samples
    assert len(share.recent) == 5


def test_report_rows_round_trip():
    for mine in (report(3, 0.6, 9, 0.4, 0.1, 1.0, 1.0), report(3, 0.1, 9, 0.4, 0.1, 1.0, 1.0)):
        assert Report.from_row(mine.row()) == mine
        assert len(mine.row()) == len(handoff.REPORT_FIELDS)


@pytest.mark.parametrize("seconds, model_rate, message", [
    (math.nan, 0.1, "seconds = nan"), (-1.0, 0.1, "seconds = -1.0"), (0.5, 0.0, "model_rate = 0.0"),
    (0.5, math.inf, "model_rate = inf"),
])
def test_bad_reports(seconds, model_rate, message):
    with pytest.raises(ValueError, match=message):
        report(2, seconds, 6, 1.0, model_rate, 1.0, 1.0)
    with pytest.raises(ValueError, match="forward_share = 0.0: expected a positive ratio, or None"):
        report(2, 0.5, 6, 0.0, 0.1, 1.0, 1.0)
    with pytest.raises(ValueError, match="first = 7 of own = 6"):
        report(7, 0.5, 6, 0.4, 0.1, 1.0, 1.0)


def test_sources_of_a_receiver_that_takes_from_two_givers():
    found = Handoff(kept=(1, 4, 0), received=(0, 0, 5), step_seconds=1.0, without_seconds=2.0)
    assert found.sources([3, 7, 0], 2) == [(0, 1, 2), (1, 4, 3)]
