"""benchmarks/loss_breakdown.py: the time over the ideal bound, cut into parts that add up."""

import pytest
from conftest import import_benchmark


@pytest.fixture(scope="module")
def breakdown():
    return import_benchmark("loss_breakdown").breakdown


def step(split, compute_s, step_s, speeds=(10.0, 5.0), samples=None):
    return {"micro_batch": list(split), "samples": list(samples or split), "samples_per_second": list(speeds),
            "compute_s": list(compute_s), "step_s": step_s}


def test_parts_of_a_step_by_hand(breakdown):
    # Ranks at 10 and 5 samples/s, 6 samples: bound 0.4 s, met by the whole split 4/2. Run 3/3
    # (0.6 s at those speeds), the slow rank measured 0.66 s, the step 0.7 s.
    parts = breakdown([step((3, 3), (0.3, 0.66), 0.7)] * 4, None)
    assert parts["over"] == pytest.approx(0.75)
    assert parts["whole samples"] == pytest.approx(0.0, abs=1e-12)
    assert parts["split"] == pytest.approx(0.5)
    assert parts["noise"] == pytest.approx(0.15)
    assert parts["overhead"] == pytest.approx(0.1)
    assert parts["first step's overhead"] == pytest.approx(0.04 / 1.6)


def test_whole_samples_and_regimes(breakdown):
    # 7 samples at 10 and 5 samples/s: bound 7/15 s, best whole split 5/2 at 0.5 s. From step 2 on,
    # rank 1 runs at 2.5 samples/s (its own regime): bound 7/12.5 s, best whole split 6/1 at 0.6 s.
    before = [step((5, 2), (0.5, 0.4), 0.52)] * 2
    after = [step((6, 1), (0.6, 0.4), 0.61, speeds=(10.0, 2.5))] * 2
    parts = breakdown(before + after, 2)
    bound = 2 * 7 / 15 + 2 * 7 / 12.5
    assert parts["whole samples"] == pytest.approx((2 * (0.5 - 7 / 15) + 2 * (0.6 - 7 / 12.5)) / bound)
    assert parts["split"] == pytest.approx(0.0, abs=1e-12) and parts["noise"] == pytest.approx(0.0, abs=1e-12)
    assert parts["overhead"] == pytest.approx((2 * 0.02 + 2 * 0.01) / bound)


def test_parts_add_up_after_a_handoff(breakdown):
    # A handoff step: dealt 3/3 (0.6 s at the speeds), done 5/1 (0.5 s): what each rank ran counts.
    log = [step((3, 3), (0.32, 0.61), 0.66), step((3, 3), (0.5, 0.21), 0.55, samples=(5, 1)),
           step((4, 2), (0.41, 0.43), 0.45)]
    parts = breakdown(log, None)
    assert parts["over"] == pytest.approx(sum(parts[p] for p in ("whole samples", "split", "noise", "overhead")))
    assert parts["split"] == pytest.approx((0.6 - 0.4 + 0.5 - 0.4) / 1.2)


def test_the_warm_up_is_the_first_steps_time_over_their_bound(breakdown):
    # Bound 0.4 s a step (6 samples at 10 + 5 samples/s); the first two steps take 1.0 and
    # 0.6 s, the next three 0.45 s: the warm-up is (0.6 + 0.2) / 2.0 of the bound.
    log = [step((4, 2), (0.9, 0.95), 1.0), step((4, 2), (0.5, 0.55), 0.6)] + [step((4, 2), (0.4, 0.4), 0.45)] * 3
    parts = breakdown(log, None)
    assert parts["warm-up"] == pytest.approx(0.8 / 2.0)
    assert parts["over"] == pytest.approx((0.6 + 0.2 + 3 * 0.05) / 2.0)


@pytest.mark.parametrize("name", ["hetero_cluster_cpu", "hetero_bert_b128_cpu"])
def test_a_committed_set_gives_each_repeat_its_runs(name):
    # A result set holds its repeats in one file (a "repeat" on every row): the breakdown, and
    # replay_rebalancer.py through runs_of, take each repeat's runs as they took a file's.
    runs_of = import_benchmark("loss_breakdown").runs_of
    labels = [label for label, _ in runs_of(import_benchmark("result_files").RESULTS_DIR / f"{name}.json")]
    assert sorted(set(labels)) == [f"{name} repeat {k}" for k in (1, 2, 3)]
    assert labels.count(f"{name} repeat 1") == labels.count(f"{name} repeat 3") >= 4
