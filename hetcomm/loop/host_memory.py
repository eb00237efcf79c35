"""A CPU worker's heap kept between steps.

By default glibc hands freed memory back to the kernel: blocks above a threshold that
starts at 128 KiB are mapped and unmapped one by one, and the top of the heap is trimmed
once 128 KiB of it are free. A training step frees its activations and gradients and
allocates them again in the next, so every step then faults the same pages in afresh
(measured on the benchmark's GPT 2x192: 12,000-21,000 page faults and 28-45 ms of
kernel time on the second step, 2,500-5,000 on the next ones, and about 1,000 on every
step of the rank with the smallest passes). A simulated rank's compute time is the CPU
time it needed, kernel time included, stretched by 1/speed, so a rank of speed 1/8
turned each of those milliseconds into eight, which no card of its own would.

keep_freed_memory() fixes the mapping threshold at 32 MiB (the most glibc's own
adjustment raises it to on 64-bit hosts) and stops trimming, so after the first step the heap holds
what a step needs and the pages stay mapped: the process keeps its peak heap, which
training reuses every step. Other C libraries (musl, macOS) are left as they are.
"""

import ctypes
import ctypes.util

# mallopt's parameters (malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_CEILING = 32 * 2**20
NEVER_TRIM = 2**31 - 1   # mallopt takes an int


def keep_freed_memory() -> bool:
    """Makes glibc keep freed memory mapped in this process; returns whether it could."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_CEILING)) and bool(mallopt(M_TRIM_THRESHOLD, NEVER_TRIM))
