"""BalancedBatches on its own (one process): micro-batches of a share, the epoch's last
smaller step, the state after the steps finished however far a loader drew ahead,
placeholders for a framework that skips what an epoch has run, the steps a loader with
workers draws ahead, and the settings it refuses (the split on several ranks is tested
through the Trainer and Lightning integrations)."""

import subprocess
import sys

import pytest

from hetcomm.integrations import BalancedBatches, loader_steps_ahead


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


@pytest.mark.parametrize("arguments, named", [
    (dict(dataset_size=64, global_batch=8, balance="fast"), "balance = 'fast'"),
    (dict(dataset_size=64, global_batch=100), "larger than the dataset"),
    (dict(dataset_size=64, global_batch=8, accumulation=0), "accumulation = 0"),
    (dict(dataset_size=64, global_batch=8, split=[4, 4]), "split = \\[4, 4\\]"),
    (dict(dataset_size=64, global_batch=8, max_micro_batch=0), "max_micro_batch = 0"),
])
def test_bad_settings_are_refused_by_name(arguments, named):
    with pytest.raises(ValueError, match=named):
        BalancedBatches(**arguments)


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
