"""What BalancedBatches times on 2 Gloo ranks: a GPU's work, not the host's launches of it.
At a timed step's start and at its compute's end (the hook's bucket, with the gradients'
device) it waits for the current CUDA stream before it reads the clock (not for the whole
device, whose other streams hold all-reduces that wait for the other ranks); in steps
that decide no split, and on a CPU, it never waits. The CPU twin records the order of
the waits and the clock's reads; the GPU test queues 20 matmuls of 4096x4096 (tens of
milliseconds on any card) that the host launches in microseconds, and finds them in the
step's time."""

import pytest
import torch
from distributed import run_ranks, values

from hetcomm.integrations import BalancedBatches

CASES = {("cuda", "dynamic"): ["clock", "clock"] + ["wait", "clock", "wait", "clock"] * 2,
         ("cuda", "static"): ["clock", "clock", "wait", "clock", "wait", "clock", "clock", "clock"],
         ("cuda", "equal"): ["clock", "clock"] * 3,
         ("cpu", "dynamic"): ["clock", "clock"] * 3}


def waits_and_reads(rank, world):
    """Three steps of each case, with the device's waits and the clock's reads recorded."""
    events = []

    class Stream:
        def synchronize(self):
            events.append("wait")

    torch.cuda.current_stream = lambda device=None: Stream()
    torch.cuda.synchronize = lambda device=None: events.append("the whole device")

    def clock():
        events.append("clock")
        return float(len(events))

    BalancedBatches.clock = staticmethod(clock)
    found = {}
    for (device, balance) in CASES:
        events.clear()
        batches = BalancedBatches(64, 16, balance=balance)
        drawn = iter(batches)
        for _ in range(3):
            next(drawn)
            batches.step_started()
            batches.compute_done(torch.device(device, 0) if device == "cuda" else torch.device("cpu"))
            batches.step_finished()
        found[(device, balance)] = list(events)
    return found


def test_a_timed_step_waits_for_the_gpu_before_each_read_of_the_clock(tmp_path):
    for found in values(run_ranks(2, waits_and_reads, tmp_path=tmp_path)):
        assert found == CASES


def gpu_work_in_a_step(rank, world):
    device = torch.device("cuda", 0)
    batches = BalancedBatches(64, 16)
    drawn = iter(batches)
    a = torch.randn(4096, 4096, device=device)
    measured = []
    for _ in range(2):
        next(drawn)
        batches.step_started()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(20):
            b = a @ a
        end.record()
        batches.compute_done(device)
        seconds = batches.computed - batches.started
        batches.step_finished()
        end.synchronize()
        measured.append((seconds, begin.elapsed_time(end) / 1e3, b.sum().item()))
    return measured


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_steps_time_holds_its_gpu_work_on_a_gpu(tmp_path):
    for measured in values(run_ranks(2, gpu_work_in_a_step, tmp_path=tmp_path)):
        seconds, gpu_seconds, _ = measured[1]   # the second step is timed; the first, not
        assert gpu_seconds > 0.01 and seconds >= 0.95 * gpu_seconds, measured
