"""benchmarks/gpu_max_batch.py: the search for the largest micro-batch, and the training
step whose running out of memory it catches. The measurement itself needs a CUDA GPU;
these parts run on the CPU."""

import os
import signal
import time

import pytest
import torch
from conftest import import_benchmark

from hetcomm.plan.model_shape import ModelShape


@pytest.fixture(scope="module")
def script():
    return import_benchmark("gpu_max_batch")


@pytest.mark.parametrize("limit", [1, 7, 64, 100])
def test_the_search_finds_every_threshold_exactly_and_in_few_tries(script, limit):
    for threshold in range(0, limit + 3):
        tried = []

        def fits(batch):
            tried.append(batch)
            return batch <= threshold

        largest, failed = script.largest_fitting(fits, limit=limit)
        assert largest == min(threshold, limit)
        assert failed == (None if threshold >= limit else threshold + 1)
        assert all(1 <= b <= limit for b in tried)
        assert len(tried) <= 2 * max(1, limit).bit_length() + 1


def test_the_search_reports_no_sequence_fitting_as_zero(script):
    assert script.largest_fitting(lambda batch: False) == (0, 1)


@pytest.fixture(scope="module")
def steps(script):
    pytest.importorskip("transformers")
    case = script.Case("titanx", "bert-base-qa", 16, "fp32", "eager")
    return script.BertSteps(case, torch.device("cpu"), ModelShape("small", 2, 2, 32, 100, "bert", "qa"))


def test_a_step_trains_the_model(steps):
    before = [p.detach().clone() for p in steps.model.parameters()]
    assert steps.fits(2)
    changed = sum(not torch.equal(b, p) for b, p in zip(before, steps.model.parameters()))
    assert changed > len(before) // 2
    assert all(p.grad is None for p in steps.model.parameters())


def test_running_out_of_memory_is_a_no_and_leaves_the_model_usable(script, steps, monkeypatch):
    real_step = steps.step

    def step(batch):
        real_step(min(batch, 1))
        if batch > 3:
            # What the allocator raises, after the forward has made its activations.
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    monkeypatch.setattr(steps, "step", step)
    assert script.largest_fitting(steps.fits, limit=64) == (3, 4)
    assert all(p.grad is None for p in steps.model.parameters())
    monkeypatch.undo()
    assert steps.fits(1)


def test_without_a_gpu_the_script_says_so_and_measures_nothing(script, capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the script would measure")
    assert script.main(["--cards", "titanx"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_a_library_s_failed_allocation_is_a_no_and_other_errors_are_raised(steps, monkeypatch):
    def out_of_memory(batch):
        raise RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`")

    monkeypatch.setattr(steps, "step", out_of_memory)
    assert not steps.fits(1)

    def broken(batch):
        raise RuntimeError("expected all tensors to be on the same device")

    monkeypatch.setattr(steps, "step", broken)
    with pytest.raises(RuntimeError, match="same device"):
        steps.fits(1)


def test_a_step_cut_short_before_the_scaler_s_update_leaves_the_next_one_whole(script, monkeypatch):
    pytest.importorskip("transformers")
    case = script.Case("v100", "bert-base-qa", 16, "fp16", "sdpa")
    steps = script.BertSteps(case, torch.device("cpu"), ModelShape("small", 2, 2, 32, 100, "bert", "qa"))
    steps.step(1)

    def update(*args, **kwargs):   # the optimizer has stepped; the allocator fails before the update
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    monkeypatch.setattr(steps.scaler, "update", update)
    assert not steps.fits(2)
    before = [p.detach().clone() for p in steps.model.parameters()]
    assert steps.fits(2)   # the same scaler would refuse: "step() has already been called"
    assert steps.scaler.get_scale() == 2.0**10   # no overflow skipped the steps: they updated
    assert sum(not torch.equal(b, p) for b, p in zip(before, steps.model.parameters())) > len(before) // 2


def _row(case):
    return {"card": case.card, "model": case.model, "seq": case.seq, "precision": case.precision,
            "attention": case.attention, "measured": 8, "planner": 10, "error": 0.25, "peak_bytes": None,
            "planner_bytes_at_measured": None}


def _cases(script, count):
    return [script.Case("titanx", "bert-base-qa", 128 * (i + 1), "fp32", "eager") for i in range(count)]


def test_every_case_is_measured_in_order_when_nothing_stops_it(script):
    cases = _cases(script, 3)
    rows, stopped = script.measure_all(cases, _row, budget_s=60)
    assert stopped is None
    assert [row["seq"] for row in rows] == [128, 256, 384]


def test_sigterm_keeps_the_cases_measured_before_it(script):
    # What `timeout` sends when gpu_check.sh's budget ends, in the middle of a case.
    def measure_one(case):
        if case.seq == 256:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)   # interrupted: the handler runs as soon as the signal arrives
        return _row(case)

    handler = signal.getsignal(signal.SIGTERM)
    started = time.perf_counter()
    rows, stopped = script.measure_all(_cases(script, 3), measure_one, budget_s=60)
    assert time.perf_counter() - started < 5
    assert [row["seq"] for row in rows] == [128]
    assert stopped == "stopped by SIGTERM after 1 of 3 cases"
    assert signal.getsignal(signal.SIGTERM) is handler
    text = script.report(rows, "a GPU", stopped)
    assert "| titanx | bert-base-qa | 128 | fp32 | eager | 8 | 10 | +25.0% |" in text
    assert "Incomplete: stopped by SIGTERM after 1 of 3 cases" in text


def test_no_case_starts_once_the_budget_is_spent(script):
    def slow(case):
        time.sleep(0.05)
        return _row(case)

    rows, stopped = script.measure_all(_cases(script, 3), slow, budget_s=0.01)
    assert [row["seq"] for row in rows] == [128]
    assert stopped.startswith("out of time after 1 of 3 cases")
