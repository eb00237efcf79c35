"""hetcomm: fused gradient-communication and mixed-precision kernels for data-parallel
training on clusters of mixed, older NVIDIA GPUs."""

from hetcomm._extension import PurePythonWarning
from hetcomm._version import __version__
from hetcomm.comm import ReduceResult, WeightedHookState, WeightedReducer, weighted_hook
from hetcomm.info import info
from hetcomm.ops import adamw_, cast_, get_backend, pack, set_backend, unpack_, unscale_

__all__ = ["__version__", "info", "pack", "unpack_", "unscale_", "cast_", "adamw_", "set_backend", "get_backend",
           "WeightedReducer", "ReduceResult", "WeightedHookState", "weighted_hook", "PurePythonWarning"]
