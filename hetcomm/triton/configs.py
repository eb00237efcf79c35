"""Launch shapes for the Triton kernels, and which one each GPU generation gets.

The kernels stream memory: each program walks its row in blocks of BLOCK elements.
The shapes that suit older GPUs are the small ones: Pascal, Volta and Turing have
64K registers per SM, Turing runs at most 1024 threads per SM, and many gradients are
small (a bias of 64 elements gets a program of its own), so 64-thread programs with
8-16 elements per thread waste less and still fill an SM with enough of them. Ampere
and newer take larger blocks with more warps.

pack is autotuned over all of CONFIGS (its result does not depend on the shape), and
so is unpack_ without sq_norm (it overwrites dst from flat, which it only reads, and
found_inf is only ever set, so the autotuner's repeated runs change nothing). The
autotuner's key holds what changes the best shape: the row count's size class, the
dtypes, the alignment, and the check and sum flags (they cost registers). unpack_
with sq_norm and unscale_ use default_config() and are never timed: unscale_ works in
place, so the autotuner's repeated benchmark runs would unscale the caller's data
several times (its addresses sit in the row table, out of reach of restore_value),
and the order in which unpack_ sums squares follows BLOCK and num_warps, so a choice
made by timing could change sq_norm's last bit from one run to the next. Under
TRITON_INTERPRET=1 nothing is timed (every config would run on CPU): every launch
takes default_config().
"""

import torch
import triton

# num_stages=1: there is no reuse to pipeline in a streaming loop.
CONFIGS = (
    triton.Config({"BLOCK": 512}, num_warps=2, num_stages=1),
    triton.Config({"BLOCK": 1024}, num_warps=2, num_stages=1),
    triton.Config({"BLOCK": 1024}, num_warps=4, num_stages=1),
    triton.Config({"BLOCK": 2048}, num_warps=4, num_stages=1),
    triton.Config({"BLOCK": 4096}, num_warps=8, num_stages=1),
)

_PRE_AMPERE = CONFIGS[1]
_AMPERE_AND_NEWER = CONFIGS[3]


def default_config(device: torch.device) -> triton.Config:
    """The shape for unpack_ and unscale_ (and for pack where nothing is timed)."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 0):
        return _PRE_AMPERE
    return _AMPERE_AND_NEWER
