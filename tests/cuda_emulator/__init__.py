"""A CPU emulator for hetcomm's CUDA back end: csrc/cuda and csrc/kernels compiled
unmodified with g++, every CUDA thread a fiber, for emulated sm_61, sm_75 and sm_80
GPUs (build.py). tests/conftest.py puts it behind the `device` fixture, so the CUDA
test bodies run on it now and on a real GPU when there is one."""

from .build import DEVICES
from .gpu import SCHEDULES, EmulatedGpu, emulated_gpu

GPUS = tuple(DEVICES)  # "sm61", "sm75", "sm80"

__all__ = ["GPUS", "SCHEDULES", "EmulatedGpu", "emulated_gpu"]
