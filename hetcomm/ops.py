"""Typed Python entry points to the hetcomm operators (torch.ops.hetcomm.*).

The device is chosen by PyTorch's dispatcher from the tensors' device; each op
validates its arguments before it writes anything and raises an error that names the
offending argument. Scales are 1-element float32 tensors on the data's device so
that nothing forces a host-device synchronisation; a Python float is accepted for
convenience and turned into such a tensor.

pack, unpack_ and unscale_ have two back ends, chosen per call with ``backend=`` or
for the process with set_backend() (initially $HETCOMM_BACKEND, else "auto"):
"native" is the C++/CUDA kernels (torch.ops.hetcomm), "triton" the Triton kernels
(torch.ops.hetcomm_triton, imported on first use, so hetcomm works without triton),
and "auto" takes native wherever this build has a kernel for the tensors' device and
triton on CUDA tensors where it has none.
"""

import os
from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor

from hetcomm import _extension  # noqa: F401  (loads the library that registers the ops)
from hetcomm import checks

__all__ = ["pack", "unpack_", "unscale_", "cast_", "adamw_", "set_backend", "get_backend", "Backend"]

_ops = torch.ops.hetcomm

Backend = Literal["auto", "native", "triton"]
_BACKENDS = ("auto", "native", "triton")

# Device types with a native kernel, read once from the dispatcher (the C++ library
# registers all ops for a device together). A constant, so torch.compile can trace
# the choice below.
_NATIVE_DEVICE_TYPES = frozenset(key.lower() for key in ("CPU", "CUDA")
                                 if torch._C._dispatch_has_kernel_for_dispatch_key("hetcomm::pack", key))


def _checked_backend(backend: str, name: str) -> str:
    if backend not in _BACKENDS:
        raise ValueError(f"{name} must be 'auto', 'native' or 'triton'; got {backend!r}")
    return backend


_backend: str = _checked_backend(os.environ.get("HETCOMM_BACKEND", "auto"), "HETCOMM_BACKEND")


def set_backend(backend: Backend) -> None:
    """Sets the back end that pack, unpack_ and unscale_ use when a call passes no
    ``backend=``: "auto", "native" or "triton" (see the module docstring)."""
    global _backend
    _backend = _checked_backend(backend, "backend")


def get_backend() -> Backend:
    """The back end set by set_backend() or $HETCOMM_BACKEND ("auto" by default)."""
    return _backend


def _library(op: str, backend: Backend | None, device: torch.device) -> torch._ops._OpNamespace:
    """The op namespace that runs ``op`` on ``device`` for this call."""
    choice = _backend if backend is None else _checked_backend(backend, "backend")
    why = ""
    if choice == "auto":
        choice = "triton" if device.type == "cuda" and "cuda" not in _NATIVE_DEVICE_TYPES else "native"
        why = " (chosen by 'auto': this build of hetcomm has no CUDA kernels)"
    if choice == "native":
        return _ops
    try:
        import hetcomm.triton  # noqa: F401  (registers torch.ops.hetcomm_triton)
    except ImportError as error:
        raise ImportError(f"hetcomm.{op}: the triton back end{why} needs the triton package, which cannot be "
                          f"imported here ({error}); install triton, or use backend='native'") from error
    return torch.ops.hetcomm_triton


def _device(tensors: Sequence[Tensor]) -> torch.device:
    # An empty list has no device: "auto" then takes the native op. Either back end
    # rejects the empty list with an error that names it.
    return tensors[0].device if len(tensors) else torch.device("cpu")


def _scale_tensor(scale: Tensor | float, tensors: Sequence[Tensor]) -> Tensor:
    if isinstance(scale, Tensor):
        return scale
    device = tensors[0].device if len(tensors) else torch.device("cpu")
    return torch.full((1,), float(scale), dtype=torch.float32, device=device)


def pack(src: Sequence[Tensor], scale: Tensor | float = 1.0, dtype: torch.dtype = torch.float16, *,
         out: Tensor | None = None, backend: Backend | None = None) -> Tensor:
    """Concatenates ``src[k].flatten() * scale`` into one flat buffer of ``dtype``.

    One pass over the data: each element is read once, multiplied by ``scale`` in fp32
    and rounded to nearest-even into the buffer.

    Args:
        src: contiguous float32/float16/bfloat16 tensors on one device (dtypes may mix).
        scale: 1-element float32 tensor on that device (or a float), e.g. the rank's
            weight times the loss scale.
        dtype: the buffer's dtype (float32, float16 or bfloat16). Ignored when ``out`` is given.
        out: a preallocated contiguous 1-D buffer with exactly as many elements as
            ``src`` holds; its dtype is the wire dtype.
        backend: "auto", "native" or "triton"; None takes get_backend().

    Returns:
        The buffer (``out`` when given).
    """
    scale = _scale_tensor(scale, src)
    ops = _library("pack", backend, _device(src))
    if out is None:
        return ops.pack.default(list(src), scale, dtype)
    ops.pack.out(list(src), scale, out=out)
    return out


def unpack_(flat: Tensor, dst: Sequence[Tensor], scale: Tensor | float, found_inf: Tensor,
            sq_norm: Tensor | None = None, *, backend: Backend | None = None) -> None:
    """Writes ``flat * scale`` back into ``dst``, checking and measuring on the way.

    ``dst[k] = cast(flat[segment k] * scale)`` with segments laid out in list order.
    In the same pass, ``found_inf`` is set to 1 if any written value is ±inf or NaN (an
    overflow of the destination dtype included); it is never cleared, so one flag can
    collect several calls. When ``sq_norm`` is given, the sum of squares of the written
    values is added to it (accumulated in float64, added in fp32).

    Args:
        flat: contiguous 1-D float32/float16/bfloat16 buffer, numel == sum of dst numels.
        dst: contiguous float32/float16/bfloat16 tensors, written in place.
        scale: 1-element float32 tensor (or a float), e.g. 1 / loss_scale.
        found_inf: 1-element float32 tensor, written in place.
        sq_norm: optional 1-element float32 tensor, accumulated in place.
        backend: "auto", "native" or "triton"; None takes get_backend().
    """
    ops = _library("unpack_", backend, flat.device)
    ops.unpack_.default(flat, list(dst), _scale_tensor(scale, [flat]), found_inf, sq_norm)


def unscale_(tensors: Sequence[Tensor], inv_scale: Tensor | float, found_inf: Tensor, *,
             backend: Backend | None = None) -> None:
    """GradScaler's unscale with its overflow check, in one pass over a tensor list.

    Same semantics as ``torch._amp_foreach_non_finite_check_and_unscale_``: ``found_inf``
    is set to 1 if any input value is non-finite (never cleared), and every tensor is
    multiplied in place by ``inv_scale`` in fp32 math.

    Args:
        tensors: contiguous float32/float16/bfloat16 tensors (dtypes may mix).
        inv_scale: 1-element float32 tensor (or a float).
        found_inf: 1-element float32 tensor, written in place.
        backend: "auto", "native" or "triton"; None takes get_backend().
    """
    ops = _library("unscale_", backend, _device(tensors))
    ops.unscale_.default(list(tensors), _scale_tensor(inv_scale, tensors), found_inf)


def cast_(src: Sequence[Tensor], dst: Sequence[Tensor]) -> None:
    """``dst[k].copy_(src[k])`` for a whole list in one pass, converting between
    float32, float16 and bfloat16 with round-to-nearest-even (bit-exact with ``.to()``).

    Args:
        src: contiguous float tensors.
        dst: contiguous float tensors of the same shapes, written in place.
    """
    _ops.cast_.default(list(src), list(dst))


def adamw_(grads: Sequence[Tensor], params: Sequence[Tensor], exp_avgs: Sequence[Tensor],
           exp_avg_sqs: Sequence[Tensor], copies: Sequence[Tensor] = (), *, grad_scale: Tensor | float = 1.0,
           found_inf: Tensor | None = None, step: Tensor, lr: float, beta1: float = 0.9, beta2: float = 0.999,
           eps: float = 1e-8, weight_decay: float = 1e-2) -> None:
    """One AdamW step (torch.optim.AdamW's update, decoupled weight decay) of fp32 master
    weights in one pass per element: the gradient is read once (any float dtype, times
    ``grad_scale``), the masters and both moments are updated in place, and the masters'
    16-bit copies written, with no fp32 gradient buffer in between.

    Args:
        grads: one gradient per parameter, or one flat 1-D buffer of all their elements
            in list order (the all-reduced wire buffer).
        params: contiguous float32 master weights, updated in place.
        exp_avgs, exp_avg_sqs: their float32 moments (one per parameter), in place.
        copies: nothing, one tensor per parameter, or one flat 1-D buffer (e.g. a view
            into an all-gather buffer), any float dtype: the new masters, rounded to
            nearest-even.
        grad_scale: 1-element float32 tensor (or a float) the gradient is multiplied by
            (1 / loss scale, times a clipping coefficient).
        found_inf: 1-element float32 tensor; when non-zero the step writes nothing.
        step: 1-element float32 tensor on the params' device: the step count after this
            step (>= 1), for the bias corrections; the caller increments it only for steps
            that are not skipped (torch's AdamW state keeps it so too).
        lr, beta1, beta2, eps, weight_decay: as torch.optim.AdamW's.
    """
    found_inf = torch.zeros(1, device=_device(params)) if found_inf is None else found_inf
    _ops.adamw_.default(list(grads), list(params), list(exp_avgs), list(exp_avg_sqs), list(copies),
                        _scale_tensor(grad_scale, params), found_inf, step, float(lr), float(beta1), float(beta2),
                        float(eps), float(weight_decay))


# Fake (meta) kernels: output shapes and the checks that do not need data, so the
# ops trace under torch.compile. The real kernels repeat every check with the data.

def _fake_check_list(op: str, name: str, tensors: Sequence[Tensor], device: torch.device) -> None:
    torch._check(len(tensors) > 0, lambda: f"hetcomm.{op}: {name} is an empty list; expected at least one tensor")
    for i, t in enumerate(tensors):
        torch._check(t.device == device,
                     lambda i=i, t=t: f"hetcomm.{op}: {name}[{i}] is on {t.device} but the other tensors are on "
                                          f"{device}; all tensors of one call must be on one device")


def _fake_check_numel(op: str, name: str, flat: Tensor, tensors: Sequence[Tensor], list_name: str) -> None:
    total = sum(t.numel() for t in tensors)
    torch._check(flat.numel() == total,
                 lambda: f"hetcomm.{op}: {name} has {flat.numel()} elements but the tensors of {list_name} "
                         f"hold {total} in all; expected exactly that many")


@torch.library.register_fake("hetcomm::pack")
def _pack_fake(src, scale, dtype):
    torch._check(len(src) > 0, lambda: "hetcomm.pack: src is an empty list; expected at least one tensor")
    _fake_check_list("pack", "src", src, src[0].device)
    return src[0].new_empty((sum(t.numel() for t in src),), dtype=dtype)


@torch.library.register_fake("hetcomm::pack.out")
def _pack_out_fake(src, scale, *, out):
    _fake_check_list("pack", "src", src, out.device)
    _fake_check_numel("pack", "out", out, src, "src")


@torch.library.register_fake("hetcomm::unpack_")
def _unpack_fake(flat, dst, scale, found_inf, sq_norm=None):
    _fake_check_list("unpack_", "dst", dst, flat.device)
    _fake_check_numel("unpack_", "flat", flat, dst, "dst")


@torch.library.register_fake("hetcomm::unscale_")
def _unscale_fake(tensors, inv_scale, found_inf):
    torch._check(len(tensors) > 0,
                 lambda: "hetcomm.unscale_: tensors is an empty list; expected at least one tensor")
    _fake_check_list("unscale_", "tensors", tensors, found_inf.device)


@torch.library.register_fake("hetcomm::cast_")
def _cast_fake(src, dst):
    torch._check(len(src) > 0, lambda: "hetcomm.cast_: src is an empty list; expected at least one tensor")
    _fake_check_list("cast_", "src", src, src[0].device)
    _fake_check_list("cast_", "dst", dst, src[0].device)
    torch._check(len(src) == len(dst),
                 lambda: f"hetcomm.cast_: src has {len(src)} tensors but dst has {len(dst)}; "
                         f"expected lists of equal length")


@torch.library.register_fake("hetcomm::adamw_")
def _adamw_fake(grads, params, exp_avgs, exp_avg_sqs, copies, grad_scale, found_inf, step, lr, beta1, beta2, eps,
                weight_decay):
    checks.check_adamw(grads, params, exp_avgs, exp_avg_sqs, copies, grad_scale, found_inf, step, lr, beta1,
                       beta2, eps, weight_decay, aliasing=False)
