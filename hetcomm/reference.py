"""The meaning of every hetcomm op in plain PyTorch: the tests' oracle.

Each function computes in fp32 exactly as the kernels promise (one fp32 multiply, then
one round-to-nearest-even cast), so results can be compared bit-for-bit. Sums of
squares are computed in float64. None of these functions is fast, and none is used
on a hot path.
"""

import math
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
    total = torch.zeros((), dtype=torch.float64, device=flat.device)
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


def adamw_constants(lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                    step: float) -> dict[str, Tensor]:
    """The fp32 constants of an AdamW step at `step` (the count after it): computed in
    double from the Python floats, as torch.optim.AdamW does, then rounded once."""
    bias_correction1 = 1 - beta1 ** step
    bias_correction2 = 1 - beta2 ** step
    values = {"decay": 1 - lr * weight_decay, "beta1_weight": 1 - beta1, "beta2": beta2, "beta2_weight": 1 - beta2,
              "eps": eps, "neg_step_size": -(lr / bias_correction1),
              "bias_correction2_sqrt": math.sqrt(bias_correction2)}
    return {name: torch.tensor(value, dtype=torch.float32) for name, value in values.items()}


def adamw_(grads: Sequence[Tensor], params: Sequence[Tensor], exp_avgs: Sequence[Tensor],
           exp_avg_sqs: Sequence[Tensor], copies: Sequence[Tensor], grad_scale: Tensor, found_inf: Tensor,
           step: Tensor, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float) -> None:
    """torch.optim.AdamW's update of fp32 masters, one fp32 operation at a time in the
    kernels' order, each rounded once: with g = grads[k] * grad_scale,
        exp_avg    = exp_avg + (g - exp_avg) * (1 - beta1)
        exp_avg_sq = exp_avg_sq * beta2 + (g * g) * (1 - beta2)
        param      = param * (1 - lr * wd) + (exp_avg / (sqrt(exp_avg_sq) / sqrt(bc2) + eps)) * -(lr / bc1)
    and copies[k] = param cast; nothing at all when found_inf is non-zero. grads and
    copies: one tensor per parameter, or one flat buffer of all their elements in order."""
    if found_inf.item() != 0:
        return
    constants = adamw_constants(lr, beta1, beta2, eps, weight_decay, step.item())
    correction2 = constants["bias_correction2_sqrt"].item()
    k = {name: value.to(found_inf.device) for name, value in constants.items()}
    grads = _per_parameter(grads, params)
    copies = _per_parameter(copies, params) if len(copies) else [None] * len(params)
    for grad, param, exp_avg, exp_avg_sq, copy in zip(grads, params, exp_avgs, exp_avg_sqs, copies, strict=True):
        g = grad.reshape(param.shape).float() * grad_scale.float()
        exp_avg.copy_(exp_avg + (g - exp_avg) * k["beta1_weight"])
        exp_avg_sq.copy_(exp_avg_sq * k["beta2"] + (g * g) * k["beta2_weight"])
        # The square root through float64, which rounds to the correctly rounded fp32 root
        # (torch.sqrt on fp32 CPU tensors may be off by an ulp: SLEEF); a divisor of full
        # size, as a scalar one may become a multiply by its reciprocal (CUDA).
        root = torch.sqrt(exp_avg_sq.double()).float()
        denom = root / torch.full_like(exp_avg_sq, correction2) + k["eps"]
        param.copy_(param * k["decay"] + (exp_avg / denom) * k["neg_step_size"])
        if copy is not None:
            copy.copy_(param.reshape(copy.shape))


def _per_parameter(tensors: Sequence[Tensor], params: Sequence[Tensor]) -> list[Tensor]:
    """One tensor per parameter: the list itself, or the views of a flat buffer."""
    if len(tensors) == len(params):
        return list(tensors)
    sizes = [p.numel() for p in params]
    return list(torch.split(tensors[0], sizes))
