"""The rebalancer's decisions on simulated clusters (pure, no processes), and the
distributed wrapper on Gloo ranks: rank 0 decides, every rank follows."""

import math
import random
import statistics

import pytest

from distributed import run_ranks, values
from hetcomm.balance import DistributedRebalancer, Rebalancer, solve_split
from hetcomm.balance.rebalancer import THRESHOLD, TRAINING_SETTINGS

SPEEDS = [100.0, 100.0, 50.0, 25.0]      # samples per second
GLOBAL_BATCH = 110
BALANCED = (40, 40, 20, 10)              # the best split for SPEEDS


def simulate(rebalancer, speeds_at, steps, noise, seed=0, start=0):
    """Feeds the rebalancer compute times b_i / s_i with log-normal noise of relative
    size `noise` (one for all ranks, or one per rank), for steps start .. start + steps - 1
    (the noise of a step and rank depends on nothing else); returns the decisions."""
    decisions = []
    noises = list(noise) if isinstance(noise, (list, tuple)) else [noise] * len(rebalancer.sizes)
    for step in range(start, start + steps):
        speeds = speeds_at(step)
        times = [b / s * math.exp(random.Random(f"{seed}/{step}/{i}").gauss(0, noises[i]))
                 for i, (b, s) in enumerate(zip(rebalancer.sizes, speeds))]
        decisions.append(rebalancer.observe(times))
    return decisions


def true_step_time(sizes, speeds):
    return max(b / s for b, s in zip(sizes, speeds))


def optimal_step_time(speeds):
    return solve_split(GLOBAL_BATCH, [(0.0, 1.0 / s) for s in speeds]).step_time


def test_noise_alone_seldom_moves_the_split():
    # 10 runs of 400 steps at the best split, 10% noise on every time: the noise margin
    # lets a few changes through (4 here; 120, costing 1.25%, without it), and they cost
    # next to nothing.
    changes, lost = 0, 0.0
    for seed in range(10):
        rebalancer = Rebalancer(GLOBAL_BATCH, BALANCED)
        decisions = simulate(rebalancer, lambda step: SPEEDS, steps=400, noise=0.10, seed=seed)
        changes += sum(d.changed for d in decisions)
        lost += sum(true_step_time(d.sizes, SPEEDS) for d in decisions) / (400 * optimal_step_time(SPEEDS)) - 1
    assert changes <= 10
    assert lost / 10 < 0.005


def test_a_slowdown_of_the_whole_cluster_moves_no_split():
    # Every rank 30% slower from step 40 on (a shared host gets busy): the ranks' speeds
    # relative to one another stay, and so does the split.
    rebalancer = Rebalancer(GLOBAL_BATCH, BALANCED)
    decisions = simulate(rebalancer, lambda step: [s / (1.3 if step >= 40 else 1) for s in SPEEDS], steps=80,
                         noise=0.02)
    assert not any(d.changed for d in decisions)
    assert rebalancer.model()[0][1] == pytest.approx(1.3 / SPEEDS[0], rel=0.05)   # the level followed


def test_a_stalled_step_is_tried_and_undone():
    rebalancer = Rebalancer(GLOBAL_BATCH, BALANCED)
    stall = lambda step: [s / 20 if step == 30 and i == 1 else s for i, s in enumerate(SPEEDS)]  # noqa: E731
    decisions = simulate(rebalancer, stall, steps=80, noise=0.02)
    # Step 30's measurement moves rank 1's estimate on trial and the next split with it;
    # step 31's measurement refutes it and the split goes back at once.
    assert [step for step, d in enumerate(decisions) if d.changed] == [30, 31]
    assert decisions[30].sizes[1] < BALANCED[1] and decisions[31].sizes == BALANCED
    assert rebalancer.sizes == BALANCED
    assert rebalancer.speeds[1] == pytest.approx(SPEEDS[1], rel=0.05)   # the stall never entered the estimate


def test_two_stalled_steps_end_where_they_began():
    rebalancer = Rebalancer(GLOBAL_BATCH, BALANCED)
    stall = lambda step: [s / 20 if step in (30, 31) and i == 1 else s for i, s in enumerate(SPEEDS)]  # noqa: E731
    decisions = simulate(rebalancer, stall, steps=80, noise=0.02)
    # Two slow measurements confirm a shift; the next one, back at the old speed, is a shift back.
    assert [step for step, d in enumerate(decisions) if d.changed] == [30, 32]
    assert rebalancer.sizes == BALANCED
    assert rebalancer.speeds[1] == pytest.approx(SPEEDS[1], rel=0.05)


def test_a_stall_of_two_steps_on_most_ranks_leaves_no_estimate_behind():
    # Ranks 1-3 run 1.4x slower on steps 30 and 31 (a shared host busy for two steps), 3%
    # noise, training settings. The two steps confirm a shift on each; the next measurement,
    # back at the old level, brings the estimates from before back and the split with them.
    # Over the 28 steps after the stall, 10 seeds lose 0.04% on average; begun afresh at the
    # stall's speed (and a trial back up undone as a stall when the next measurement fell
    # short of the shift bound), the means held splits off the best for 6-28 steps in 8
    # seeds and lost 2.7% (a GPT benchmark run held a rank 3 samples off for 10 steps).
    busy = lambda step: [s / 1.4 if step in (30, 31) and i else s for i, s in enumerate(SPEEDS)]  # noqa: E731
    lost = []
    for seed in range(10):
        rebalancer = Rebalancer(GLOBAL_BATCH, BALANCED, **TRAINING_SETTINGS)
        decisions = simulate(rebalancer, busy, steps=60, noise=0.03, seed=seed)
        assert all(d.sizes == BALANCED for d in decisions[33:]), seed
        lost.append(sum(true_step_time(d.sizes, SPEEDS) for d in decisions[32:])
                    / (28 * optimal_step_time(SPEEDS)) - 1)
        assert [s * math.exp(rebalancer.level) for s in rebalancer.speeds] == pytest.approx(SPEEDS, rel=0.05)
        assert rebalancer.pre_shift == [None] * 4
    assert statistics.fmean(lost) < 0.002


def test_the_split_follows_a_confirmed_shift_at_once():
    # Rank 0 throttles to a third; the step it starts in measures it at half its speed (it
    # slowed within that step). The trial's split follows that first measurement; the next
    # one confirms the shift, the estimate starts over from it alone (the trial's is the
    # one that straddled the change), and the split follows at once, not after the
    # cool-down the trial's change started. (Kept in the mean, the trial's half speed
    # left rank 0 at 21 samples where 18 are right.)
    slowed = [SPEEDS[0] / 3] + SPEEDS[1:]
    halfway = [SPEEDS[0] / 2] + SPEEDS[1:]
    rebalancer = Rebalancer(GLOBAL_BATCH, BALANCED)
    decisions = simulate(rebalancer, lambda step: SPEEDS if step < 50 else halfway if step == 50 else slowed,
                         steps=60, noise=0.0)
    assert [step for step, d in enumerate(decisions) if d.changed][:2] == [50, 51]
    assert decisions[51].sizes == solve_split(GLOBAL_BATCH, [(0.0, 1 / s) for s in slowed]).sizes
    assert true_step_time(decisions[51].sizes, slowed) < true_step_time(decisions[50].sizes, slowed)


def test_no_trial_below_the_shift_bound():
    rebalancer = Rebalancer(GLOBAL_BATCH, BALANCED)
    dip = lambda step: [s / 1.2 if step == 30 and i == 1 else s for i, s in enumerate(SPEEDS)]  # noqa: E731
    assert not any(d.changed for d in simulate(rebalancer, dip, steps=80, noise=0.0))


def test_adopts_right_after_a_sustained_slowdown():
    slowed = [SPEEDS[0] / 3] + SPEEDS[1:]
    rebalancer = Rebalancer(GLOBAL_BATCH, BALANCED)
    decisions = simulate(rebalancer, lambda step: SPEEDS if step < 50 else slowed, steps=200, noise=0.05)
    changes = [step for step, d in enumerate(decisions) if d.changed]
    # The first slow measurement (step 50) moves the estimate on trial and the split follows
    # at once, without patience or cool-down; step 51 confirms it.
    # The new mean starts from the confirming measurement alone; it may move the split a
    # sample or two more as it comes in.
    assert changes and changes[0] == 50
    assert len(changes) <= 4
    assert all(d.predicted_gain > d.required_gain >= THRESHOLD for d in decisions if d.changed)
    # The trial's split rests on one measurement with 5% noise; every split from the
    # confirmation on is within 5% of the best split for the new speeds.
    assert true_step_time(decisions[50].sizes, slowed) <= 1.10 * optimal_step_time(slowed)
    assert all(true_step_time(d.sizes, slowed) <= 1.05 * optimal_step_time(slowed) for d in decisions[51:])
    assert true_step_time(BALANCED, slowed) > 1.5 * optimal_step_time(slowed)


def test_a_trial_measured_off_is_not_held_after_the_shift():
    # Rank 1 throttles to a quarter at step 15 of 30 (training settings, 220 samples a
    # step, 3% noise of each rank's own and 3% shared). The step it throttles in is
    # measured 8% fast, as a handoff's prediction from one forward was in a BERT benchmark
    # run. Over the 14 steps after the confirmation, 40 seeds lose on average:
    #   2.7% with the trial's measurement kept in the new mean and the shifted rank's
    #        young estimate widening every receiver's margin (the benchmark's 33 samples
    #        where 31 were right, held 8 steps);
    #   2.0% with the trial's measurement left out only;
    #   1.3% with both (0.65% with a trial measured right, 0.76% before).
    batch = 2 * GLOBAL_BATCH
    throttled = [s / 4 if i == 1 else s for i, s in enumerate(SPEEDS)]
    best = solve_split(batch, [(0.0, 1 / s) for s in throttled]).step_time
    for trial_error, bound in ((1.0, 0.01), (1.08, 0.017)):
        excess = []
        for seed in range(40):
            rng = random.Random(seed)
            rebalancer = Rebalancer(batch, solve_split(batch, [(0.0, 1 / s) for s in SPEEDS]).sizes,
                                    **TRAINING_SETTINGS)
            after = []
            for step in range(30):
                speeds = SPEEDS if step < 15 else throttled
                if step > 15:
                    after.append(true_step_time(rebalancer.sizes, speeds) / best)
                shared = math.exp(rng.gauss(0, 0.03))
                times = [b / s * shared * math.exp(rng.gauss(0, 0.03)) for b, s in zip(rebalancer.sizes, speeds)]
                if step == 15:
                    times[1] /= trial_error
                rebalancer.observe(times)
            excess.append(statistics.fmean(after) - 1)
        assert statistics.fmean(excess) < bound, trial_error


def test_a_first_step_far_off_is_left_out_of_the_estimate():
    # Warm-up the ranks do not share alike: rank 0's first measurement 10% slow, the next
    # three exact. A mean of medians kept it in the estimate, 3.4% slow beside its equal
    # twin (enough to hold a split a sample off); the Hodges-Lehmann estimate leaves it out.
    rebalancer = Rebalancer(GLOBAL_BATCH, BALANCED)
    for step in range(4):
        times = [b / s for b, s in zip(BALANCED, SPEEDS)]
        if step == 0:
            times[0] *= 1.1
        rebalancer.observe(times)
    (_, per_sample_0), (_, per_sample_1), *_ = rebalancer.model()
    assert per_sample_1 / per_sample_0 == pytest.approx(1.0, abs=1e-12)


def test_a_confirming_step_read_fast_does_not_hold_the_split():
    # Rank 1 throttles to a quarter at step 10: the trial reads it 8% fast (a handoff
    # step's time predicted from a forward) and the confirming step 6% fast (the ranks that
    # took its samples over are slow at their new sizes, and the correction for what all
    # ranks share hands that to it), then exact. A new mean kept half of the 6% two steps
    # later and 1.8% four steps later, and held a split a sample too heavy on rank 1 to the
    # end (as in every throttled GPT benchmark run: 49/12 where 50/11 was best, for 10-19
    # steps); the robust estimate sets it aside, and the best split comes once the
    # cool-down ends.
    batch = 4 * GLOBAL_BATCH
    slowed = [SPEEDS[0], SPEEDS[1] / 4, SPEEDS[2], SPEEDS[3]]
    best = solve_split(batch, [(0.0, 1 / s) for s in slowed]).sizes
    rebalancer = Rebalancer(batch, solve_split(batch, [(0.0, 1 / s) for s in SPEEDS]).sizes, **TRAINING_SETTINGS)
    splits = []
    for step in range(30):
        speeds = SPEEDS if step < 10 else slowed
        times = [b / s for b, s in zip(rebalancer.sizes, speeds)]
        if step in (10, 11):
            times[1] /= 1.08 if step == 10 else 1.06
        rebalancer.observe(times)
        splits.append(rebalancer.sizes)
    assert splits[10] != best                     # the trial's split, on the fast reading
    assert splits[14:] == [best] * 16


def test_follows_a_card_that_recovers():
    # The split follows the slowdown at once (and may be corrected by a sample when the
    # shift is confirmed on the next step), holds the best split for it, and comes back.
    slowed = [SPEEDS[0] / 3] + SPEEDS[1:]
    rebalancer = Rebalancer(GLOBAL_BATCH, BALANCED)
    speeds_at = lambda step: slowed if 20 <= step < 40 else SPEEDS  # noqa: E731
    decisions = simulate(rebalancer, speeds_at, steps=60, noise=0.02)
    changes = [step for step, d in enumerate(decisions) if d.changed]
    assert changes[0] == 20 and 40 in changes and set(changes) <= {20, 21, 40, 41}
    assert true_step_time(decisions[39].sizes, slowed) == pytest.approx(optimal_step_time(slowed))
    assert rebalancer.sizes == BALANCED


@pytest.mark.parametrize("threshold, taken", [(0.01, False), (0.003, True)])
def test_a_gain_is_taken_only_above_the_threshold(threshold, taken):
    # Rank 0 3% slower: a sample from it to rank 1 makes the step 0.6% shorter (40/97 -> 41/100).
    slightly_slower = [SPEEDS[0] * 0.97] + SPEEDS[1:]
    rebalancer = Rebalancer(GLOBAL_BATCH, BALANCED, threshold=threshold)
    decisions = simulate(rebalancer, lambda step: slightly_slower, steps=100, noise=0.0)
    gain = (40 / 97) / (41 / 100) - 1
    assert decisions[0].predicted_gain == pytest.approx(gain)
    assert [d.sizes for d in decisions if d.changed] == ([(39, 41, 20, 10)] if taken else [])


def test_cooldown_and_patience():
    rebalancer = Rebalancer(GLOBAL_BATCH, (30, 30, 30, 20), patience=2, cooldown=5)
    decisions = simulate(rebalancer, lambda step: SPEEDS, steps=10, noise=0.0)
    # Observations 0-3 fall in the cool-down after construction; 4 starts the streak, 5 completes it.
    assert [d.changed for d in decisions] == [False] * 5 + [True] + [False] * 4
    assert rebalancer.sizes == BALANCED
    # Any change restarts the cool-down.
    rebalancer.adopt((30, 30, 30, 20))
    decisions = simulate(rebalancer, lambda step: SPEEDS, steps=10, noise=0.0)
    assert [d.changed for d in decisions] == [False] * 5 + [True] + [False] * 4


def test_ranks_without_samples_keep_their_estimate():
    rebalancer = Rebalancer(10, (10, 0), min_per_rank=0)
    rebalancer.observe([0.1, 0.0])
    assert rebalancer.speeds == [100.0, 1.0]


@pytest.mark.parametrize("stop", [21, 24])
def test_state_dict_resumes_the_same_decisions(stop):
    slowed = lambda step: SPEEDS if step < 20 else [SPEEDS[0] / 3] + SPEEDS[1:]  # noqa: E731
    straight = Rebalancer(GLOBAL_BATCH, BALANCED)
    expected = simulate(straight, slowed, steps=60, noise=0.05, seed=4)

    first = Rebalancer(GLOBAL_BATCH, BALANCED)
    # Stopped on the slowdown's first step (its trial is settled after the resume), or
    # with the shift confirmed and its new mean still young.
    head = simulate(first, slowed, steps=stop, noise=0.05, seed=4)
    assert first.trial_from[0] is not None if stop == 21 else first.since_shift[0]
    resumed = Rebalancer(GLOBAL_BATCH, BALANCED)
    resumed.load_state_dict(first.state_dict())
    tail = simulate(resumed, slowed, steps=60 - stop, noise=0.05, seed=4, start=stop)
    assert [step for step, d in enumerate(expected) if d.changed][0] == 20
    assert head + tail == expected
    assert resumed.state_dict() == straight.state_dict()


def test_a_state_saved_before_the_robust_estimate_loads():
    # Checkpoints from before it hold no since_level, and a pre_shift of three fields: a
    # young mean stands in for each of the measurements it averaged (an estimate past its
    # first 1/smoothing measurements needs none).
    slowed = lambda step: SPEEDS if step < 20 else [SPEEDS[0] / 3] + SPEEDS[1:]  # noqa: E731
    saved = Rebalancer(GLOBAL_BATCH, BALANCED)
    simulate(saved, slowed, steps=24, noise=0.05, seed=4)
    state = saved.state_dict()
    del state["since_level"]
    state["pre_shift"] = [None if p is None else p[:3] for p in state["pre_shift"]]
    loaded = Rebalancer(GLOBAL_BATCH, BALANCED)
    loaded.load_state_dict(state)
    assert saved.level_count[0] <= 20 < min(saved.level_count[1:])   # rank 0 young since its shift, the rest not
    assert loaded.since_level == [[saved.speeds[0]] * saved.level_count[0], [], [], []]
    before, count = state["pre_shift"][0][:2]
    assert loaded.pre_shift[0][3] == [before] * count
    simulate(loaded, slowed, steps=10, noise=0.05, seed=4, start=24)
    assert true_step_time(loaded.sizes, slowed(30)) <= 1.02 * optimal_step_time(slowed(30))


def test_speeds_are_measured_on_the_samples_each_rank_did():
    """A handoff moves samples off the split: the times are of the samples done."""
    rebalancer = Rebalancer(GLOBAL_BATCH, BALANCED)
    done = (60, 20, 20, 10)
    rebalancer.update([b / s for b, s in zip(done, SPEEDS)], done)
    assert rebalancer.speeds == pytest.approx(SPEEDS)
    with pytest.raises(ValueError, match=r"done = \[60, 60, 20, 10\]: expected 4 non-negative integers adding up "
                                         r"to at most the global batch 110"):
        rebalancer.update([0.4] * 4, (60, 60, 20, 10))


@pytest.mark.parametrize("times, message", [
    ([0.4, 0.4, 0.4], r"compute_times has 3 entries for 4 ranks"),
    ([0.4, 0.4, float("nan"), 0.4], r"compute_times\[2\] = nan: expected a positive, finite number of seconds"),
    ([0.4, -1.0, 0.4, 0.4], r"compute_times\[1\] = -1.0"),
])
def test_bad_times(times, message):
    rebalancer = Rebalancer(GLOBAL_BATCH, BALANCED)
    simulate(rebalancer, lambda step: SPEEDS, steps=5, noise=0.05)
    before = rebalancer.state_dict()
    with pytest.raises(ValueError, match=message):
        rebalancer.update(times)
    assert rebalancer.state_dict() == before   # no rank's good time folded in before the bad one was found


@pytest.mark.parametrize("args, kwargs, message", [
    ((GLOBAL_BATCH, (40, 40, 20, 9)), {}, r"sizes = \[40, 40, 20, 9\]: expected non-negative integers adding up to "
                                          r"the global batch 110"),
    ((GLOBAL_BATCH, BALANCED), {"threshold": -0.1}, r"threshold = -0.1"),
    ((GLOBAL_BATCH, BALANCED), {"smoothing": 0}, r"smoothing = 0"),
    ((GLOBAL_BATCH, BALANCED), {"patience": 0}, r"patience = 0"),
    ((GLOBAL_BATCH, BALANCED), {"profiles": [(0.0, 1.0)]}, r"profiles has 1 entries for 4 ranks"),
    ((GLOBAL_BATCH, BALANCED), {"memory_caps": [50, 50, 5, 10], "policy": "move"},
     r"sizes\[2\] = 20 exceeds memory_caps\[2\] = 5"),
    ((3, (1, 1, 1, 0)), {}, r"global_batch = 3 is smaller than 4 ranks"),
])
def test_bad_configuration(args, kwargs, message):
    with pytest.raises(ValueError, match=message):
        Rebalancer(*args, **kwargs)


def follow_rank_zero(rank, world_size):
    """Each rank reports a compute time from its own clock; rank 2 slows down 4x at
    step 3. Rank 1's own rebalancer would never change anything (threshold 100): it
    must follow rank 0 regardless. Threshold 0 elsewhere: without noise the split
    must end exactly at the optimum."""
    speeds = [100.0, 50.0, 50.0]
    rebalancer = Rebalancer(60, (30, 15, 15), threshold=100.0 if rank == 1 else 0.0, patience=2, cooldown=2)
    balancer = DistributedRebalancer(rebalancer)
    history = []
    for step in range(40):
        speed = speeds[rank] / (4 if rank == 2 and step >= 3 else 1)
        decision = balancer.step(rebalancer.sizes[rank] / speed)
        history.append((decision.sizes, decision.changed))
    return history


def test_distributed_ranks_agree_on_rank_zeros_split(tmp_path):
    histories = values(run_ranks(3, follow_rank_zero, tmp_path=tmp_path))
    assert histories[0] == histories[1] == histories[2]
    splits = [sizes for sizes, _ in histories[0]]
    assert splits[0] == (30, 15, 15)
    assert splits[-1] == solve_split(60, [(0.0, 0.01), (0.0, 0.02), (0.0, 0.08)]).sizes
    assert sum(changed for _, changed in histories[0]) >= 1


def test_converges_early_from_a_rough_first_split():
    # A first split from one quick timing, 5% slower than the best one, then steps at 4%
    # noise: the mean of the first measurements lets the margin shrink within a few steps,
    # so the first 40 steps lose 2.1% on average (the moving average with weight 0.2, behind
    # a margin held up by the 10% noise prior for three measurements, never left the first
    # split: 4.75%).
    rough = [SPEEDS[0] * 1.05, SPEEDS[1], SPEEDS[2], SPEEDS[3] * 0.95]
    start = solve_split(GLOBAL_BATCH, [(0.0, 1.0 / s) for s in rough]).sizes
    assert true_step_time(start, SPEEDS) > 1.04 * optimal_step_time(SPEEDS)
    excess = []
    for seed in range(10):
        rebalancer = Rebalancer(GLOBAL_BATCH, start, patience=2, cooldown=3)
        decisions = [rebalancer.sizes] + [d.sizes for d in simulate(rebalancer, lambda step: SPEEDS, 39, 0.04, seed)]
        excess.append(statistics.fmean(true_step_time(s, SPEEDS) for s in decisions) / optimal_step_time(SPEEDS) - 1)
    assert statistics.fmean(excess) < 0.03


def test_a_noisy_rank_whose_share_stays_does_not_hold_a_move_back():
    # Rank 0 has one sample too many for rank 1 (2.4% of the step). Rank 3, held at 5
    # samples by its memory cap, is noisy: its share cannot grow, so its noise is no
    # reason to wait. Only a rank that would get more samples needs a margin, and the
    # move is made once the 10% noise prior has given way to the quiet ranks' 1%. (A
    # margin from the noisiest rank's error, 1.5 x 10% x sqrt(0.05/1.95) = 2.4% on top of
    # the threshold, never made it.)
    caps = [None, None, None, 5]
    best = (42, 42, 21, 5)
    assert solve_split(GLOBAL_BATCH, [(0.0, 1.0 / s) for s in SPEEDS], caps, "move").sizes == best
    start = (43, 41, 21, 5)
    for seed in range(5):
        rebalancer = Rebalancer(GLOBAL_BATCH, start, memory_caps=caps, policy="move", patience=2, cooldown=3)
        decisions = simulate(rebalancer, lambda step: SPEEDS, 80, [0.01, 0.01, 0.01, 0.10], seed)
        assert [d.sizes for d in decisions if d.changed] == [best]
        assert next(step for step, d in enumerate(decisions) if d.changed) < 30


def test_noise_every_rank_shares_does_not_hold_a_rough_first_split():
    # Two equal ranks split 39/32 by a noisy first timing (as one benchmark run's first
    # step did), then 40 steps with 3% noise of each rank's own and 3% that all share, the
    # first three 10% slower for all (warm-up). What all ranks share moves no split; counted
    # as each rank's own noise it widened the margins that hold a move back: those 40 seeds
    # lost 1.40% of the step time on average, against 1.10% measured against the other ranks.
    speeds = [51.0, 51.0, 25.0, 12.0]
    best = solve_split(96, [(0.0, 1.0 / s) for s in speeds]).step_time
    excess = []
    for seed in range(40):
        rng = random.Random(seed)
        rebalancer = Rebalancer(96, (39, 32, 17, 8), patience=2, cooldown=3)
        total = true_step_time(rebalancer.sizes, speeds)
        for step in range(1, 40):
            shared = math.exp(rng.gauss(0, 0.03)) * (1.1 if step <= 3 else 1.0)
            times = [b / s * shared * math.exp(rng.gauss(0, 0.03)) for b, s in zip(rebalancer.sizes, speeds)]
            rebalancer.observe(times)
            total += true_step_time(rebalancer.sizes, speeds)
        excess.append(total / 40 / best - 1)
    assert statistics.fmean(excess) < 0.0125



@pytest.mark.parametrize("resume_at", [None, 2])
def test_a_first_split_from_a_timing_is_reviewed_once_at_the_threshold(resume_at):
    # Two equal ranks dealt 36/38 by a first timing the rebalancer never saw (2.7% of the
    # step): on exact times the margin, held up by the 10% noise prior, keeps that split;
    # with review_first it is reviewed at the threshold alone at the third measurement,
    # and only then (also across a resume just before it).
    equal = lambda step: [50.0, 50.0]  # noqa: E731
    held = Rebalancer(74, (36, 38), **TRAINING_SETTINGS)
    assert not any(d.changed for d in simulate(held, equal, steps=6, noise=0.0))
    reviewed = Rebalancer(74, (36, 38), review_first=True, **TRAINING_SETTINGS)
    decisions = simulate(reviewed, equal, steps=resume_at or 6, noise=0.0)
    if resume_at:
        resumed = Rebalancer(74, (36, 38), review_first=True, **TRAINING_SETTINGS)
        resumed.load_state_dict(reviewed.state_dict())
        decisions += simulate(resumed, equal, steps=6 - resume_at, noise=0.0, start=resume_at)
    assert [d.changed for d in decisions] == [False, False, True, False, False, False]
    assert decisions[2].sizes == (37, 37) and decisions[2].required_gain == THRESHOLD
    assert [d.required_gain > THRESHOLD for d in decisions[:2]] == [True, True]


@pytest.mark.parametrize("noise", [0.02, 0.04, 0.10])
def test_the_review_of_a_first_split_from_a_noisy_timing_pays(noise):
    # The benchmark's cluster, its first split dealt by one timing with the noise of a
    # step (as the loop's first step deals it), then 40 steps: over 40 seeds the review
    # loses less of the step time than holding that split behind the margin. Measured:
    # 0.02 / 0.40 / 2.01% with the review, 0.13 / 0.52 / 2.46% without, at 2 / 4 / 10% noise.
    speeds = [51.0, 51.0, 25.0, 12.0]
    best = solve_split(96, [(0.0, 1.0 / s) for s in speeds]).step_time

    def mean_excess(review_first):
        excess = []
        for seed in range(40):
            rng = random.Random(f"timing/{seed}")
            timed = [s * math.exp(rng.gauss(0, noise)) for s in speeds]
            first = solve_split(96, [(0.0, 1.0 / s) for s in timed]).sizes
            rebalancer = Rebalancer(96, first, review_first=review_first, **TRAINING_SETTINGS)
            decisions = simulate(rebalancer, lambda step: speeds, steps=40, noise=noise, seed=seed)
            splits = [first] + [d.sizes for d in decisions[:-1]]
            excess.append(statistics.fmean(true_step_time(sizes, speeds) for sizes in splits) / best - 1)
        return statistics.fmean(excess)

    assert mean_excess(True) < 0.85 * mean_excess(False)


def test_ranks_that_speed_up_as_another_throttles_are_weighed_by_their_new_speed():
    # Rank 1 throttles to a quarter at step 20, and the others run 8% faster from then on
    # (on a shared host it leaves them its cores). The others' estimates hold 20 steps at
    # their old speed, the throttled rank's new mean none: taken as they are, every other
    # rank looked ~4% slower beside it, and the split stayed that far off.
    batch = 4 * GLOBAL_BATCH

    def speeds_at(step):
        return SPEEDS if step < 20 else [s * (0.25 if i == 1 else 1.08) for i, s in enumerate(SPEEDS)]

    rebalancer = Rebalancer(batch, solve_split(batch, [(0.0, 1 / s) for s in SPEEDS]).sizes, patience=2, cooldown=3)
    simulate(rebalancer, speeds_at, steps=40, noise=0.01)
    best = solve_split(batch, [(0.0, 1 / s) for s in speeds_at(30)]).step_time
    assert true_step_time(rebalancer.sizes, speeds_at(30)) <= 1.015 * best


# Two equal CPU ranks on the shared 2-core host (benchmarks/results/equal_ranks_cpu.json, at
# the equal split): per step a log-normal factor both ranks share, of sigma 0.25 (the recorded
# RMS was 0.09-0.36), and each rank's own, of sigma 0.07 (a robust sigma of 0.04-0.09), one
# step in ten of sigma 0.35 instead (the recorded own part reached 0.49-0.64 in 39 steps).
HOST_SHARED, HOST_OWN, HOST_OUTLIER_SHARE, HOST_OUTLIER = 0.25, 0.07, 0.1, 0.35
HOST_OWN_RMS = math.sqrt((1 - HOST_OUTLIER_SHARE) * HOST_OWN ** 2 + HOST_OUTLIER_SHARE * HOST_OUTLIER ** 2)


def shared_host_times(rng, sizes, speeds):
    shared = math.exp(rng.gauss(0, HOST_SHARED))
    return [b / s * shared * math.exp(rng.gauss(0, HOST_OUTLIER if rng.random() < HOST_OUTLIER_SHARE else HOST_OWN))
            for b, s in zip(sizes, speeds)]


@pytest.mark.parametrize("review_first", [False, True])
def test_equal_ranks_on_a_shared_host_stay_near_equal(review_first):
    # 40 runs of 40 steps from 16/16. The split may only be as far off as the noise leaves the
    # ranks' relative speed unknown: its mean excess over the best step time stays within the
    # standard error of their relative speed from a run's measurements (own RMS x sqrt(2/40),
    # 2.9%). Each rank's noise taken as its own alone, the shift bound of five of its sigmas
    # was crossed every few steps and the split moved at once each time, and back: 3.5% and
    # 5.9 changes a run (3.8% and 6.2 with the review), against 0.7% and 0.6 (2.6%, 1.3).
    excess, changes = [], 0
    for seed in range(40):
        rng = random.Random(seed)
        rebalancer = Rebalancer(32, (16, 16), review_first=review_first, **TRAINING_SETTINGS)
        for _ in range(40):
            changes += rebalancer.observe(shared_host_times(rng, rebalancer.sizes, (1.0, 1.0))).changed
            excess.append(max(rebalancer.sizes) / 16 - 1)
    assert statistics.fmean(excess) < HOST_OWN_RMS * math.sqrt(2 / 40)
    assert changes / 40 < 2


@pytest.mark.parametrize("review_first", [False, True])
def test_a_rank_twice_as_slow_on_a_shared_host_is_rebalanced_within_a_few_steps(review_first):
    # The same noise, rank 1 at half the speed from the start at 16/16: the level's noise as a
    # floor widens the margins, yet every run is within 10% of the best step time by step
    # 12 (3.4-4.3 steps on average; 3.1-3.7 with each rank's own noise alone).
    best = solve_split(32, [(0.0, 1.0), (0.0, 2.0)]).step_time
    reached = []
    for seed in range(40):
        rng = random.Random(seed)
        rebalancer = Rebalancer(32, (16, 16), review_first=review_first, **TRAINING_SETTINGS)
        for step in range(1, 13):
            rebalancer.observe(shared_host_times(rng, rebalancer.sizes, (1.0, 0.5)))
            if true_step_time(rebalancer.sizes, (1.0, 0.5)) <= 1.1 * best:
                break
        reached.append(step)
        assert true_step_time(rebalancer.sizes, (1.0, 0.5)) <= 1.1 * best, seed
    assert statistics.fmean(reached) < 5


def test_no_trial_on_a_second_measurement():
    # Two equal ranks; rank 1's second measurement twice as slow (past any shift bound), the
    # rest exact. Tested against a first measurement, as noisy as itself, it moved the split on
    # trial and back (the 16/16 -> 6/26 -> 27/5 -> 11/21 of #47); from the second on, it is
    # folded in and, the best split still 16/16, nothing moves.
    rebalancer = Rebalancer(32, (16, 16), **TRAINING_SETTINGS)
    decisions = [rebalancer.observe([1.0, 2.0 if step == 1 else 1.0]) for step in range(8)]
    assert not any(d.changed for d in decisions)
    assert rebalancer.trial_from == [None, None]
