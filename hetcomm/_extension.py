"""Loads the compiled operators (hetcomm._C), with an error that says how to fix a
missing or mismatched build instead of a bare undefined-symbol message.

A pure-Python install (built with HETCOMM_BUILD_EXT=0) has no hetcomm._C at all: the
ops are then defined in Python (hetcomm._python_ops), with a warning. Only that case
falls back; a hetcomm._C that exists but does not load is a broken build and an error.
"""

import os
import warnings

import torch


class PurePythonWarning(UserWarning):
    """hetcomm runs without its compiled operators (a pure-Python install)."""


PURE_PYTHON_MESSAGE = (
    "hetcomm: no compiled operators in this install (hetcomm._C is absent: a pure-Python install). "
    "CPU ops run the PyTorch reference (exact, but several passes over the data); on CUDA tensors pack, "
    "unpack_ and unscale_ run the Triton kernels (if triton is installed) and cast_ the reference. "
    "For the fused C++/CUDA kernels, build them from a source checkout with a C++ compiler (and a CUDA "
    "toolkit for GPUs): pip install --no-build-isolation . "
    "Set HETCOMM_PURE_PYTHON=1 to acknowledge this and silence this warning."
)

try:
    # `import hetcomm._C`, not `from hetcomm import _C`: only the former reports a missing
    # module as ModuleNotFoundError with the module's name.
    import hetcomm._C as _C
except ImportError as error:
    if not (isinstance(error, ModuleNotFoundError) and error.name == "hetcomm._C"):
        raise ImportError(
            f"hetcomm's compiled operators (hetcomm._C) could not be loaded: {error}\n"
            f"hetcomm is a C++/CUDA extension built against one torch release; this environment has "
            f"torch {torch.__version__}. Rebuild it here with:\n"
            f"    pip install --no-build-isolation -e .   (from a source checkout)\n"
            f"or  pip install --no-build-isolation .      (to install it)"
        ) from error
    _C = None


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("+")[0].split(".")[:2])


COMPILED: bool = _C is not None

if COMPILED:
    if _C.built_with_torch != "unknown" and _release(_C.built_with_torch) != _release(torch.__version__):
        raise ImportError(
            f"hetcomm._C was built against torch {_C.built_with_torch} but torch {torch.__version__} is "
            f"installed; torch's C++ ABI changes between releases. Rebuild with "
            f"pip install --no-build-isolation -e ."
        )
    BUILT_WITH_TORCH: str | None = _C.built_with_torch
    CUDA_ARCHS: list[str] = [a for a in _C.cuda_archs.split(";") if a]
    CUDA_VERSION: str | None = _C.cuda_version or None
    CPU_ISA: str = _C.cpu_isa
else:
    from hetcomm import _python_ops  # noqa: F401  (defines and registers the ops)

    BUILT_WITH_TORCH = None
    CUDA_ARCHS = []
    CUDA_VERSION = None
    CPU_ISA = "none (pure-Python install)"
    if os.environ.get("HETCOMM_PURE_PYTHON") != "1":
        warnings.warn(PURE_PYTHON_MESSAGE, PurePythonWarning, stacklevel=2)
