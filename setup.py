"""Builds hetcomm._C: the hetcomm operators for the CPU, plus CUDA when it can.

Environment:
  HETCOMM_BUILD_EXT=1|0   1 (default): build hetcomm._C; 0: build no extension at all, a
                          pure-Python wheel (py3-none-any) whose ops run the PyTorch reference
                          on CPU and the Triton kernels on CUDA (hetcomm warns about this on import).
  HETCOMM_CUDA=auto|1|0   auto (default): build the CUDA extension when torch is a CUDA
                          build and a CUDA toolkit is found; 1: the same, but fail instead
                          of falling back to a CPU-only build; 0: CPU only.
  TORCH_CUDA_ARCH_LIST    GPU targets, e.g. "6.1;7.0+PTX". Default: 6.0;6.1;7.0;7.5;8.0;8.6+PTX
                          filtered to what the toolkit can compile (the filtering is printed).
  CUDA_HOME               the toolkit; found from nvcc on PATH or /usr/local/cuda otherwise.
  HETCOMM_DEBUG=1         keep debug symbols (-g -O0) instead of the release flags.

Install after torch, without build isolation (an isolated build would compile against
a second copy of torch):  pip install --no-build-isolation .
"""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import setup

import torch
from torch.utils import cpp_extension

ROOT = Path(__file__).resolve().parent
CSRC = ROOT / "csrc"
LEGACY_FIRST_ARCHS = ["6.0", "6.1", "7.0", "7.5", "8.0", "8.6"]


def log(message):
    print(f"hetcomm setup: {message}", file=sys.stderr)


def find_cuda_home():
    """The toolkit root, or None. torch guesses /usr/local from a wrapper script on
    PATH, so look for a real nvcc under each candidate."""
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    nvcc_on_path = shutil.which("nvcc")
    if nvcc_on_path:
        candidates.append(str(Path(nvcc_on_path).resolve().parent.parent))
    candidates.append(cpp_extension.CUDA_HOME)
    for candidate in candidates:
        if candidate and (Path(candidate) / "bin" / "nvcc").is_file():
            return candidate
    return None


def supported_archs(nvcc):
    """Compute capabilities the toolkit accepts, e.g. {"7.5", "8.0", ...}."""
    out = subprocess.run([nvcc, "--list-gpu-arch"], capture_output=True, text=True, check=True).stdout
    return {f"{m[0]}.{m[1:]}" for m in re.findall(r"compute_(\d+)", out)}


def default_arch_list(nvcc):
    """Legacy-first targets the toolkit supports, with PTX of the newest for later GPUs."""
    available = supported_archs(nvcc)
    kept = [a for a in LEGACY_FIRST_ARCHS if a in available]
    dropped = [a for a in LEGACY_FIRST_ARCHS if a not in available]
    if dropped:
        log(f"this CUDA toolkit cannot compile for {', '.join(dropped)}; building for {', '.join(kept)}. "
            "For Pascal/Volta, build with a CUDA 12.x toolkit and a CUDA 12 build of torch.")
    if not kept:
        raise RuntimeError(f"the CUDA toolkit supports none of {LEGACY_FIRST_ARCHS}; set TORCH_CUDA_ARCH_LIST")
    return ";".join(kept[:-1] + [kept[-1] + "+PTX"])


def cuda_build_wanted():
    """Returns the toolkit root to build CUDA with, or None for a CPU-only build."""
    mode = os.environ.get("HETCOMM_CUDA", "auto").lower()
    if mode not in ("auto", "1", "0"):
        raise RuntimeError(f"HETCOMM_CUDA must be auto, 1 or 0; got {mode!r}")
    if mode == "0":
        log("HETCOMM_CUDA=0: building the CPU-only extension")
        return None
    problem = None
    cuda_home = find_cuda_home()
    if torch.version.cuda is None:
        problem = f"torch {torch.__version__} is a CPU-only build"
    elif cuda_home is None:
        problem = "no CUDA toolkit found (set CUDA_HOME to the directory holding bin/nvcc)"
    if problem is None:
        return cuda_home
    if mode == "1":
        raise RuntimeError(f"HETCOMM_CUDA=1 but {problem}")
    log(f"{problem}: building the CPU-only extension (set HETCOMM_CUDA=1 to make this an error)")
    return None


def sources(pattern):
    return sorted(str(p.relative_to(ROOT)) for p in CSRC.rglob(pattern))


class ReleaseBuildExtension(cpp_extension.BuildExtension):
    """Drops Python's default -g (30x larger objects, slower builds) unless HETCOMM_DEBUG=1."""

    def build_extensions(self):
        if os.environ.get("HETCOMM_DEBUG") != "1":
            self.compiler.compiler_so = [f for f in self.compiler.compiler_so if f != "-g"]
        super().build_extensions()


def make_extension():
    debug = os.environ.get("HETCOMM_DEBUG") == "1"
    cxx_flags = ["-O0", "-g"] if debug else ["-O3"]
    # No fused multiply-adds the source did not write: adamw_'s loops (scalar and AVX2)
    # promise the same bits as its reference, one rounding per operation.
    cxx_flags += ["-fopenmp", "-ffp-contract=off", f'-DHETCOMM_TORCH_VERSION="{torch.__version__}"']
    kwargs = dict(
        name="hetcomm._C",
        include_dirs=[str(CSRC)],
        extra_link_args=["-fopenmp"],
    )
    cuda_home = cuda_build_wanted()
    if cuda_home is None:
        return cpp_extension.CppExtension(sources=sources("*.cpp"), extra_compile_args={"cxx": cxx_flags},
                                          **kwargs)

    # torch reads the toolkit location and the arch list from these at build time.
    os.environ["CUDA_HOME"] = cuda_home
    cpp_extension.CUDA_HOME = cuda_home
    nvcc = str(Path(cuda_home) / "bin" / "nvcc")
    if not os.environ.get("TORCH_CUDA_ARCH_LIST"):
        os.environ["TORCH_CUDA_ARCH_LIST"] = default_arch_list(nvcc)
    archs = os.environ["TORCH_CUDA_ARCH_LIST"]
    log(f"building the CUDA extension with {nvcc} for TORCH_CUDA_ARCH_LIST={archs}")
    cxx_flags += ["-DHETCOMM_WITH_CUDA", f'-DHETCOMM_CUDA_ARCHS="{archs}"',
                  f'-DHETCOMM_CUDA_VERSION="{torch.version.cuda}"']
    # No fast-math: the kernels promise bit-exact casts and IEEE non-finite checks.
    nvcc_flags = ["-O0", "-g", "-G"] if debug else ["-O3"]
    return cpp_extension.CUDAExtension(sources=sources("*.cpp") + sources("*.cu"),
                                       extra_compile_args={"cxx": cxx_flags, "nvcc": nvcc_flags}, **kwargs)


def make_ext_modules():
    mode = os.environ.get("HETCOMM_BUILD_EXT", "1")
    if mode not in ("1", "0"):
        raise RuntimeError(f"HETCOMM_BUILD_EXT must be 1 or 0; got {mode!r}")
    if mode == "0":
        log("HETCOMM_BUILD_EXT=0: building no extension (a pure-Python install)")
        return []
    return [make_extension()]


# Name, version and packages come from pyproject.toml.
setup(
    ext_modules=make_ext_modules(),
    cmdclass={"build_ext": ReleaseBuildExtension},
)
