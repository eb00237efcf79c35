"""The meaning of every hetcomm op in plain PyTorch: the tests' oracle.

Each function computes in fp32 exactly as the kernels promise (one fp32 multiply, then
one round-to-nearest-even cast), so results can be compared bit-for-bit. Sums of
squares are computed in float64. None of these functions is fast, and none is used
on a hot path.
"""

from collections.abc import Sequence

import torch
from torch import Tensor


def pack(src: Sequence[Tensor], scale: Tensor, dtype: torch.dtype) -> Tensor:
    """concat(src[k].flatten() * scale) cast to dtype."""
    parts = [t.reshape(-1).float() * scale.float() for t in src]
    return torch.cat(parts).to(dtype)


def unpack_(flat: Tensor, dst: Sequence[Tensor], scale: Tensor, found_inf: Tensor,
            sq_norm: Tensor | None = None) -> None:
    """dst[k] = cast(flat[segment k] * scale); found_inf = 1 if any written value is
    non-finite; sq_norm += sum of squares of the written values."""
    offset = 0
    any_nonfinite = False
    total = torch.zeros((), dtype=torch.float64)
    for t in dst:
        values = (flat[offset:offset + t.numel()].float() * scale.float()).to(t.dtype)
        offset += t.numel()
        written = values.double()
        any_nonfinite |= bool((~torch.isfinite(written)).any())
        total += (written * written).sum()
        t.copy_(values.view(t.shape))
    if any_nonfinite:
        found_inf.fill_(1.0)
    if sq_norm is not None:
        sq_norm.add_(total.float())


def unscale_(tensors: Sequence[Tensor], inv_scale: Tensor, found_inf: Tensor) -> None:
    """t *= inv_scale in fp32 math; found_inf = 1 if any input value is non-finite."""
    any_nonfinite = False
    for t in tensors:
        any_nonfinite |= bool((~torch.isfinite(t)).any())
        t.copy_((t.float() * inv_scale.float()).to(t.dtype))
    if any_nonfinite:
        found_inf.fill_(1.0)


def cast_(src: Sequence[Tensor], dst: Sequence[Tensor]) -> None:
    """dst[k] = src[k] converted to dst[k]'s dtype."""
    for s, d in zip(src, dst, strict=True):
        d.copy_(s)
