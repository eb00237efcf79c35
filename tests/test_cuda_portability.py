"""The CUDA kernels compile for Pascal, Volta and Turing without a GPU.

CUDA 13's nvcc (the toolkit here) cannot target sm_60/61/70, so the kernel headers,
which include no torch header, are compiled with NVRTC 12.9 from pip for every legacy
target (csrc/kernels/compile_with_nvrtc.py). The NVRTC wheels are in the test extra.
"""

import importlib.util
import platform
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


def test_kernel_headers_compile_for_pascal_volta_turing():
    result = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    for arch in ("60", "61", "70", "75"):
        assert f"sm_{arch}: ok" in result.stdout


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
