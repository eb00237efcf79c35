"""solve_split against brute force over every split of small problems, the equal-split
speed-up identity, memory caps under both policies, 10,000 ranks, and bad input."""

import itertools
import math
import random

import pytest

from hetcomm.balance import StepTimeProfile, optimal_rank_times, predict_rank_times, solve_split, solver


def reference_time(size, profile, cap, policy, global_batch):
    """t_i(b) written out from the model's definition."""
    fixed, per_sample = profile
    if size == 0:
        return 0.0
    micro = global_batch if policy == "move" or cap is None else cap
    return math.ceil(size / micro) * fixed + per_sample * size


def allowed(size, cap, policy, least):
    if size < least:
        return False
    if cap is None:
        return True
    return size <= cap if policy == "move" else cap > 0 or size == 0


def brute_force(global_batch, profiles, caps, policy, min_per_rank):
    """The smallest slowest-rank time over every split, or None if no split is allowed."""
    best = None
    for head in itertools.product(range(global_batch + 1), repeat=len(profiles) - 1):
        sizes = head + (global_batch - sum(head),)
        if sizes[-1] < 0 or not all(allowed(b, m, policy, least)
                                    for b, m, least in zip(sizes, caps, minimums(min_per_rank, len(caps)))):
            continue
        slowest = max(reference_time(b, p, m, policy, global_batch) for b, p, m in zip(sizes, profiles, caps))
        best = slowest if best is None else min(best, slowest)
    return best


def minimums(min_per_rank, ranks):
    return list(min_per_rank) if isinstance(min_per_rank, list) else [min_per_rank] * ranks


def random_problem(rng):
    ranks = rng.randint(1, 4)
    global_batch = rng.randint(1, 9 if ranks < 4 else 7)
    # Small integers produce exact ties; random floats the general case.
    value = (lambda hi: float(rng.randint(0, hi))) if rng.random() < 0.4 else (lambda hi: rng.uniform(0, hi))
    profiles = [(value(3), value(4) or 0.5) for _ in range(ranks)]
    caps = [rng.choice([None, None, 0, 1, 2, 3, 5]) for _ in range(ranks)]
    # One minimum for all ranks, or one each (samples some ranks have done already).
    least = rng.choice([0, 1, [rng.randint(0, 3) for _ in range(ranks)]])
    return global_batch, profiles, caps, rng.choice(["accumulate", "move"]), least


@pytest.mark.parametrize("enumeration_limit", [solver.ENUMERATION_LIMIT_PER_RANK, 0])
@pytest.mark.parametrize("seed", range(4))
def test_matches_brute_force(seed, enumeration_limit, monkeypatch):
    # Limit 0 makes the bracket search run to adjacent floats instead of enumerating early.
    monkeypatch.setattr(solver, "ENUMERATION_LIMIT_PER_RANK", enumeration_limit)
    rng = random.Random(seed)
    for _ in range(60):
        global_batch, profiles, caps, policy, min_per_rank = random_problem(rng)
        expected = brute_force(global_batch, profiles, caps, policy, min_per_rank)
        if expected is None:
            with pytest.raises(ValueError):
                solve_split(global_batch, profiles, caps, policy, min_per_rank=min_per_rank)
            with pytest.raises(ValueError):
                optimal_rank_times(global_batch, profiles, caps, policy, min_per_rank=min_per_rank)
            continue
        split = solve_split(global_batch, profiles, caps, policy, min_per_rank=min_per_rank)
        case = (global_batch, profiles, caps, policy, min_per_rank, split.sizes)
        assert split.step_time == expected, case
        assert sum(split.sizes) == global_batch, case
        assert all(allowed(b, m, policy, least)
                   for b, m, least in zip(split.sizes, caps, minimums(min_per_rank, len(caps)))), case
        times = [reference_time(b, p, m, policy, global_batch) for b, p, m in zip(split.sizes, profiles, caps)]
        assert list(split.rank_times) == times and max(times) == split.step_time, case
        assert optimal_rank_times(global_batch, profiles, caps, policy, min_per_rank=min_per_rank) \
            == split.rank_times, case
        assert_balanced(split.sizes, profiles, caps, policy, min_per_rank, global_batch)


def assert_balanced(sizes, profiles, caps, policy, min_per_rank, global_batch):
    """The tie rule's promise: no rank is left with room for one more sample that it
    would finish before the slowest rank that is not pinned at its minimum."""
    least = minimums(min_per_rank, len(caps))
    level = max((reference_time(b, p, m, policy, global_batch)
                 for b, p, m, low in zip(sizes, profiles, caps, least) if b > low), default=0.0)
    for i, (b, p, m, low) in enumerate(zip(sizes, profiles, caps, least)):
        if allowed(b + 1, m, policy, low) and b + 1 <= global_batch:
            assert reference_time(b + 1, p, m, policy, global_batch) >= level, (i, sizes)


def test_per_rank_minimums_keep_what_ranks_have_done():
    profiles = [(0.0, 1.0), (0.0, 4.0)]
    assert solve_split(10, profiles).sizes == (8, 2)
    assert solve_split(10, profiles, min_per_rank=[0, 4]).sizes == (6, 4)
    assert solve_split(10, profiles, min_per_rank=[10, 0]).sizes == (10, 0)
    # Under "accumulate" a minimum over a rank's cap is run as micro-steps.
    split = solve_split(10, [(0.0, 1.0)] * 2, memory_caps=[2, None], min_per_rank=[5, 0])
    assert split.sizes == (5, 5) and split.micro_batches[0] == (2, 2, 1)


def test_ties_go_to_lower_ranks_and_repeat_exactly():
    assert solve_split(10, [(0.0, 1.0)] * 3).sizes == (4, 3, 3)
    assert solve_split(11, [(0.0, 1.0)] * 3).sizes == (4, 4, 3)
    profiles = [(0.01 * (i % 3), 0.002 + 0.001 * (i % 5)) for i in range(50)]
    first = solve_split(1000, profiles, [None, 7] * 25)
    assert solve_split(1000, [StepTimeProfile(*p) for p in profiles], [None, 7] * 25) == first


@pytest.mark.parametrize("speeds", [[1, 2, 4, 4], [1, 1, 1, 1], [3, 5, 7, 11, 2], [1, 10]])
def test_speedup_over_equal_is_mean_over_slowest_throughput(speeds):
    # B chosen so that both the equal split and the proportional split are integral.
    global_batch = len(speeds) * sum(speeds) * 2
    split = solve_split(global_batch, [(0.0, 1.0 / s) for s in speeds])
    assert split.sizes == tuple(global_batch * s // sum(speeds) for s in speeds)
    assert split.speedup_over_equal == pytest.approx((sum(speeds) / len(speeds)) / min(speeds), rel=1e-12)
    assert split.throughput == pytest.approx(sum(speeds), rel=1e-12)


def test_move_keeps_caps_and_sends_the_excess_to_ranks_with_room():
    # The fast rank would take 12 of 16, but holds 5: the excess moves to the others.
    split = solve_split(16, [(0.0, 0.25), (0.0, 1.0), (0.0, 1.0)], [5, None, None], "move")
    assert split.sizes == (5, 6, 5)
    assert split.micro_batches == ((5,), (6,), (5,))
    assert split.step_time == 6.0


def test_accumulate_runs_over_cap_as_micro_steps():
    profiles = [(0.5, 0.25), (0.0, 1.0)]
    split = solve_split(16, profiles, [5, None], "accumulate")
    # 12 on rank 0 as 3 micro-steps: 3 × 0.5 + 12 × 0.25 = 4.5 s; (13, 3) would take 4.75 s, (11, 5) 5 s.
    assert split.sizes == (12, 4)
    assert split.micro_batches == ((4, 4, 4), (4,))
    assert split.rank_times == (4.5, 4.0)
    for size, plan, cap in zip(split.sizes, split.micro_batches, [5, 16]):
        assert sum(plan) == size and max(plan) <= cap and len(plan) == math.ceil(size / cap)


def test_equal_split_baseline_accumulates_where_a_share_exceeds_a_cap():
    split = solve_split(8, [(1.0, 1.0), (1.0, 1.0)], [2, None], "move")
    assert split.sizes == (2, 6)
    assert split.equal_step_time == 2 * 1.0 + 4 * 1.0   # 4 samples on rank 0 as 2 micro-steps of 2


def test_a_rank_too_slow_to_help_gets_nothing_only_when_allowed():
    profiles = [(0.0, 1.0), (0.0, 1000.0)]
    assert solve_split(10, profiles, min_per_rank=0).sizes == (10, 0)
    assert solve_split(10, profiles).sizes == (9, 1)
    assert solve_split(2, [(0.0, 1.0)] * 3, min_per_rank=0).sizes == (1, 1, 0)
    assert solve_split(2, [(0.0, 1.0)] * 3, min_per_rank=0).micro_batches == ((1,), (1,), ())


def largest_strictly_before(deadline, profile, cap, policy, global_batch):
    """Most samples a rank finishes strictly before `deadline`, by bisection over b."""
    low, high = 0, global_batch if policy == "accumulate" or cap is None else min(cap, global_batch)
    if policy == "accumulate" and cap == 0:
        high = 0
    while low < high:
        middle = (low + high + 1) // 2
        if reference_time(middle, profile, cap, policy, global_batch) < deadline:
            low = middle
        else:
            high = middle - 1
    return low


@pytest.mark.parametrize("policy", ["accumulate", "move"])
def test_ten_thousand_ranks(policy):
    rng = random.Random(7)
    ranks, global_batch = 10_000, 400_000
    profiles = [(rng.uniform(0, 0.05), rng.uniform(0.001, 0.01)) for _ in range(ranks)]
    caps = [rng.choice([None, 30, 60, 120]) for _ in range(ranks)]
    split = solve_split(global_batch, profiles, caps, policy)
    assert len(split.sizes) == ranks and sum(split.sizes) == global_batch
    assert min(split.sizes) >= 1
    if policy == "move":
        assert all(cap is None or b <= cap for b, cap in zip(split.sizes, caps))
    # Optimality certificate: at any deadline below the reported one, the ranks hold fewer than B samples.
    assert sum(largest_strictly_before(split.step_time, p, m, policy, global_batch)
               for p, m in zip(profiles, caps)) < global_batch
    assert split.step_time == max(reference_time(b, p, m, policy, global_batch)
                                  for b, p, m in zip(split.sizes, profiles, caps))


def test_predict_rank_times_uses_the_same_model():
    profiles, caps = [(0.5, 0.25), (0.0, 1.0)], [5, None]
    assert predict_rank_times([11, 4], profiles, caps) == (3 * 0.5 + 11 * 0.25, 4.0)
    with pytest.raises(ValueError, match=r"sizes\[0\] = 11 exceeds memory_caps\[0\] = 5"):
        predict_rank_times([11, 4], profiles, caps, "move")


@pytest.mark.parametrize("args, kwargs, message", [
    ((3, [(0.0, 1.0)] * 4), {}, r"global_batch = 3 is smaller than 4 ranks × min_per_rank = 1"),
    ((0, [(0.0, 1.0)]), {}, r"global_batch = 0: expected a positive integer"),
    ((2.5, [(0.0, 1.0)]), {}, r"global_batch = 2.5"),
    ((4, []), {}, r"profiles is empty"),
    ((4, [(0.0, 1.0), (-1.0, 1.0)]), {}, r"profiles\[1\] = \(fixed=-1.0, per_sample=1.0\)"),
    ((4, [(0.0, float("nan"))]), {}, r"profiles\[0\] = \(fixed=0.0, per_sample=nan\)"),
    ((4, [(0.0, 0.0)]), {}, r"per_sample finite and > 0"),
    ((4, [(0.0, 1.0, 2.0)]), {}, r"profiles: expected a sequence of \(fixed, per_sample\) pairs"),
    ((4, [(0.0, 1.0)]), {"policy": "drop"}, r"policy = 'drop'"),
    ((4, [(0.0, 1.0)]), {"min_per_rank": -1}, r"min_per_rank = -1"),
    ((4, [(0.0, 1.0)] * 2), {"memory_caps": [3]}, r"memory_caps has 1 entries for 2 ranks"),
    ((4, [(0.0, 1.0)] * 2), {"memory_caps": [3, -2]}, r"memory_caps\[1\] = -2"),
    ((4, [(0.0, 1.0)] * 2), {"memory_caps": [3, 0]}, r"memory_caps\[1\] = 0 is below min_per_rank = 1"),
    ((6, [(0.0, 1.0)] * 2), {"min_per_rank": [4, 3]}, r"global_batch = 6 is smaller than the sum of min_per_rank, 7"),
    ((6, [(0.0, 1.0)] * 2), {"min_per_rank": [4]}, r"min_per_rank has 1 entries for 2 ranks"),
    ((6, [(0.0, 1.0)] * 2), {"min_per_rank": [4, -1]}, r"min_per_rank = \[4, -1\]: expected a non-negative"),
    ((6, [(0.0, 1.0)] * 2), {"min_per_rank": [2, 3], "memory_caps": [None, 2], "policy": "move"},
     r"memory_caps\[1\] = 2 is below min_per_rank\[1\] = 3"),
    ((10, [(0.0, 1.0)] * 2), {"memory_caps": [3, 4], "policy": "move"},
     r"memory_caps add up to 7 samples, fewer than global_batch = 10"),
    ((10, [(0.0, 1.0)] * 2), {"memory_caps": [0, 0], "min_per_rank": 0}, r"memory_caps are all 0"),
])
def test_bad_input_names_the_argument(args, kwargs, message):
    with pytest.raises(ValueError, match=message):
        solve_split(*args, **kwargs)
    with pytest.raises(ValueError, match=message):
        optimal_rank_times(*args, **kwargs)
