"""Loads the compiled operators (hetcomm._C), with an error that says how to fix a
missing or mismatched build instead of a bare undefined-symbol message."""

import torch

try:
    from hetcomm import _C
except ImportError as error:
    raise ImportError(
        f"hetcomm's compiled operators (hetcomm._C) could not be loaded: {error}\n"
        f"hetcomm is a C++/CUDA extension built against one torch release; this environment has "
        f"torch {torch.__version__}. Rebuild it here with:\n"
        f"    pip install --no-build-isolation -e .   (from a source checkout)\n"
        f"or  pip install --no-build-isolation .      (to install it)"
    ) from error


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("+")[0].split(".")[:2])


if _C.built_with_torch != "unknown" and _release(_C.built_with_torch) != _release(torch.__version__):
    raise ImportError(
        f"hetcomm._C was built against torch {_C.built_with_torch} but torch {torch.__version__} is "
        f"installed; torch's C++ ABI changes between releases. Rebuild with "
        f"pip install --no-build-isolation -e ."
    )

BUILT_WITH_TORCH: str = _C.built_with_torch
CUDA_ARCHS: list[str] = [a for a in _C.cuda_archs.split(";") if a]
CUDA_VERSION: str | None = _C.cuda_version or None
CPU_ISA: str = _C.cpu_isa
