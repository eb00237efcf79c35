"""The in-step handoff plan: exact against a brute-force search of every way to place
the given-up samples, every sample placed once, and no plan where none pays."""

import itertools
import math

import pytest

from hetcomm.balance import handoff
from hetcomm.balance.handoff import CHECK_SHARE_LEAST, MIN_GAIN, CheckShare, Handoff, Report, check_size, plan, report


def rank(done, rate, remaining, giver=False, pass_seconds=0.0):
    return Report(done, done * rate, remaining, rate, pass_seconds, giver)


def brute_force(reports):
    """The least makespan over every placement of the givers' remaining samples: each
    giver keeps 0..remaining of its own, each receiver takes any count, all placed."""
    givers = [i for i, r in enumerate(reports) if r.giver and r.remaining > 0]
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
    [rank(3, 0.5, 5, giver=True, pass_seconds=0.3), rank(2, 0.1, 6, pass_seconds=0.05), rank(1, 0.3, 2, giver=True),
     rank(2, 0.1, 7, pass_seconds=0.2)],
    # A receiver with no samples of its own (rate from the model).
    [rank(4, 1.0, 4, giver=True), Report(0, 0.0, 0, 0.25, 0.1, False), rank(2, 0.2, 6)],
])
def test_the_plan_is_the_least_makespan_and_places_every_sample_once(reports):
    found = plan(reports)
    assert found is not None
    assert found.step_seconds == pytest.approx(brute_force(reports), rel=1e-12)
    assert found.without_seconds == max(r.seconds + (r.pass_seconds + r.remaining * r.rate if r.remaining else 0)
                                        for r in reports)
    assert found.step_seconds <= (1 - MIN_GAIN) * found.without_seconds
    remaining = [r.remaining for r in reports]
    for i, r in enumerate(reports):
        assert 0 <= found.kept[i] <= r.remaining
        if not r.giver:
            assert found.kept[i] == r.remaining
        else:
            assert found.received[i] == 0
    # The givers' tails, position by position, each taken by exactly one receiver.
    taken = [(g, first + k) for receiver in range(len(reports))
             for g, first, count in found.sources(remaining, receiver) for k in range(count)]
    tails = [(g, p) for g, r in enumerate(reports) if r.giver for p in range(found.kept[g], r.remaining)]
    assert sorted(taken) == tails
    assert len(taken) == found.moved == sum(found.received)
    for receiver in range(len(reports)):
        assert sum(count for _, _, count in found.sources(remaining, receiver)) == found.received[receiver]


def test_no_plan_when_every_rank_is_slow_or_the_gain_is_small():
    # A common slowdown: every rank a giver, nobody to take anything on.
    assert plan([rank(2, 0.4, 6, giver=True), rank(2, 0.4, 6, giver=True)]) is None
    # The only receiver would finish the moved samples barely sooner (a pass costs it more).
    assert plan([rank(2, 0.1, 8, giver=True), rank(8, 0.1, 1, pass_seconds=0.05)]) is None


def test_ties_go_to_the_lower_rank():
    found = plan([rank(1, 1.0, 3, giver=True), rank(3, 0.1, 0), rank(3, 0.1, 0)])
    assert found.kept == (0, 0, 0) and found.received == (0, 2, 1)


def test_report_predicts_the_rest_from_the_check_s_share_of_the_compute():
    planned = 1.0
    # A pass costs 0.1 s plus 0.1 s a sample: a check of 2 of 8 samples takes 0.3 s and
    # the rest 0.7 s, so the check takes 0.3 of the time for 0.25 of the samples.
    share = CheckShare()
    for _ in range(CHECK_SHARE_LEAST):
        share.add(2, 0.3, 8, 1.0)
    assert share.value() == pytest.approx(1.2)
    same = report(2, 0.3, 6, share.value(), 0.5, planned)
    assert same.finish() == pytest.approx(1.0) and not same.giver
    assert (same.rate, same.pass_seconds) == (pytest.approx(0.1), pytest.approx(0.1))
    # Twice as slow: the rest predicted twice as long, 2.0 s > 1.5 x the planned 1.0 s.
    slow = report(2, 0.6, 6, share.value(), 0.5, planned)
    assert slow.finish() == pytest.approx(2.0) and slow.giver
    assert (slow.rate, slow.pass_seconds) == (pytest.approx(0.2), pytest.approx(0.2))
    # A rate from the check alone (0.15 s a sample) would have predicted 1.2 s for the same rank.
    assert not report(2, 0.5, 0, share.value(), 0.5, planned).giver   # nothing left to give
    assert not report(2, 5.0, 6, None, 0.5, planned).giver            # no share measured yet
    nothing = report(0, 0.0, 0, share.value(), 0.3, planned)           # no samples: the model's rate
    assert nothing.rate == 0.3 and not nothing.giver


def test_the_check_share_is_a_median_of_recent_steps():
    share = CheckShare()
    for check_seconds in (0.3, 3.0):
        share.add(2, check_seconds, 8, check_seconds + 0.7)
        assert share.value() is None   # too few steps yet
    for check_seconds in (0.3, 0.3, 0.3, 0.3):   # one stall in the check, out of the last five
        share.add(2, check_seconds, 8, check_seconds + 0.7)
    assert share.value() == pytest.approx(1.2)
    share.add(2, 0.3, 2, 0.3)   # a check that was the whole share says nothing
    assert len(share.recent) == 5


def test_report_rows_round_trip():
    mine = report(3, 0.6, 9, 1.1, 0.1, 1.0)
    assert Report.from_row(mine.row()) == mine
    assert len(mine.row()) == len(handoff.REPORT_FIELDS)


@pytest.mark.parametrize("seconds, model_rate, message", [
    (math.nan, 0.1, "seconds = nan"), (-1.0, 0.1, "seconds = -1.0"), (0.5, 0.0, "model_rate = 0.0"),
    (0.5, math.inf, "model_rate = inf"),
])
def test_bad_reports(seconds, model_rate, message):
    with pytest.raises(ValueError, match=message):
        report(2, seconds, 6, 1.0, model_rate, 1.0)
    with pytest.raises(ValueError, match="check_share = 0.0: expected a positive ratio, or None"):
        report(2, 0.5, 6, 0.0, 0.1, 1.0)


def test_check_size():
    assert [check_size(b) for b in (0, 1, 3, 4, 5, 36)] == [0, 1, 1, 1, 2, 9]
    # Over a memory cap the share runs as micro-batches anyway: the first one is the check.
    assert [check_size(b, cap=8) for b in (0, 5, 8, 9, 36)] == [0, 2, 2, 8, 8]


def test_sources_of_a_receiver_that_takes_from_two_givers():
    found = Handoff(kept=(1, 4, 0), received=(0, 0, 5), step_seconds=1.0, without_seconds=2.0)
    assert found.sources([3, 7, 0], 2) == [(0, 1, 2), (1, 4, 3)]
