"""Argument validation for the ops written in Python (the Triton back end and the
pure-Python install), with the messages of the C++ ops (csrc/ops/checks.cpp and
plans.cpp), in the same order, so that a bad call fails the same way whichever back
end runs it. Every check runs before anything is written.

Plain Python with no Triton import and no compiled code, so a pure-Python install can
use it; the fake kernels use it too (without the aliasing check, which needs real
addresses).
"""

import math
from collections.abc import Sequence

import torch
from torch import Tensor

_SUPPORTED = (torch.float32, torch.float16, torch.bfloat16)


def check_supported_dtype(op: str, name: str, dtype: torch.dtype) -> None:
    if dtype not in _SUPPORTED:
        raise TypeError(f"hetcomm.{op}: {name} has dtype {dtype}; "
                        f"expected torch.float32, torch.float16 or torch.bfloat16")


def check_float_tensor(op: str, name: str, t: Tensor, device: torch.device) -> None:
    check_supported_dtype(op, name, t.dtype)
    if t.device != device:
        raise RuntimeError(f"hetcomm.{op}: {name} is on {t.device} but the other tensors are on {device}; "
                           f"all tensors of one call must be on one device")
    if not t.is_contiguous():
        raise RuntimeError(f"hetcomm.{op}: {name} is not contiguous (sizes {list(t.shape)}, strides "
                           f"{list(t.stride())}); pass t.contiguous() or a contiguous buffer")


def list_device(op: str, name: str, tensors: Sequence[Tensor]) -> torch.device:
    if len(tensors) == 0:
        raise RuntimeError(f"hetcomm.{op}: {name} is an empty list; expected at least one tensor")
    return tensors[0].device


def check_float_list(op: str, name: str, tensors: Sequence[Tensor], device: torch.device) -> None:
    list_device(op, name, tensors)
    for i, t in enumerate(tensors):
        check_float_tensor(op, f"{name}[{i}]", t, device)


def check_scalar_tensor(op: str, name: str, t: Tensor, device: torch.device) -> None:
    if t.numel() != 1 or t.dtype != torch.float32:
        raise RuntimeError(f"hetcomm.{op}: {name} must be a 1-element torch.float32 tensor; "
                           f"got shape {list(t.shape)} and dtype {t.dtype}")
    if t.device != device:
        raise RuntimeError(f"hetcomm.{op}: {name} is on {t.device} but the data is on {device}; "
                           f"keep it on the data's device (no host round trip)")


def check_flat_buffer(op: str, name: str, flat: Tensor, device: torch.device, expected_numel: int,
                      list_name: str) -> None:
    check_float_tensor(op, name, flat, device)
    if flat.dim() != 1:
        raise RuntimeError(f"hetcomm.{op}: {name} must be 1-D; got shape {list(flat.shape)}")
    if flat.numel() != expected_numel:
        raise RuntimeError(f"hetcomm.{op}: {name} has {flat.numel()} elements but the tensors of {list_name} "
                           f"hold {expected_numel} in all; expected exactly that many")


def check_no_overlap(op: str, regions: Sequence[tuple[str, Tensor, bool]]) -> None:
    """Fails if a written tensor shares bytes with any other tensor of the call.

    ``regions`` are (name, tensor, written) in the order the C++ op lists them; the
    sweep is the C++ one, so the same pair is reported.
    """
    spans = sorted(((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), i)
                    for i, (_, t, _) in enumerate(regions) if t.numel() > 0), key=lambda span: span[0])
    # In address order, remember the earlier interval that reaches furthest, among
    # all and among the written ones: any overlap involving a written tensor shows up
    # against one of those two.
    furthest = furthest_written = None
    for begin, end, index in spans:
        written = regions[index][2]
        clash = None
        if furthest_written is not None and begin < furthest_written[1]:
            clash = furthest_written
        elif written and furthest is not None and begin < furthest[1]:
            clash = furthest
        if clash is not None:
            raise RuntimeError(f"hetcomm.{op}: {regions[clash[2]][0]} and {regions[index][0]} share memory, "
                               f"and at least one of them is written; pass tensors that do not alias")
        if furthest is None or end > furthest[1]:
            furthest = (begin, end, index)
        if written and (furthest_written is None or end > furthest_written[1]):
            furthest_written = (begin, end, index)


def _named(name: str, tensors: Sequence[Tensor], written: bool) -> list[tuple[str, Tensor, bool]]:
    return [(f"{name}[{i}]", t, written) for i, t in enumerate(tensors)]


def check_pack_sources(src: Sequence[Tensor], scale: Tensor) -> int:
    """Validates pack's sources and scale; returns the total element count."""
    device = list_device("pack", "src", src)
    check_float_list("pack", "src", src, device)
    check_scalar_tensor("pack", "scale", scale, device)
    return sum(t.numel() for t in src)


def check_pack(src: Sequence[Tensor], scale: Tensor, out: Tensor, *, aliasing: bool = True) -> None:
    total = check_pack_sources(src, scale)
    check_flat_buffer("pack", "out", out, src[0].device, total, "src")
    if aliasing:
        check_no_overlap("pack", [("scale", scale, False), ("out", out, True)] + _named("src", src, False))


def check_unpack(flat: Tensor, dst: Sequence[Tensor], scale: Tensor, found_inf: Tensor, sq_norm: Tensor | None,
                 *, aliasing: bool = True) -> None:
    device = flat.device
    check_float_list("unpack_", "dst", dst, device)
    check_flat_buffer("unpack_", "flat", flat, device, sum(t.numel() for t in dst), "dst")
    check_scalar_tensor("unpack_", "scale", scale, device)
    check_scalar_tensor("unpack_", "found_inf", found_inf, device)
    regions = [("flat", flat, False), ("scale", scale, False), ("found_inf", found_inf, True)]
    if sq_norm is not None:
        check_scalar_tensor("unpack_", "sq_norm", sq_norm, device)
        regions.append(("sq_norm", sq_norm, True))
    if aliasing:
        check_no_overlap("unpack_", regions + _named("dst", dst, True))


def check_unscale(tensors: Sequence[Tensor], inv_scale: Tensor, found_inf: Tensor, *, aliasing: bool = True) -> None:
    device = list_device("unscale_", "tensors", tensors)
    check_float_list("unscale_", "tensors", tensors, device)
    check_scalar_tensor("unscale_", "inv_scale", inv_scale, device)
    check_scalar_tensor("unscale_", "found_inf", found_inf, device)
    if aliasing:
        check_no_overlap("unscale_", [("inv_scale", inv_scale, False), ("found_inf", found_inf, True)]
                         + _named("tensors", tensors, True))


def check_cast(src: Sequence[Tensor], dst: Sequence[Tensor]) -> None:
    device = list_device("cast_", "src", src)
    check_float_list("cast_", "src", src, device)
    check_float_list("cast_", "dst", dst, device)
    if len(src) != len(dst):
        raise RuntimeError(f"hetcomm.cast_: src has {len(src)} tensors but dst has {len(dst)}; "
                           f"expected lists of equal length")
    for i, (s, d) in enumerate(zip(src, dst)):
        if s.shape != d.shape:
            raise RuntimeError(f"hetcomm.cast_: src[{i}] has shape {list(s.shape)} but dst[{i}] has shape "
                               f"{list(d.shape)}; expected equal shapes")
    check_no_overlap("cast_", _named("src", src, False) + _named("dst", dst, True))


def _check_adamw_hyper(lr: float, beta1: float, beta2: float, eps: float, weight_decay: float) -> None:
    # Formatted with :g, as C++ streams a double.
    if not 0.0 <= lr < math.inf:
        raise RuntimeError(f"hetcomm.adamw_: lr = {lr:g}; expected a finite number >= 0")
    for name, value in (("beta1", beta1), ("beta2", beta2)):
        if not 0.0 <= value < 1.0:
            raise RuntimeError(f"hetcomm.adamw_: {name} = {value:g}; expected 0 <= {name} < 1")
    for name, value in (("eps", eps), ("weight_decay", weight_decay)):
        if not 0.0 <= value < math.inf:
            raise RuntimeError(f"hetcomm.adamw_: {name} = {value:g}; expected a finite number >= 0")


def _check_adamw_state(name: str, tensors: Sequence[Tensor], params: Sequence[Tensor], device: torch.device) -> None:
    if len(tensors) != len(params):
        raise RuntimeError(f"hetcomm.adamw_: {name} has {len(tensors)} tensors but params has {len(params)}; "
                           f"expected one per parameter")
    for i, (t, p) in enumerate(zip(tensors, params)):
        check_float_tensor("adamw_", f"{name}[{i}]", t, device)
        if t.dtype != torch.float32:
            raise TypeError(f"hetcomm.adamw_: {name}[{i}] has dtype {t.dtype}; expected torch.float32")
        if t.numel() != p.numel():
            raise RuntimeError(f"hetcomm.adamw_: {name}[{i}] has {t.numel()} elements but params[{i}] has "
                               f"{p.numel()}; expected as many")


def _check_per_parameter_or_flat(name: str, tensors: Sequence[Tensor], params: Sequence[Tensor], total: int,
                                 device: torch.device) -> None:
    flat = len(tensors) == 1 and len(params) > 1
    if not flat and len(tensors) != len(params):
        raise RuntimeError(f"hetcomm.adamw_: {name} has {len(tensors)} tensors; expected one per parameter "
                           f"({len(params)}) or one flat 1-D buffer of their {total} elements")
    for i, t in enumerate(tensors):
        check_float_tensor("adamw_", f"{name}[{i}]", t, device)
    if flat:
        if tensors[0].dim() != 1:
            raise RuntimeError(f"hetcomm.adamw_: {name}[0], a flat buffer, must be 1-D; got shape "
                               f"{list(tensors[0].shape)}")
        if tensors[0].numel() != total:
            raise RuntimeError(f"hetcomm.adamw_: {name}[0], a flat buffer, has {tensors[0].numel()} elements but "
                               f"params hold {total} in all; expected exactly that many")
        return
    for i, (t, p) in enumerate(zip(tensors, params)):
        if t.numel() != p.numel():
            raise RuntimeError(f"hetcomm.adamw_: {name}[{i}] has {t.numel()} elements but params[{i}] has "
                               f"{p.numel()}; expected as many")


def check_adamw(grads: Sequence[Tensor], params: Sequence[Tensor], exp_avgs: Sequence[Tensor],
                exp_avg_sqs: Sequence[Tensor], copies: Sequence[Tensor], grad_scale: Tensor, found_inf: Tensor,
                step: Tensor, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, *,
                aliasing: bool = True) -> None:
    """adamw_'s checks, in the order of csrc/ops/adamw_plan.cpp."""
    _check_adamw_hyper(lr, beta1, beta2, eps, weight_decay)
    device = list_device("adamw_", "params", params)
    check_float_list("adamw_", "params", params, device)
    for i, p in enumerate(params):
        if p.dtype != torch.float32:
            raise TypeError(f"hetcomm.adamw_: params[{i}] has dtype {p.dtype}; expected torch.float32 (the fp32 "
                            f"master weights)")
    total = sum(p.numel() for p in params)
    _check_adamw_state("exp_avgs", exp_avgs, params, device)
    _check_adamw_state("exp_avg_sqs", exp_avg_sqs, params, device)
    _check_per_parameter_or_flat("grads", grads, params, total, device)
    if len(copies):
        _check_per_parameter_or_flat("copies", copies, params, total, device)
    check_scalar_tensor("adamw_", "grad_scale", grad_scale, device)
    check_scalar_tensor("adamw_", "found_inf", found_inf, device)
    check_scalar_tensor("adamw_", "step", step, device)
    if aliasing:
        check_no_overlap("adamw_", [("grad_scale", grad_scale, False), ("found_inf", found_inf, False),
                                    ("step", step, False)] + _named("grads", grads, False)
                         + _named("params", params, True) + _named("exp_avgs", exp_avgs, True)
                         + _named("exp_avg_sqs", exp_avg_sqs, True) + _named("copies", copies, True))
