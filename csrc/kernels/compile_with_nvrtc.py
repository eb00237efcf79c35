"""Compiles hetcomm's CUDA kernel headers for the legacy GPU targets with NVRTC 12.9.

CUDA 13's nvcc no longer targets Pascal (sm_60/61) or Volta (sm_70), and pip has no
CUDA 12 nvcc, but it has NVRTC 12.9, which does. The kernels live in headers that
include no torch header (csrc/kernels/*.cuh), so they can be compiled here on their
own: every kernel the extension instantiates, for every target, to a cubin. Any
error or warning fails the run, so that Pascal and Volta support cannot rot on
machines whose toolkit cannot build for them.

Needs (on Linux, part of hetcomm's `test` extra):
    pip install nvidia-cuda-nvrtc-cu12==12.9.86 nvidia-cuda-runtime-cu12==12.9.79
(the runtime wheel carries cuda_fp16.h and cuda_bf16.h).

    python csrc/kernels/compile_with_nvrtc.py [--arch 60 61 70 75]
"""

import argparse
import concurrent.futures
import ctypes
import importlib.metadata
import itertools
import os
import sys
from pathlib import Path

CSRC = Path(__file__).resolve().parent.parent
LEGACY_ARCHS = ("60", "61", "70", "75")
TYPES = ("F32", "F16", "BF16")
WORKS = ("kScaleCast", "kScaleCastCheckInput", "kScaleCastCheckOutput", "kScaleCastCheckOutputSumSq")
ITEMS = (2, 4)  # the items-per-thread values of csrc/cuda/launch_shape.cu
# Tables in the kernel arguments, and in device memory for long lists that recur.
SEGMENT_TABLES = ("SegmentTable", "DeviceSegmentTable")
ADAMW_TABLES = ("AdamWTable", "DeviceAdamWTable")
# NVRTC 12.9 says this of every target before sm_75; it is the reason this check exists.
DEPRECATION = "nvrtc: warning: Architectures prior to '<compute/sm>_75' are deprecated"


def kernel_names() -> list[str]:
    """Every kernel that csrc/cuda/multi_tensor_cuda.cu and adamw_cuda.cu instantiate."""
    ns = "hetcomm::kernels"
    names = [f"&{ns}::multi_tensor_kernel<{ns}::{s}, {ns}::{d}, {ns}::Work::{w}, {i}, {ns}::{table}>"
             for s, d, w, i, table in itertools.product(TYPES, TYPES, WORKS, ITEMS, SEGMENT_TABLES)
             if s == d or w != "kScaleCastCheckInput"]  # unscale_ is in place: one type
    names += [f"&{ns}::adamw_kernel<{ns}::{g}, {ns}::{c}, {'true' if copy else 'false'}, {ns}::{table}>"
              for g in TYPES for c, copy in [("F32", False), *((t, True) for t in TYPES)] for table in ADAMW_TABLES]
    return names + [f"&{ns}::add_sum_of_squares_kernel"]


def wheel_file(distribution: str, name: str) -> Path:
    """The installed file `name` of a pip distribution, found through its RECORD."""
    try:
        files = importlib.metadata.distribution(distribution).files or []
    except importlib.metadata.PackageNotFoundError:
        raise SystemExit(f"error: {distribution} is not installed; install it with\n"
                         f"    pip install nvidia-cuda-nvrtc-cu12==12.9.86 nvidia-cuda-runtime-cu12==12.9.79\n"
                         f"(or pip install -e '.[test]')") from None
    for file in files:
        if file.name == name:
            return Path(file.locate()).resolve()
    raise SystemExit(f"error: {distribution} has no file named {name}")


class Nvrtc:
    """The few NVRTC entry points this check needs, through ctypes."""

    def __init__(self, library: Path):
        self.lib = ctypes.CDLL(str(library))
        self.lib.nvrtcGetErrorString.restype = ctypes.c_char_p

    def check(self, result: int, what: str) -> None:
        if result != 0:
            raise RuntimeError(f"{what}: {self.lib.nvrtcGetErrorString(result).decode()}")

    def version(self) -> str:
        major, minor = ctypes.c_int(), ctypes.c_int()
        self.check(self.lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
        return f"{major.value}.{minor.value}"

    def compile(self, source: str, names: list[str], options: list[str]) -> tuple[bool, str, int, list[str]]:
        """Returns (ok, log, cubin bytes, the names that were not instantiated)."""
        program = ctypes.c_void_p()
        self.check(self.lib.nvrtcCreateProgram(ctypes.byref(program), source.encode(), b"hetcomm_kernels.cu",
                                               0, None, None), "nvrtcCreateProgram")
        try:
            for name in names:
                self.check(self.lib.nvrtcAddNameExpression(program, name.encode()), f"nvrtcAddNameExpression {name}")
            encoded = [o.encode() for o in options]
            result = self.lib.nvrtcCompileProgram(program, len(encoded), (ctypes.c_char_p * len(encoded))(*encoded))
            log_size = ctypes.c_size_t()
            self.check(self.lib.nvrtcGetProgramLogSize(program, ctypes.byref(log_size)), "nvrtcGetProgramLogSize")
            log = ctypes.create_string_buffer(log_size.value)
            self.check(self.lib.nvrtcGetProgramLog(program, log), "nvrtcGetProgramLog")
            if result != 0:
                return False, log.value.decode(errors="replace"), 0, names
            cubin_size = ctypes.c_size_t()
            self.check(self.lib.nvrtcGetCUBINSize(program, ctypes.byref(cubin_size)), "nvrtcGetCUBINSize")
            missing = []
            for name in names:
                lowered = ctypes.c_char_p()
                if self.lib.nvrtcGetLoweredName(program, name.encode(), ctypes.byref(lowered)) != 0:
                    missing.append(name)
            return True, log.value.decode(errors="replace"), cubin_size.value, missing
        finally:
            self.lib.nvrtcDestroyProgram(ctypes.byref(program))


def nvrtc_library() -> Path:
    return wheel_file("nvidia-cuda-nvrtc-cu12", "libnvrtc.so.12")


def compile_for(arch: str) -> tuple[bool, str, int, list[str]]:
    """Compiles every kernel for sm_<arch>; see Nvrtc.compile for the result."""
    cuda_include = wheel_file("nvidia-cuda-runtime-cu12", "cuda_fp16.h").parent
    options = [f"--gpu-architecture=sm_{arch}", "--std=c++17", f"-I{CSRC}", f"-I{cuda_include}"]
    source = '#include "kernels/multi_tensor.cuh"\n#include "kernels/adamw.cuh"\n'
    return Nvrtc(nvrtc_library()).compile(source, kernel_names(), options)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", nargs="+", default=list(LEGACY_ARCHS), help="compute capabilities, e.g. 60 61")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="targets compiled at once")
    args = parser.parse_args(argv)

    nvrtc = Nvrtc(nvrtc_library())
    names = kernel_names()
    print(f"NVRTC {nvrtc.version()}: {len(names)} kernels of csrc/kernels for sm_{', sm_'.join(args.arch)}")
    # NVRTC serialises compilations within a process: one process per target.
    with concurrent.futures.ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        results = list(pool.map(compile_for, args.arch))
    failures = 0
    for arch, (ok, log, cubin_bytes, missing) in zip(args.arch, results):
        log = "\n".join(line for line in log.splitlines() if not line.startswith(DEPRECATION))
        if ok and not missing and not log.strip():
            print(f"  sm_{arch}: ok, {cubin_bytes} bytes of cubin")
            continue
        failures += 1
        print(f"  sm_{arch}: FAILED" + (" (warnings are errors here)" if ok and not missing else ""))
        if log.strip():
            print(log.rstrip())
        if ok:
            for name in missing:
                print(f"    not instantiated: {name}")
    if failures:
        print(f"error: the kernel headers do not compile cleanly for {failures} of {len(args.arch)} targets",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
