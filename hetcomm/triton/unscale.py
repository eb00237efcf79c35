"""hetcomm_triton::unscale_: GradScaler's unscale with its check of the input values,
in place, in Triton. Same schema as hetcomm::unscale_."""

from collections.abc import Sequence

import torch
from torch import Tensor

from hetcomm import checks
from hetcomm.triton import multi_tensor


@torch.library.custom_op("hetcomm_triton::unscale_", mutates_args=("tensors", "found_inf"),
                         schema="(Tensor(a!)[] tensors, Tensor inv_scale, Tensor(b!) found_inf) -> ()")
def unscale_(tensors: Sequence[Tensor], inv_scale: Tensor, found_inf: Tensor) -> None:
    checks.check_unscale(tensors, inv_scale, found_inf)
    multi_tensor.check_device("unscale_", found_inf.device)
    segments = [multi_tensor.segment(t, t, 0, 0, t.numel()) for t in tensors]
    multi_tensor.run(multi_tensor.plan(segments, found_inf.device), inv_scale, found_inf=found_inf, check_input=True)


@unscale_.register_fake
def _(tensors, inv_scale, found_inf):
    checks.check_unscale(tensors, inv_scale, found_inf, aliasing=False)
