"""benchmarks/replay_rebalancer.py: logged step times replayed through a rebalancer."""

import pytest
from conftest import import_benchmark

import hetcomm.balance.rebalancer as tree_rebalancer


@pytest.fixture(scope="module")
def replay_module():
    return import_benchmark("replay_rebalancer")


def logged(split, rates, steps, samples=None):
    """A run's log at a fixed split: each rank at its rate (seconds per sample)."""
    done = list(samples or split)
    return [{"micro_batch": list(split), "samples": done, "compute_s": [n * r for n, r in zip(done, rates)],
             "samples_per_second": [1 / r for r in rates], "step_s": max(n * r for n, r in zip(done, rates))}
            for _ in range(steps)]


def test_split_loss_by_hand(replay_module):
    # 6 samples at 10 and 5 samples/s: the best whole split 4/2 takes 0.4 s, 3/3 takes 0.6 s.
    log = logged((3, 3), (0.1, 0.2), 4)
    assert replay_module.split_loss(log, None, [(3, 3)] * 4) == pytest.approx(0.5)
    assert replay_module.split_loss(log, None, [(3, 3), (4, 2), (4, 2), (4, 2)]) == pytest.approx(0.2 / 1.6)
    # Two regimes, each judged at its own medians: after the slowdown 5/1 is best (0.5 s).
    slow = logged((4, 2), (0.1, 0.5), 2)
    assert replay_module.split_loss(logged((4, 2), (0.1, 0.2), 2) + slow, 2, [(4, 2)] * 4) == \
        pytest.approx((0.8 + 2 * 1.0) / (0.8 + 2 * 0.5) - 1)


def test_a_run_held_at_a_bad_split_is_replayed_onto_the_good_one(replay_module):
    # The run stayed at 3/3 for 30 steps while the ranks ran at 10 and 5 samples/s; the
    # rebalancer, fed those times at its own splits, moves to 4/2 and stays there.
    log = logged((3, 3), (0.1, 0.2), 30)
    splits, changes = replay_module.replay(tree_rebalancer, log)
    assert len(splits) == 30 and splits[:2] == [(3, 3), (3, 3)]
    assert splits[-1] == (4, 2) and changes == 1
    loss = replay_module.split_loss(log, None, splits)
    assert 0 < loss < replay_module.split_loss(log, None, [s["samples"] for s in log]) / 5


def test_a_rank_that_did_no_sample_is_measured_at_its_median(replay_module):
    # A giver that handed its whole share off in one step: the replay neither divides by zero
    # nor reads the step as a change of speed.
    log = logged((3, 3), (0.1, 0.2), 12)
    log[6] = logged((3, 3), (0.1, 0.2), 1, samples=(6, 0))[0]
    splits, _ = replay_module.replay(tree_rebalancer, log)
    assert splits == replay_module.replay(tree_rebalancer, logged((3, 3), (0.1, 0.2), 12))[0]
