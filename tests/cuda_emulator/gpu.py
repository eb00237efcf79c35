"""One emulated GPU: a library built by build.py, loaded with ctypes, whose kernels the
tests switch on for CPU tensors (see src/module.cpp)."""

import contextlib
import ctypes
import functools
from pathlib import Path
from typing import NamedTuple

from . import build

# Thread (and block) orders: the run's schedule, and the runtime's value for it.
SCHEDULES = {"in-order": 0, "reversed": 1, "shuffled": 7}
MAX_RECENT_LAUNCHES = 64  # kMaxRecentLaunches in src/runtime_control.h


class TableCacheStats(NamedTuple):
    """The device-table cache of the CUDA back end (csrc/cuda/device_tables.h)."""

    hits: int           # calls that ran from a device table (the first of them uploaded it)
    misses: int         # first calls of a list: ran from kernel arguments
    uploads: int        # tables built
    entries: int        # lists held now
    last_launches: int  # of the last call's multi-tensor or adamw_ walk


class Launch(NamedTuple):
    """One kernel launch as the emulator ran it."""

    grid: int    # blocks
    block: int   # threads per block
    kernel: int  # the kernel's address: equal for one instance of a kernel template, else not


class EmulatedGpu:
    def __init__(self, name: str, library: Path):
        self.name = name
        self._lib = ctypes.CDLL(str(library))
        self._lib.hetemu_enable.restype = ctypes.c_char_p
        self._lib.hetemu_set_schedule.argtypes = [ctypes.c_uint]
        self._lib.hetemu_launches.restype = ctypes.c_longlong
        self._lib.hetemu_table_cache_stats.argtypes = [ctypes.POINTER(ctypes.c_longlong)]
        self._lib.hetemu_take_recent_launches.argtypes = [ctypes.POINTER(ctypes.c_longlong)]
        self._lib.hetemu_take_recent_launches.restype = ctypes.c_int

    @contextlib.contextmanager
    def running(self, schedule: str = "in-order"):
        """While open, the hetcomm ops on CPU tensors run this GPU's CUDA kernels, and
        torch.ops.hetcomm._set_launch_shape/_clear_launch_shape set their launch shape.
        It opens with an empty table cache and the table's launch shape, as a new process
        would: the schedules of a test share one library, and freed tensors' addresses
        come back, so a list left by an earlier test could otherwise make a first call a
        second."""
        import hetcomm  # noqa: F401  (defines the ops that the kernels are bound to)

        self.clear_table_cache()
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

    def take_recent_launches(self) -> list[Launch]:
        """The launches since the previous call (at most the last 64), oldest first."""
        fields = len(Launch._fields)
        values = (ctypes.c_longlong * (fields * MAX_RECENT_LAUNCHES))()
        count = self._lib.hetemu_take_recent_launches(values)
        return [Launch(*values[i * fields:(i + 1) * fields]) for i in range(count)]

    def table_cache_stats(self) -> TableCacheStats:
        values = (ctypes.c_longlong * len(TableCacheStats._fields))()
        self._lib.hetemu_table_cache_stats(values)
        return TableCacheStats(*values)

    def clear_table_cache(self) -> None:
        """Drops every device table and zeroes the counters."""
        self._lib.hetemu_clear_table_cache()


@functools.cache
def emulated_gpu(name: str) -> EmulatedGpu:
    """The emulated GPU `name` (a key of build.DEVICES), built on first use."""
    return EmulatedGpu(name, build.build()[name])
