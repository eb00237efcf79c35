"""Step-time profiling (the fit, the timing loop) and the memory probe's
out-of-memory-to-cap logic, with fake steps, clocks and allocators (no GPU needed)."""

import pytest
import torch

from hetcomm.balance import (MemoryProbe, StepTimeProfile, fit_step_time, measure_step_times, probe_memory,
                             probe_memory_with, wait_for_compute)


def test_fit_recovers_an_exact_line():
    samples = [(b, 0.02 + 0.003 * b) for b in (1, 2, 4, 8, 16) for _ in range(3)]
    profile = fit_step_time(samples)
    assert profile.fixed == pytest.approx(0.02, rel=1e-9)
    assert profile.per_sample == pytest.approx(0.003, rel=1e-9)
    assert profile.time(10) == pytest.approx(0.05, rel=1e-9)
    assert profile.throughput == pytest.approx(1 / 0.003, rel=1e-9)


def test_fit_ignores_a_stalled_repetition():
    samples = [(b, 0.02 + 0.003 * b) for b in (1, 2, 4, 8) for _ in range(5)]
    samples[7] = (samples[7][0], 5.0)    # one repetition hit a stall, 100x its true time
    profile = fit_step_time(samples)
    assert profile == pytest.approx((0.02, 0.003), rel=1e-9)


def test_fit_is_least_squares_over_the_medians():
    # Medians 1.0, 2.5, 2.5, 4.0 at sizes 1..4: least squares gives c = 0.9, a = 0.25.
    samples = [(1, 1.0), (2, 2.5), (3, 2.5), (4, 4.0), (4, 4.0), (4, 9.0)]
    assert fit_step_time(samples) == pytest.approx((0.25, 0.9), rel=1e-12)


def test_fit_with_a_negative_intercept_constrains_it_to_zero():
    samples = [(2, 0.9), (4, 2.1), (8, 4.4)]   # the free fit's intercept is about -0.21
    sizes, times = [2, 4, 8], [0.9, 2.1, 4.4]
    through_origin = sum(b * t for b, t in zip(sizes, times)) / sum(b * b for b in sizes)
    assert fit_step_time(samples) == (0.0, pytest.approx(through_origin, rel=1e-12))


@pytest.mark.parametrize("samples, message", [
    ([(4, 0.1), (4, 0.2)], r"timings at 1 distinct micro-batch size\(s\) \[4\]; a line a \+ c·b needs at least 2"),
    ([], r"timings at 0 distinct"),
    ([(1, 0.3), (8, 0.3)], r"the fitted time per sample is 0 s, not positive \(median per size: 1: 0.3 s, 8: 0.3 s\)"),
    ([(1, 0.5), (8, 0.1)], r"the fitted time per sample is -0.0571"),
    ([(1, 0.1), (0, 0.2)], r"samples\[1\] = \(0, 0.2\): the micro-batch size must be a positive integer"),
    ([(1, 0.1), (2, float("nan"))], r"samples\[1\] = \(2, nan\): the time must be a finite"),
    ([(1, 0.1), (2, -0.1)], r"samples\[1\] = \(2, -0.1\)"),
    ([(1, 0.1), 7], r"samples\[1\] = 7: expected a \(micro-batch size, seconds\) pair"),
])
def test_fit_refuses_bad_samples(samples, message):
    with pytest.raises(ValueError, match=message):
        fit_step_time(samples)


class FakeClock:
    """A clock that advances only when the fake step runs."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_measure_times_after_warm_up_round_robin():
    clock, calls = FakeClock(), []

    def step(b):
        first_at_size = b not in calls
        calls.append(b)
        clock.now += 0.01 + 0.002 * b + (1.0 if first_at_size else 0.0)   # the first call compiles

    samples = measure_step_times(step, [8, 2, 4, 2], warmup=1, repeats=3, clock=clock)
    assert calls == [2, 4, 8] + [2, 4, 8] * 3
    assert [b for b, _ in samples] == [2, 4, 8] * 3
    assert [t for _, t in samples] == pytest.approx([0.01 + 0.002 * b for b, _ in samples], rel=1e-9)
    assert fit_step_time(samples) == pytest.approx((0.01, 0.002), rel=1e-6)


def test_a_timed_cuda_step_waits_for_its_stream_not_the_whole_device(monkeypatch):
    """A rank's collectives run on streams of their own and wait for the other ranks: a
    wait for the whole device would count their time as this rank's compute."""
    waits = []

    class Stream:
        def __init__(self, device):
            self.device = device

        def synchronize(self):
            waits.append(("stream", self.device))

    monkeypatch.setattr(torch.cuda, "current_stream", Stream)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: waits.append(("device", device)))
    cuda = torch.device("cuda", 1)
    for device in (cuda, torch.device("cpu"), None):
        wait_for_compute(device)
    clock, calls = FakeClock(), []
    measure_step_times(lambda b: calls.append(b), [1, 2], warmup=0, repeats=1, clock=clock, device=cuda)
    assert waits == [("stream", cuda)] * 5 and calls == [1, 2]


@pytest.mark.parametrize("kwargs, message", [
    ({"sizes": [4]}, r"sizes = \[4\]: expected at least 2 distinct"),
    ({"sizes": [0, 4]}, r"sizes = \[0, 4\]"),
    ({"sizes": [1, 2], "warmup": -1}, r"warmup = -1"),
    ({"sizes": [1, 2], "repeats": 0}, r"repeats = 0"),
])
def test_measure_refuses_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        measure_step_times(lambda b: None, **kwargs)


class FakeAllocator:
    """Stands in for the CUDA allocator: a step of b samples peaks at base + per_sample·b
    bytes, and raises torch.cuda.OutOfMemoryError above `limit` samples."""

    def __init__(self, limit, base=1000, per_sample=300):
        self.limit, self.base, self.per_sample = limit, base, per_sample
        self.tried, self.recovered, self._peak = [], 0, 0

    def step(self, b):
        self.tried.append(b)
        if b > self.limit:
            raise torch.cuda.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {b * self.per_sample} bytes")
        self._peak = self.base + self.per_sample * b

    def start(self):
        self._peak = 0

    def stop(self):
        return self._peak

    def recover(self):
        self.recovered += 1


@pytest.mark.parametrize("limit", [1, 2, 37, 63, 64, 99])
def test_out_of_memory_becomes_the_cap(limit):
    fake = FakeAllocator(limit)
    probe = probe_memory_with(fake.step, 100, fake)
    assert probe.cap == limit
    assert probe.bytes_per_sample == pytest.approx(300) if limit > 1 else probe.bytes_per_sample == 1300
    assert all(fake.base + fake.per_sample * b == peak for b, peak in probe.peaks)
    assert fake.recovered == sum(b > limit for b in fake.tried) > 0
    assert len(fake.tried) <= 2 * 7 + 1   # doubling to 128, then bisection: logarithmic


def test_no_sample_fits():
    fake = FakeAllocator(0)
    assert probe_memory_with(fake.step, 100, fake) == MemoryProbe(cap=0, bytes_per_sample=None, peaks=())


def test_holding_the_whole_batch_means_no_cap():
    fake = FakeAllocator(10_000)
    probe = probe_memory_with(fake.step, 100, fake)
    assert probe.cap is None and fake.tried == [1, 2, 4, 8, 16, 32, 64, 100]
    assert probe.bytes_per_sample == pytest.approx(300)


def test_other_errors_are_not_swallowed():
    def step(b):
        raise RuntimeError("shape mismatch")
    with pytest.raises(RuntimeError, match="shape mismatch"):
        probe_memory_with(step, 8, FakeAllocator(8))


def test_cpu_has_no_cap():
    called = []
    assert probe_memory(called.append, "cpu", 64) == MemoryProbe(cap=None, bytes_per_sample=None, peaks=())
    assert called == []


def test_probe_refuses_a_bad_max_size():
    with pytest.raises(ValueError, match=r"max_size = 0: expected a positive integer"):
        probe_memory_with(lambda b: None, 0, FakeAllocator(8))


def test_profile_is_a_plain_pair():
    assert StepTimeProfile(0.5, 0.25) == (0.5, 0.25)
