"""Peak memory per sample and the largest micro-batch a device can hold, found by
running the real step: an out-of-memory error during probing becomes the cap, never
a crash."""

import gc
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from hetcomm.balance.profile import least_squares_line


@dataclass(frozen=True)
class MemoryProbe:
    """What probing found on one device."""

    cap: int | None                     # largest micro-batch that ran; None: no limit found (or not measured)
    bytes_per_sample: float | None      # growth of the step's peak allocation per sample; None on CPU
    peaks: tuple[tuple[int, int], ...]  # (micro-batch, peak bytes above what was allocated before the step)


class PeakMeter(Protocol):
    """Measures the allocator peak of one call; what probe_memory_with needs of a device."""

    def start(self) -> None: ...

    def stop(self) -> int: ...

    def recover(self) -> None: ...


class CudaPeakMeter:
    """The CUDA caching allocator's peak during one call, above what was allocated
    when the call began (parameters, optimizer state: what does not scale with b)."""

    def __init__(self, device: torch.device):
        self.device = device
        self._base = 0

    def start(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self._base = torch.cuda.memory_allocated(self.device)

    def stop(self) -> int:
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device) - self._base

    def recover(self) -> None:
        # The failed step's tensors die with its frames; return their blocks so that the
        # next, smaller probe is not refused memory the failed one left cached.
        gc.collect()
        torch.cuda.empty_cache()


def _peak_or_none(step: Callable[[int], object], size: int, meter: PeakMeter) -> int | None:
    """The step's peak bytes at `size`, or None if it ran out of memory."""
    meter.start()
    try:
        step(size)
    except torch.cuda.OutOfMemoryError:
        pass
    else:
        return meter.stop()
    # Outside the except block: the error, and the frames holding the step's tensors, are released.
    meter.recover()
    return None


def probe_memory_with(step: Callable[[int], object], max_size: int, meter: PeakMeter) -> MemoryProbe:
    """Runs step(b) at b = 1, 2, 4, … up to max_size; at the first out-of-memory error,
    bisects between the largest size that ran and the smallest that did not, so the cap
    is exact (assuming a larger batch never needs less memory). A cap of 0 means not even
    one sample fits. Pass max_size = the global batch: a device that holds all of it has
    no cap (None)."""
    if isinstance(max_size, bool) or not isinstance(max_size, int) or max_size < 1:
        raise ValueError(f"max_size = {max_size!r}: expected a positive integer (the global batch)")
    peaks: dict[int, int] = {}
    fits, fails = 0, None
    size = 1
    while fails is None:
        peak = _peak_or_none(step, size, meter)
        if peak is None:
            fails = size
        else:
            peaks[size], fits = peak, size
            if size == max_size:
                break
            size = min(2 * size, max_size)
    while fails is not None and fails - fits > 1:
        middle = (fits + fails) // 2
        peak = _peak_or_none(step, middle, meter)
        if peak is None:
            fails = middle
        else:
            peaks[middle], fits = peak, middle
    sizes = sorted(peaks)
    if len(sizes) >= 2:
        bytes_per_sample = least_squares_line(sizes, [peaks[b] for b in sizes])[1]
    else:
        bytes_per_sample = peaks[sizes[0]] / sizes[0] if sizes else None
    return MemoryProbe(cap=fits if fails is not None else None, bytes_per_sample=bytes_per_sample,
                       peaks=tuple((b, peaks[b]) for b in sizes))


def probe_memory(step: Callable[[int], object], device: torch.device | str, max_size: int) -> MemoryProbe:
    """probe_memory_with on a CUDA device's allocator. On any other device there is no
    allocator peak to read and no out-of-memory error to expect: no cap (None)."""
    device = torch.device(device)
    if device.type != "cuda":
        return MemoryProbe(cap=None, bytes_per_sample=None, peaks=())
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return probe_memory_with(step, max_size, CudaPeakMeter(device))
