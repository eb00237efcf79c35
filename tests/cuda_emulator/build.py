"""Builds one library per emulated GPU: the CUDA back end's real sources (csrc/cuda,
csrc/kernels, csrc/ops) compiled by the host C++ compiler against the headers in shim/,
so that the kernels run on CPU tensors (src/runtime.cpp runs each CUDA thread as a fiber).

No source is rewritten: csrc/cuda/hooks.h leaves its launch and registration macros to
the preludes in shim/hetemu/, which g++ includes first (-include). The objects that do
not depend on the architecture are compiled once for all devices.

Builds are cached under build/cuda_emulator/<hash of every input>/; $HETCOMM_EMULATOR_CSRC
points the build at another csrc/ (benchmarks/emulator_mutants.py seeds bugs into copies)
and $HETCOMM_EMULATOR_BUILD_DIR moves the cache.
"""

import concurrent.futures
import fcntl
import hashlib
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


@dataclass(frozen=True)
class Device:
    arch: int              # __CUDA_ARCH__
    sm_count: int          # tiny, so that grids are small and blocks stride over many chunks
    max_threads_per_sm: int
    resident_blocks: int   # the occupancy answer, which may cap the launch shape's blocks per SM
    max_segment_numel: int = 1 << 30   # kMaxSegmentNumel: the longest piece of a tensor in one table entry


# Launch shapes (csrc/cuda/launch_shape.cu): sm_61 {8 blocks/SM, 2 items}, software bf16
# rounding; sm_75 {4, 4 items}, software bf16 rounding; sm_80 {8, 2} capped at 5 resident
# blocks, the cvt.rn.bf16.f32 path. sm_61 splits tensors into segments of 2^20
# elements, so that a tensor of a few million elements takes the path that real builds
# take past 2^30 (test_cuda_ops.test_tensor_longer_than_one_segment).
DEVICES = {
    "sm61": Device(610, 1, 2048, 8, max_segment_numel=1 << 20),
    "sm75": Device(750, 2, 1024, 4),
    "sm80": Device(800, 3, 2048, 5),
}

CXX = os.environ.get("CXX", "g++")
FLAGS = [
    "-std=c++20", "-O2", "-fPIC", "-fvisibility=hidden", "-fvisibility-inlines-hidden",
    # nvcc contracts no multiply-add in these kernels (fmaf is written out), and their
    # vector copies reinterpret pointers as CUDA code may.
    "-ffp-contract=off", "-fno-strict-aliasing", "-Wno-unknown-pragmas",
    f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
]


def csrc() -> Path:
    return Path(os.environ.get("HETCOMM_EMULATOR_CSRC", ROOT / "csrc")).resolve()


def build_root() -> Path:
    return Path(os.environ.get("HETCOMM_EMULATOR_BUILD_DIR", ROOT / "build" / "cuda_emulator")).resolve()


def includes(src: Path) -> list[str]:
    return [f"-I{p}" for p in (HERE / "shim", HERE / "src", src, Path(torch.__file__).parent / "include")]


def common_units(src: Path) -> dict[str, list[str]]:
    """Object name -> compiler arguments, for the objects every device shares."""
    cu = ["-x", "c++"]
    return {
        "ops_cuda.o": cu + ["-include", "hetemu/registration_prelude.h", str(src / "cuda" / "ops_cuda.cu")],
        "launch_shape.o": cu + [str(src / "cuda" / "launch_shape.cu")],
        "device_tables.o": cu + [str(src / "cuda" / "device_tables.cu")],
        "plans.o": [str(src / "ops" / "plans.cpp")],
        "adamw_plan.o": [str(src / "ops" / "adamw_plan.cpp")],
        "checks.o": [str(src / "ops" / "checks.cpp")],
        "runtime.o": [str(HERE / "src" / "runtime.cpp")],
        "guarded_allocator.o": [str(HERE / "src" / "guarded_allocator.cpp")],
        "module.o": [str(HERE / "src" / "module.cpp")],
    }


def device_units(src: Path, name: str, device: Device) -> dict[str, list[str]]:
    major, minor = divmod(device.arch // 10, 10)
    defines = [f"-DHETEMU_ARCH={device.arch}", f"-DHETEMU_CC_MAJOR={major}", f"-DHETEMU_CC_MINOR={minor}",
               f"-DHETEMU_SM_COUNT={device.sm_count}", f"-DHETEMU_MAX_THREADS_PER_SM={device.max_threads_per_sm}",
               f"-DHETEMU_RESIDENT_BLOCKS={device.resident_blocks}",
               f"-DHETCOMM_MAX_SEGMENT_NUMEL={device.max_segment_numel}LL"]
    return {
        f"{name}/multi_tensor_cuda.o": defines + ["-x", "c++", "-include", "hetemu/kernel_prelude.h",
                                                 str(src / "cuda" / "multi_tensor_cuda.cu")],
        f"{name}/adamw_cuda.o": defines + ["-DHETEMU_ADAMW_UNIT", "-x", "c++", "-include", "hetemu/kernel_prelude.h",
                                          str(src / "cuda" / "adamw_cuda.cu")],
        f"{name}/device.o": defines + [str(HERE / "src" / "device.cpp")],
    }


def input_hash(src: Path) -> str:
    """Every file that goes into a build, the flags, the compiler and torch."""
    digest = hashlib.sha256()
    files = [p for d in ("cuda", "kernels", "ops") for p in sorted((src / d).rglob("*")) if p.is_file()]
    files += [p for d in ("shim", "src") for p in sorted((HERE / d).rglob("*")) if p.is_file()]
    files.append(Path(__file__))
    for path in files:
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    compiler = subprocess.run([CXX, "--version"], capture_output=True, text=True, check=True).stdout
    digest.update(f"{FLAGS}{DEVICES}{compiler}{torch.__version__}".encode())
    return digest.hexdigest()[:16]


def compile_one(src: Path, out: Path, args: list[str]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    command = [CXX, *FLAGS, *includes(src), *args[:-1], "-c", args[-1], "-o", str(out)]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"cuda_emulator: compiling {args[-1]} failed:\n{' '.join(command)}\n{result.stderr}")


def link(out: Path, objects: list[Path]) -> None:
    torch_lib = Path(torch.__file__).parent / "lib"
    command = [CXX, "-shared", "-o", str(out), *map(str, objects), f"-L{torch_lib}", f"-Wl,-rpath,{torch_lib}",
               "-ltorch_cpu", "-lc10"]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"cuda_emulator: linking {out.name} failed:\n{' '.join(command)}\n{result.stderr}")


def build() -> dict[str, Path]:
    """The library of every emulated device, built unless this exact build exists."""
    src = csrc()
    out = build_root() / input_hash(src)
    libraries = {name: out / f"hetemu_{name}.so" for name in DEVICES}
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one builder per directory; the others wait and reuse
        if (out / "done").exists():
            return libraries
        units = common_units(src)
        for name, device in DEVICES.items():
            units.update(device_units(src, name, device))
        # Longest first: the kernel units, then those that include torch's headers.
        order = sorted(units, key=lambda o: ("multi_tensor" not in o and "adamw_cuda" not in o, "ops_cuda" not in o, o))
        with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1) as pool:
            for job in [pool.submit(compile_one, src, out / o, units[o]) for o in order]:
                job.result()
        shared = [out / o for o in common_units(src)]
        for name, library in libraries.items():
            link(library, shared + [out / o for o in device_units(src, name, DEVICES[name])])
        (out / "done").touch()
    return libraries


if __name__ == "__main__":
    for name, path in build().items():
        print(name, path, file=sys.stderr)
