"""BalancedBatches on its own (one process): micro-batches of a share, the epoch's last
smaller step, the state after the steps finished however far a loader drew ahead,
placeholders for a framework that skips what an epoch has run, the steps a loader with
workers draws ahead, a state refused by batches of other settings, and the arguments it
and the hook's state refuse (the split on several ranks is tested through the Trainer and
Lightning integrations; the first shares within the caps on two ranks here)."""

import subprocess
import sys

import pytest
from distributed import run_ranks, values

from hetcomm.integrations import BalancedBatches, BalancedHookState, loader_steps_ahead
from hetcomm.integrations.settings import check_settings


def steps_of(batches, count):
    """`count` steps' micro-batches, drawn as a loader draws them."""
    it = iter(batches)
    return [[next(it) for _ in range(batches.accumulation)] for _ in range(count)]


def test_a_share_is_cut_into_as_many_micro_batches_as_even_as_integers_allow():
    batches = BalancedBatches(40, 10, accumulation=3, seed=1)
    steps = steps_of(batches, 4)
    assert [[len(m) for m in step] for step in steps] == [[4, 3, 3]] * 4
    assert len(batches) == 12
    drawn = [i for step in steps for m in step for i in m]
    assert sorted(drawn) == list(range(40))   # the epoch: each sample once


def test_the_epochs_last_smaller_step_gives_every_micro_batch_a_sample():
    batches = BalancedBatches(23, 10, accumulation=3)
    steps = steps_of(batches, 3)
    assert [len(m) for m in steps[-1]] == [1, 1, 1]
    assert sorted(i for step in steps for m in step for i in m) == list(range(23))
    with pytest.raises(ValueError, match="leave 2 for an epoch's last step"):
        BalancedBatches(22, 10, accumulation=3)
    BalancedBatches(22, 10, accumulation=3, drop_last=True)


def test_the_state_is_where_the_finished_steps_left_the_data_however_far_a_loader_drew():
    batches = BalancedBatches(64, 8, steps_ahead=2)
    it = iter(batches)
    for _ in range(4):             # a loader two steps ahead: steps 0-3 drawn, 0-1 finished
        next(it)
    batches.finished = 2
    state = batches.state_dict()
    assert state["steps"] == 2 and state["sampler"]["cursor"] == 16
    again = BalancedBatches(64, 8, steps_ahead=2)
    again.load_state_dict(state)
    assert next(iter(again)) == batches.sampler.permutation()[16:24].tolist()


def test_placeholders_come_first_for_a_loader_that_skips_the_epochs_run_micro_batches():
    batches = BalancedBatches(64, 8, accumulation=2)
    steps_of(batches, 3)
    batches.finished = 3
    state = batches.state_dict()
    resumed = BalancedBatches(64, 8, accumulation=2)
    resumed.load_state_dict(state, skipped_by_loader=True)
    it = iter(resumed)
    assert [next(it) for _ in range(6)] == [[]] * 6
    assert next(it) == batches.sampler.permutation()[24:28].tolist()


def test_steps_ahead_of_a_loader_with_workers():
    assert loader_steps_ahead(0, None, 4) == 0
    assert loader_steps_ahead(2, None, 1) == 4     # prefetch_factor 2 by default
    assert loader_steps_ahead(1, 5, 4) == 2


def test_a_state_goes_on_only_in_batches_of_the_same_settings():
    batches = BalancedBatches(64, 8, seed=1)
    steps_of(batches, 2)
    batches.finished = 2
    state = batches.state_dict()
    BalancedBatches(64, 8, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="other settings: dataset_size 64 there, 72 here, seed 1 there, 0 here, "
                                         "max_micro_batch None there, \\[8\\] here$"):
        BalancedBatches(72, 8, max_micro_batch=8).load_state_dict(state)
    with pytest.raises(ValueError, match="holds no run settings"):
        BalancedBatches(64, 8, seed=1).load_state_dict({k: v for k, v in state.items() if k != "run"})


@pytest.mark.parametrize("arguments, error, named", [
    (dict(dataset_size=64, global_batch=8, balance="fast"), ValueError, "balance = 'fast'"),
    (dict(dataset_size=64, global_batch=8, balance=["dynamic"]), TypeError, "balance = \\['dynamic'\\]"),
    (dict(dataset_size=64, global_batch=100), ValueError, "larger than the dataset"),
    (dict(dataset_size="64", global_batch=8), TypeError, "dataset_size = '64'"),
    (dict(dataset_size=64, global_batch=8.0), TypeError, "global_batch = 8.0"),
    (dict(dataset_size=64, global_batch=8, accumulation=0), ValueError, "accumulation = 0"),
    (dict(dataset_size=64, global_batch=8, accumulation=True), TypeError, "accumulation = True"),
    (dict(dataset_size=64, global_batch=8, split=[4, 4]), ValueError, "split = \\[4, 4\\]"),
    (dict(dataset_size=64, global_batch=8, split=[8.0]), TypeError, "split = \\[8.0\\]"),
    (dict(dataset_size=64, global_batch=8, split="8"), TypeError, "split = '8'"),
    (dict(dataset_size=64, global_batch=8, max_micro_batch=0), ValueError, "max_micro_batch = 0"),
    (dict(dataset_size=64, global_batch=8, max_micro_batch=[1.5]), TypeError, "max_micro_batch = \\[1.5\\]"),
    (dict(dataset_size=64, global_batch=8, max_micro_batch=4), ValueError, "holds at most 4 samples"),
    (dict(dataset_size=64, global_batch=8, seed=0.5), TypeError, "seed = 0.5"),
    (dict(dataset_size=64, global_batch=8, drop_last="yes"), TypeError, "drop_last = 'yes'"),
    (dict(dataset_size=64, global_batch=8, rebalance_threshold=-0.1), ValueError, "rebalance_threshold = -0.1"),
    (dict(dataset_size=64, global_batch=8, rebalance_threshold=float("nan")), ValueError,
     "rebalance_threshold = nan"),
    (dict(dataset_size=64, global_batch=8, rebalance_threshold="2%"), TypeError, "rebalance_threshold = '2%'"),
    (dict(dataset_size=64, global_batch=8, who=None), TypeError, "who = None"),
])
def test_bad_settings_are_refused_by_name(arguments, error, named):
    with pytest.raises(error, match=named):
        BalancedBatches(**arguments)


@pytest.mark.parametrize("arguments, named", [
    (dict(split=[6, 2], max_micro_batch=[4, 4]), "split \\[6, 2\\] of 8 exceed max_micro_batch = \\[4, 4\\]"),
    (dict(balance="equal", max_micro_batch=[2, 6]), "equal shares \\[4, 4\\] of 8 exceed max_micro_batch"),
    (dict(accumulation=2, max_micro_batch=[1, 2]), "max_micro_batch = \\[1, 2\\] x 2 micro-batches holds at most 6"),
])
def test_shares_that_cannot_fit_the_caps_are_refused_on_two_ranks(arguments, named):
    with pytest.raises(ValueError, match=named):
        check_settings(64, 8, 2, **arguments)


def first_split(rank, world):
    return BalancedBatches(64, 8, max_micro_batch=[2, 6]).sampler.sizes


def test_the_first_shares_keep_within_the_caps(tmp_path):
    """Equal shares of 8 would give the card that holds 2 samples 4 before any timing."""
    assert values(run_ranks(2, first_split, tmp_path=tmp_path)) == [(2, 6), (2, 6)]


@pytest.mark.parametrize("arguments, error, named", [
    (dict(batches=[1, 2]), TypeError, "batches = list: expected the BalancedBatches"),
    (dict(per_item="yes"), TypeError, "per_item = 'yes'"),
    (dict(wire_dtype="float16"), TypeError, "wire_dtype = 'float16'"),
    ({}, RuntimeError, "torch.distributed is not initialised"),
])
def test_the_hooks_state_refuses_bad_arguments_by_name(arguments, error, named):
    with pytest.raises(error, match=named):
        BalancedHookState(**{"batches": None, **arguments})


@pytest.mark.parametrize("module, framework, extra", [("transformers", "transformers", "hf"),
                                                      ("transformers", "accelerate", "hf"),
                                                      ("lightning", "lightning", "lightning")])
def test_without_its_framework_hetcomm_imports_and_the_integration_says_what_to_install(module, framework, extra):
    code = (f"import sys; sys.modules[{framework!r}] = None\n"
            "import hetcomm, hetcomm.integrations\n"
            "try:\n"
            f"    import hetcomm.integrations.{module}\n"
            "except ImportError as error:\n"
            "    print(error)\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert f"needs {framework}: pip install 'hetcomm[{extra}]'" in run.stdout, run.stdout
