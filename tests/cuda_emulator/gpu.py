"""One emulated GPU: a library built by build.py, loaded with ctypes, whose kernels the
tests switch on for CPU tensors (see src/module.cpp)."""

import contextlib
import ctypes
import functools
from pathlib import Path

from . import build

# Thread (and block) orders: the run's schedule, and the runtime's value for it.
SCHEDULES = {"in-order": 0, "reversed": 1, "shuffled": 7}


class EmulatedGpu:
    def __init__(self, name: str, library: Path):
        self.name = name
        self._lib = ctypes.CDLL(str(library))
        self._lib.hetemu_enable.restype = ctypes.c_char_p
        self._lib.hetemu_set_schedule.argtypes = [ctypes.c_uint]
        self._lib.hetemu_launches.restype = ctypes.c_longlong

    @contextlib.contextmanager
    def running(self, schedule: str = "in-order"):
        """While open, the hetcomm ops on CPU tensors run this GPU's CUDA kernels."""
        import hetcomm  # noqa: F401  (defines the ops that the kernels are bound to)

        self._lib.hetemu_set_schedule(SCHEDULES[schedule])
        error = self._lib.hetemu_enable()
        if error is not None:
            raise RuntimeError(f"cuda_emulator {self.name}: {error.decode()}")
        try:
            yield self
        finally:
            self._lib.hetemu_disable()
            self._lib.hetemu_set_schedule(SCHEDULES["in-order"])

    def launches(self) -> int:
        """Kernel launches so far."""
        return self._lib.hetemu_launches()


@functools.cache
def emulated_gpu(name: str) -> EmulatedGpu:
    """The emulated GPU `name` (a key of build.DEVICES), built on first use."""
    return EmulatedGpu(name, build.build()[name])
