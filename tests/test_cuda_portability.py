"""The CUDA kernels compile for Pascal, Volta and Turing without a GPU.

CUDA 13's nvcc (the toolkit here) cannot target sm_60/61/70, so the kernel headers,
which include no torch header, are compiled with NVRTC 12.9 from pip for the legacy
targets (csrc/kernels/compile_with_nvrtc.py). The NVRTC wheels are in the test extra.

sm_61 is left to the script's default run: it reads the same source as sm_60 (no
architecture test in the headers tells them apart, which a test here checks) and only
adds integer dot products, so what compiles for sm_60 compiles for sm_61; the emulated
sm_61 GPU (tests/cuda_emulator) builds and runs that architecture's code path.
"""

import importlib.util
import platform
import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "csrc" / "kernels" / "compile_with_nvrtc.py"

pytestmark = pytest.mark.skipif(platform.system() != "Linux",
                                reason="the NVRTC 12.9 wheels of the test extra are Linux wheels")


def load_script():
    spec = importlib.util.spec_from_file_location("compile_with_nvrtc", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# One target of each architecture test the headers make (see headers_tell_apart): each
# compile takes 15-20 s of a core.
COMPILED_ARCHS = ("60", "70", "75")


def test_kernel_headers_compile_for_pascal_volta_turing():
    result = subprocess.run([sys.executable, str(SCRIPT), "--arch", *COMPILED_ARCHS], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    for arch in COMPILED_ARCHS:
        assert f"sm_{arch}: ok" in result.stdout


INCLUDE = re.compile(r'^\s*#\s*include\s*[<"]([^>"]+)[>"]', re.MULTILINE)
ARCH_TEST = re.compile(r"__CUDA_ARCH__\s*(<=|>=|==|!=|<|>)\s*(\d+)|NV_(PROVIDES|IS_EXACTLY)_SM_(\d+)")


def headers_tell_apart(a: int, b: int) -> list[str]:
    """The architecture tests in the headers that the kernel source reaches (csrc/kernels
    and the CUDA runtime wheel's, followed through their includes) that hold for one of
    sm_<a>, sm_<b> and not the other."""
    nvrtc = load_script()
    roots = [nvrtc.CSRC, nvrtc.wheel_file("nvidia-cuda-runtime-cu12", "cuda_fp16.h").parent]
    seen, pending = set(), ["kernels/multi_tensor.cuh", "kernels/adamw.cuh"]
    while pending:
        name = pending.pop()
        path = next((root / name for root in roots if (root / name).is_file()), None)
        if path is not None and path not in seen:   # None: a standard or NVRTC built-in header
            seen.add(path)
            pending += INCLUDE.findall(path.read_text(errors="replace"))
    assert nvrtc.CSRC / "kernels" / "numeric.cuh" in seen and any(p.name == "cuda_bf16.hpp" for p in seen)
    compare = {"<": int.__lt__, "<=": int.__le__, ">": int.__gt__, ">=": int.__ge__, "==": int.__eq__,
               "!=": int.__ne__}
    found = []
    for path in sorted(seen):
        for match in ARCH_TEST.finditer(path.read_text(errors="replace")):
            if match[1]:
                holds = [compare[match[1]](10 * arch, int(match[2])) for arch in (a, b)]
            else:
                holds = [arch >= int(match[4]) if match[3] == "PROVIDES" else arch == int(match[4]) for arch in (a, b)]
            if holds[0] != holds[1]:
                found.append(f"{path.name}: {match[0]}")
    return found


def test_sm_60_and_sm_61_read_the_same_source():
    """Why compiling sm_60 checks sm_61 too; and that the scan sees what splits sm_70 from
    sm_75 (NV_PROVIDES_SM_75 in cuda_fp16.hpp and cuda_bf16.hpp)."""
    assert headers_tell_apart(60, 61) == []
    assert headers_tell_apart(70, 75)


def test_the_check_reports_a_compile_error():
    """A broken kernel must fail the check, not pass silently."""
    nvrtc = load_script()
    lib = nvrtc.Nvrtc(nvrtc.nvrtc_library())
    ok, log, _, _ = lib.compile("__global__ void k() { undeclared_name(); }", [], ["--gpu-architecture=sm_61"])
    assert not ok and "undeclared_name" in log


def test_every_instantiated_kernel_is_checked():
    """The script's kernel list follows the dispatch in csrc/cuda/multi_tensor_cuda.cu:
    3 x 3 dtype pairs for three kinds of work, the 3 same-type pairs for unscale_, two
    item counts; and in adamw_cuda.cu: 3 gradient dtypes x (no copy, 3 copy dtypes);
    each with its table in the arguments and in device memory (cuda/device_tables.h);
    and the sum-of-squares finisher."""
    names = load_script().kernel_names()
    assert len(names) == ((3 * 9 + 3) * 2 + 3 * 4) * 2 + 1 and len(set(names)) == len(names)
