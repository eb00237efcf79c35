"""hetcomm_triton::pack and pack.out: concat(src[k].flatten() * scale) cast to the wire
dtype, one pass, in Triton. Same schemas as hetcomm::pack, except that out is not
keyword-only (custom_op does not take keyword-only tensors); it can still be passed
as out=."""

from collections.abc import Sequence

import torch
from torch import Tensor

from hetcomm import checks
from hetcomm.triton import multi_tensor


def _pack_into(src: Sequence[Tensor], scale: Tensor, out: Tensor) -> None:
    multi_tensor.check_device("pack", out.device)
    segments, offset = [], 0
    for t in src:
        segments.append(multi_tensor.segment(t, out, 0, offset, t.numel()))
        offset += t.numel()
    # pack only reads src and overwrites out, so its launch shape may be chosen by timing.
    multi_tensor.run(multi_tensor.plan(segments, out.device), scale, tune=True)


@torch.library.custom_op("hetcomm_triton::pack", mutates_args=(),
                         schema="(Tensor[] src, Tensor scale, ScalarType dtype) -> Tensor")
def pack(src: Sequence[Tensor], scale: Tensor, dtype: torch.dtype) -> Tensor:
    total = checks.check_pack_sources(src, scale)
    checks.check_supported_dtype("pack", "dtype", dtype)
    out = torch.empty(total, dtype=dtype, device=src[0].device)
    _pack_into(src, scale, out)
    return out


@pack.register_fake
def _(src, scale, dtype):
    total = checks.check_pack_sources(src, scale)
    checks.check_supported_dtype("pack", "dtype", dtype)
    return src[0].new_empty((total,), dtype=dtype)


@torch.library.custom_op("hetcomm_triton::pack.out", mutates_args=("out",),
                         schema="(Tensor[] src, Tensor scale, Tensor(a!) out) -> ()")
def pack_out(src: Sequence[Tensor], scale: Tensor, out: Tensor) -> None:
    checks.check_pack(src, scale, out)
    _pack_into(src, scale, out)


@pack_out.register_fake
def _(src, scale, out):
    checks.check_pack(src, scale, out, aliasing=False)
