"""The weighted sampler: every index exactly once per epoch across ranks, through
split changes and a save/restore mid-epoch; the final partial global batch; bad input."""

import pytest
import torch

from hetcomm.balance import WeightedDistributedSampler, proportional_shares


def samplers(dataset_size, sizes, **kwargs):
    return [WeightedDistributedSampler(dataset_size, sizes, rank, **kwargs) for rank in range(len(sizes))]


def draw(ranks, steps=None, splits=None):
    """Draws steps in lockstep on every rank (all of the epoch when steps is None),
    applying splits[k] before step k where given; returns per step the ranks' indices."""
    iterators = [iter(s) for s in ranks]
    drawn = []
    while steps is None or len(drawn) < steps:
        if splits and len(drawn) in splits:
            for s in ranks:
                s.set_split(splits[len(drawn)])
        step = [next(it, None) for it in iterators]
        if step[0] is None:
            assert all(s is None for s in step), "ranks ran different numbers of steps"
            break
        drawn.append(step)
    return drawn


def assert_exactly_once(drawn, dataset_size):
    every = sorted(i for step in drawn for indices in step for i in indices)
    assert every == list(range(dataset_size))


def test_one_epoch_covers_every_index_once_across_split_changes():
    ranks = samplers(103, (5, 3, 2), seed=1)
    drawn = draw(ranks, splits={3: (1, 1, 8), 4: (10, 0, 0), 7: (3, 4, 3)})
    assert len(drawn) == ranks[0].steps_per_epoch == len(ranks[0]) == 11
    assert_exactly_once(drawn, 103)
    assert [len(i) for i in drawn[0]] == [5, 3, 2]
    assert [len(i) for i in drawn[3]] == [1, 1, 8]
    assert [len(i) for i in drawn[4]] == [10, 0, 0]
    # The last step holds the 3 left over, split in proportion to (3, 4, 3).
    assert [len(i) for i in drawn[-1]] == [1, 1, 1]


def test_steps_deal_the_permutation_in_rank_order():
    ranks = samplers(20, (3, 1), seed=5)
    drawn = draw(ranks)
    permutation = torch.randperm(20, generator=torch.Generator().manual_seed(5)).tolist()
    assert [i for step in drawn for indices in step for i in indices] == permutation


def test_resume_mid_epoch_continues_exactly():
    splits = {2: (2, 6, 2), 6: (4, 4, 2)}
    straight = draw(samplers(97, (4, 3, 3), seed=3), splits=splits)

    ranks = samplers(97, (4, 3, 3), seed=3)
    head = draw(ranks, steps=4, splits=splits)
    states = [s.state_dict() for s in ranks]
    resumed = samplers(97, (4, 3, 3), seed=3)
    for sampler, state in zip(resumed, states):
        sampler.load_state_dict(state)
        sampler.set_epoch(0)   # the usual loop calls this again after loading; it must not rewind
    tail = draw(resumed, splits={k - 4: v for k, v in splits.items() if k >= 4})
    assert head + tail == straight
    assert_exactly_once(head + tail, 97)


def test_epochs_reshuffle_and_the_sampler_moves_on_by_itself():
    ranks = samplers(30, (4, 2))
    first, second = draw(ranks), draw(ranks)
    assert_exactly_once(first, 30)
    assert_exactly_once(second, 30)
    assert first != second and all(s.epoch == 2 for s in ranks)
    for s in ranks:
        s.set_epoch(0)
    assert draw(ranks) == first


def test_drop_last_skips_the_partial_batch():
    ranks = samplers(23, (3, 2), drop_last=True)
    drawn = draw(ranks)
    assert len(drawn) == len(ranks[0]) == 4
    indices = [i for step in drawn for share in step for i in share]
    assert len(indices) == len(set(indices)) == 20


def test_proportional_shares():
    assert proportional_shares((5, 3, 2), 3) == (1, 1, 1)       # quotas 1.5, 0.9, 0.6
    assert proportional_shares((5, 3, 2), 5) == (3, 1, 1)       # 2.5, 1.5, 1: the tie goes to rank 0
    assert proportional_shares((1, 1, 1), 2) == (1, 1, 0)       # ties: lower ranks first
    assert proportional_shares((0, 7, 3), 5) == (0, 4, 1)       # 3.5 and 1.5: the tie goes to rank 1
    for total in range(12):
        assert sum(proportional_shares((6, 1, 4), total)) == total


@pytest.mark.parametrize("args, kwargs, message", [
    ((0, (2, 2), 0), {}, r"dataset_size = 0"),
    ((10, (2, -1), 0), {}, r"sizes = \[2, -1\]"),
    ((10, (0, 0), 0), {}, r"adding up to at least 1"),
    ((10, (2, 2), 2), {}, r"rank = 2: expected an integer in \[0, 2\)"),
    ((3, (2, 2), 0), {"drop_last": True}, r"dataset_size = 3 is smaller than the global batch 4"),
])
def test_bad_arguments(args, kwargs, message):
    with pytest.raises(ValueError, match=message):
        WeightedDistributedSampler(*args, **kwargs)


def test_the_global_batch_stays_fixed():
    sampler = WeightedDistributedSampler(10, (2, 2), 0)
    with pytest.raises(ValueError, match=r"sizes = \[3, 2\]: expected 2 entries adding up to the global batch 4"):
        sampler.set_split((3, 2))


@pytest.mark.parametrize("change, message", [
    ({"dataset_size": 11}, r"state_dict: saved with dataset_size = 11, this sampler has 10"),
    ({"seed": 1}, r"saved with seed = 1"),
    ({"cursor": 99}, r"cursor = 99 are not a position in an epoch of 10 samples"),
    ({"sizes": [3, 3]}, r"adding up to the global batch 4"),
])
def test_a_mismatched_state_is_refused(change, message):
    sampler = WeightedDistributedSampler(10, (2, 2), 0)
    with pytest.raises(ValueError, match=message):
        sampler.load_state_dict({**sampler.state_dict(), **change})


def test_a_step_dealt_in_parts():
    """An equal first part and the rest by another split: the step holds the same
    samples as when dealt whole, each rank's parts in rank order, and the steps after
    it are the ones a whole-dealt run draws."""
    whole = draw(samplers(50, (4, 4, 2)), steps=3)
    ranks = samplers(50, (4, 4, 2))
    first = [s.take((2, 2, 2)) for s in ranks]
    assert [s.partial for s in ranks] == [6] * 3
    rest = [s.take((3, 1, 0)) for s in ranks]
    permutation = torch.randperm(50, generator=torch.Generator().manual_seed(0)).tolist()
    assert first == [permutation[0:2], permutation[2:4], permutation[4:6]]
    assert rest == [permutation[6:9], permutation[9:10], []]
    assert sorted(i for part in first + rest for i in part) == sorted(i for idx in whole[0] for i in idx)
    assert [s.partial for s in ranks] == [0] * 3 and [s.cursor for s in ranks] == [10] * 3
    assert draw(ranks, steps=2) == whole[1:]


def test_every_rank_can_name_every_rank_s_samples_of_the_last_step():
    """What a straggler hands off is named by position in its share: every rank must
    see the same shares, also on an epoch's smaller last step."""
    ranks = samplers(25, (4, 4, 2))
    with pytest.raises(RuntimeError, match="no step has been drawn"):
        ranks[0].drawn_indices(0)
    for _ in range(3):
        mine = [next(iter(s)) for s in ranks]
        for s in ranks:
            assert [s.drawn_indices(r) for r in range(3)] == mine
        assert len({s.drawn_shares for s in ranks}) == 1
    assert ranks[0].drawn_shares == (2, 2, 1)   # 25 = 2 x 10 + 5, split like 4 : 4 : 2
    with pytest.raises(ValueError, match=r"rank = 3: expected an integer in \[0, 3\)"):
        ranks[0].drawn_indices(3)


def test_parts_must_make_up_a_full_step():
    ranks = samplers(50, (4, 4, 2))
    ranks[0].take((2, 2, 2))
    with pytest.raises(ValueError, match=r"6 of this step's 10 samples are dealt already, 4 are left"):
        ranks[0].take((3, 2, 0))
    with pytest.raises(RuntimeError, match=r"a step dealt in parts is incomplete \(6 of 10 samples\)"):
        next(iter(ranks[0]))
    with pytest.raises(RuntimeError, match=r"state_dict: a step dealt in parts is incomplete"):
        ranks[0].state_dict()
    with pytest.raises(ValueError, match=r"expected one count per rank \(3\)"):
        ranks[1].take((5, 5))
    last = samplers(15, (4, 4, 2))[0]
    next(iter(last))
    with pytest.raises(ValueError, match=r"the epoch's last, smaller one"):
        last.take((1, 1, 1))
