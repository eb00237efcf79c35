"""What this installation of hetcomm can do: compiled or pure Python, versions, built back
ends, devices."""

import importlib.util

import torch

from hetcomm import _extension
from hetcomm._version import __version__
from hetcomm.ops import get_backend

OPS = ("pack", "pack.out", "unpack_", "unscale_", "cast_", "adamw_")
# CompositeExplicitAutograd: one kernel for any device; the fallback that names the missing
# kernel (csrc/ops/no_kernel.cpp and its twin in _python_ops), and a pure-Python install's cast_.
DISPATCH_KEYS = ("CPU", "CUDA", "Meta", "CompositeExplicitAutograd")


def _kernels_by_op() -> dict[str, list[str]]:
    """Which dispatch keys have a kernel for each op, read from the dispatcher itself."""
    table = {}
    for op in OPS:
        table[op] = [key for key in DISPATCH_KEYS
                     if torch._C._dispatch_has_kernel_for_dispatch_key(f"hetcomm::{op}", key)]
    return table


def _devices() -> list[dict]:
    devices = [{"device": "cpu", "threads": torch.get_num_threads()}]
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            devices.append({"device": f"cuda:{index}", "name": props.name,
                            "capability": f"{props.major}.{props.minor}",
                            "memory_gib": round(props.total_memory / 2**30, 1),
                            "sms": props.multi_processor_count})
    return devices


def _triton_backend() -> dict:
    """Whether the triton back end can run here: triton's version, whether kernels run
    in its CPU interpreter (TRITON_INTERPRET=1), and the ops it registered."""
    if importlib.util.find_spec("triton") is None:
        return {"importable": False}
    try:
        import triton

        from hetcomm.triton import OPS, kernels
    except ImportError as error:
        return {"importable": False, "error": str(error)}
    return {"importable": True, "version": triton.__version__, "interpreter": kernels.INTERPRETED,
            "ops": [op for op in OPS
                    if torch._C._dispatch_has_kernel_for_dispatch_key(f"hetcomm_triton::{op}",
                                                                      "CompositeExplicitAutograd")]}


def info() -> dict:
    """Returns a dict describing this installation (printed by ``hetcomm info``)."""
    return {
        "hetcomm": __version__,
        "torch": torch.__version__,
        "install": "compiled" if _extension.COMPILED else "pure-python",
        "built_with_torch": _extension.BUILT_WITH_TORCH,
        "backends": {
            "cpu": {"compiled": _extension.COMPILED, "vector_isa": _extension.CPU_ISA},
            "cuda": {"compiled": bool(_extension.CUDA_ARCHS), "cuda_version": _extension.CUDA_VERSION,
                     "archs": _extension.CUDA_ARCHS},
            "triton": _triton_backend(),
        },
        "backend": get_backend(),
        "kernels": _kernels_by_op(),
        "devices": _devices(),
    }
