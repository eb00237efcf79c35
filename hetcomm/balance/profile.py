"""Per-rank step-time model t(b) = a + c·b: timing a step at a few micro-batch sizes
after warm-up, and the least-squares fit.

A step's compute time is close to linear in its micro-batch: a fixed part a (kernel
launches, per-step Python work, weight reads that do not grow with b) and a part c·b
that does. The solver only needs these two numbers per rank."""

import math
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

import torch


class StepTimeProfile(NamedTuple):
    """t(b) = fixed + per_sample · b seconds for one micro-step of b samples. A plain
    (fixed, per_sample) pair is accepted wherever a profile is."""

    fixed: float        # a, seconds
    per_sample: float   # c, seconds per sample

    def time(self, batch: int) -> float:
        return self.fixed + self.per_sample * batch

    @property
    def throughput(self) -> float:
        """Samples per second in the limit of large micro-batches, 1 / c."""
        return 1.0 / self.per_sample


def least_squares_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """(intercept, slope) of the ordinary least-squares line through (xs, ys); xs must
    hold at least two distinct values."""
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mean_x) ** 2 for x in xs)
    sxy = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys))
    slope = sxy / sxx
    return mean_y - slope * mean_x, slope


def fit_step_time(samples: Iterable[tuple[int, float]]) -> StepTimeProfile:
    """Fits t(b) = a + c·b to (micro-batch size, seconds) samples.

    Robust to noise: the samples at each size are reduced to their median (one stalled
    repetition does not move it), then the medians are fitted by least squares, each
    size counting once. The fit is constrained to a ≥ 0: a negative intercept is noise
    (no step takes negative time), and the constrained optimum then lies on a = 0, where
    c = Σ b·t / Σ b².

    Raises ValueError if a sample is malformed, fewer than two distinct sizes were
    timed, or the fitted c is not positive (time does not grow with the batch, so the
    sizes were too close together or the timings too noisy to tell).
    """
    by_size: dict[int, list[float]] = {}
    for k, sample in enumerate(samples):
        try:
            size, seconds = sample
        except (TypeError, ValueError):
            raise ValueError(f"samples[{k}] = {sample!r}: expected a (micro-batch size, seconds) pair") from None
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"samples[{k}] = {sample!r}: the micro-batch size must be a positive integer")
        if not (isinstance(seconds, (int, float)) and math.isfinite(seconds) and seconds >= 0):
            raise ValueError(f"samples[{k}] = {sample!r}: the time must be a finite, non-negative number of seconds")
        by_size.setdefault(size, []).append(float(seconds))
    if len(by_size) < 2:
        raise ValueError(f"samples: timings at {len(by_size)} distinct micro-batch size(s) {sorted(by_size)}; "
                         f"a line a + c·b needs at least 2")
    sizes = sorted(by_size)
    medians = [statistics.median(by_size[b]) for b in sizes]
    fixed, per_sample = least_squares_line(sizes, medians)
    if fixed < 0:
        fixed, per_sample = 0.0, sum(b * t for b, t in zip(sizes, medians)) / sum(b * b for b in sizes)
    if not per_sample > 0:
        table = ", ".join(f"{b}: {t:.3g} s" for b, t in zip(sizes, medians))
        raise ValueError(f"samples: the fitted time per sample is {per_sample:.3g} s, not positive (median per "
                         f"size: {table}); time the step at sizes further apart or with more repeats")
    return StepTimeProfile(fixed, per_sample)


class TimedSteps:
    """What a training step's compute is timed by, one place for BalancedLoop and the
    integrations' BalancedBatches (which derive from it): `clock`, the host's performance
    counter by default, read after wait_for_compute on a GPU. A test may put a clock of
    its own here, or on one of those classes (tests/work_clock.py: one that advances with
    the samples a rank's passes take at the rank's cost per sample), so that the split it
    checks does not depend on how busy a shared machine is."""

    clock: Callable[[], float] = staticmethod(time.perf_counter)


def wait_for_compute(device: torch.device | None) -> None:
    """Waits until `device` has run the work queued so far on its current stream, so
    that the host's clock read next holds the compute (kernels run behind the host);
    nothing on a CPU. The current stream, not the whole device: a process group's
    collectives run on streams of their own and wait for the other ranks, whose time is
    not this rank's compute."""
    if device is not None and device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def measure_step_times(step: Callable[[int], object], sizes: Sequence[int], *, warmup: int = 2, repeats: int = 5,
                       device: torch.device | str | None = None,
                       clock: Callable[[], float] = time.perf_counter) -> list[tuple[int, float]]:
    """Times step(b) at each size: `warmup` untimed calls per size first (the first
    calls at a size pay for allocation, cuDNN/Triton autotuning, compilation), then
    `repeats` timed rounds. Each round visits every size once, so a drift during
    profiling (a card warming up and throttling) affects all sizes alike instead of
    tilting the slope. On a CUDA device the clock reads are bracketed by
    synchronisations, so the time covers the step's kernels, not just their launch.

    Returns [(size, seconds), ...], repeats × len(sizes) of them, for fit_step_time."""
    distinct = sorted(set(sizes))
    if any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in distinct) or len(distinct) < 2:
        raise ValueError(f"sizes = {list(sizes)!r}: expected at least 2 distinct positive integer micro-batch sizes")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup = {warmup!r}: expected a non-negative integer")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats = {repeats!r}: expected a positive integer")
    device = torch.device(device) if device is not None else None

    for size in distinct:
        for _ in range(warmup):
            step(size)
    samples = []
    for _ in range(repeats):
        for size in distinct:
            wait_for_compute(device)
            start = clock()
            step(size)
            wait_for_compute(device)
            samples.append((size, clock() - start))
    return samples


def profile_step(step: Callable[[int], object], sizes: Sequence[int], *, warmup: int = 2, repeats: int = 5,
                 device: torch.device | str | None = None) -> StepTimeProfile:
    """measure_step_times then fit_step_time. Choose sizes around the micro-batch the
    rank is expected to get: a GPU far from saturation at b = 1 is not linear there."""
    return fit_step_time(measure_step_times(step, sizes, warmup=warmup, repeats=repeats, device=device))
