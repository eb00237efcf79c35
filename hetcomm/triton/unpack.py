"""hetcomm_triton::unpack_: dst[k] = cast(flat[segment k] * scale), with the check of
the written values and their sum of squares, in Triton. Same schema as hetcomm::unpack_.

The sum of squares is deterministic: each row of the plan writes its own partial sum
(rows are a fixed cut of the data, and the launch shape of a call with sq_norm is
fixed per GPU, see configs), and one program adds the partials in order. No float atomics.

Its precision: squares are summed in fp32 within a block (at most 4096 of them, a
relative error under 1e-6), then in fp64 across blocks and rows; the C++ kernels and
the reference use fp64 throughout. fp64 for every element would make the kernel
compute-bound on GeForce and T4 cards, whose fp64 runs at 1/32 or 1/64 of fp32.
Written values under about 1e-19 in magnitude have squares that lose precision in fp32
or flush to 0; they matter only if every value is that small.
"""

from collections.abc import Sequence

import torch
from torch import Tensor

from hetcomm import checks
from hetcomm.triton import multi_tensor


@torch.library.custom_op("hetcomm_triton::unpack_", mutates_args=("dst", "found_inf", "sq_norm"),
                         schema="(Tensor flat, Tensor(a!)[] dst, Tensor scale, Tensor(b!) found_inf, "
                                "Tensor(c!)? sq_norm=None) -> ()")
def unpack_(flat: Tensor, dst: Sequence[Tensor], scale: Tensor, found_inf: Tensor,
            sq_norm: Tensor | None = None) -> None:
    checks.check_unpack(flat, dst, scale, found_inf, sq_norm)
    multi_tensor.check_device("unpack_", flat.device)
    segments, offset = [], 0
    for t in dst:
        segments.append(multi_tensor.segment(flat, t, offset, 0, t.numel()))
        offset += t.numel()
    plan = multi_tensor.plan(segments, flat.device)
    partials = None
    if sq_norm is not None:
        # At least one element, so that an all-empty call still has a valid pointer.
        partials = torch.empty(max(plan.rows, 1), dtype=torch.float64, device=flat.device)
    # Without the sum the launch shape may be timed: dst is overwritten from flat, which
    # is only read, and found_inf is only ever set, so the timing runs change nothing.
    # With it, the shape fixes the order of the sum (see configs), so it stays fixed.
    multi_tensor.run(plan, scale, found_inf=found_inf, partials=partials, check_output=True, tune=sq_norm is None)
    if sq_norm is not None:
        multi_tensor.add_sum(partials, plan.rows, sq_norm)


@unpack_.register_fake
def _(flat, dst, scale, found_inf, sq_norm=None):
    checks.check_unpack(flat, dst, scale, found_inf, sq_norm, aliasing=False)
