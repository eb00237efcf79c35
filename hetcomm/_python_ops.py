"""The hetcomm operators defined in Python, for a pure-Python install (no hetcomm._C).

The schemas are those of csrc/ops/schemas.cpp, so torch.ops.hetcomm.* has the same
signatures in both installs and the fake kernels of hetcomm.ops serve both. pack,
pack.out, unpack_ and unscale_ get a CPU kernel only: hetcomm.ops then finds no native
CUDA kernel, and "auto" sends CUDA tensors to the Triton back end. cast_ has no Triton
kernel, so it gets one kernel for every device; so does adamw_. Each kernel validates its arguments
as the C++ ops do, before it writes anything, then runs the reference computation
(hetcomm.reference): the same bits as the fused kernels, in several passes.

Other calls (CUDA tensors with backend="native", say) reach the fallbacks that
csrc/ops/no_kernel.cpp registers in a compiled build, here with the same checks and
error; so do the private _set_launch_shape and _clear_launch_shape, which have no CUDA
kernels to shape here.
"""

import torch

from hetcomm import checks, reference

# Kept for the life of the process: the ops are unregistered when it is destroyed.
_lib = torch.library.Library("hetcomm", "DEF")
_lib.define("pack(Tensor[] src, Tensor scale, ScalarType dtype) -> Tensor")
_lib.define("pack.out(Tensor[] src, Tensor scale, *, Tensor(a!) out) -> ()")
_lib.define("unpack_(Tensor flat, Tensor(a!)[] dst, Tensor scale, Tensor(b!) found_inf, "
            "Tensor(c!)? sq_norm=None) -> ()")
_lib.define("unscale_(Tensor(a!)[] tensors, Tensor inv_scale, Tensor(b!) found_inf) -> ()")
_lib.define("cast_(Tensor[] src, Tensor(a!)[] dst) -> ()")
_lib.define("adamw_(Tensor[] grads, Tensor(a!)[] params, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "
            "Tensor(d!)[] copies, Tensor grad_scale, Tensor found_inf, Tensor step, float lr, float beta1, "
            "float beta2, float eps, float weight_decay) -> ()")
_lib.define("_set_launch_shape(int blocks_per_sm, int items_per_thread) -> ()")
_lib.define("_clear_launch_shape() -> ()")


def _pack(src, scale, dtype):
    checks.check_pack_sources(src, scale)
    checks.check_supported_dtype("pack", "dtype", dtype)
    return reference.pack(src, scale, dtype)


def _pack_out(src, scale, *, out):
    checks.check_pack(src, scale, out)
    out.copy_(reference.pack(src, scale, out.dtype))


def _unpack(flat, dst, scale, found_inf, sq_norm=None):
    checks.check_unpack(flat, dst, scale, found_inf, sq_norm)
    reference.unpack_(flat, dst, scale, found_inf, sq_norm)


def _unscale(tensors, inv_scale, found_inf):
    checks.check_unscale(tensors, inv_scale, found_inf)
    reference.unscale_(tensors, inv_scale, found_inf)


def _cast(src, dst):
    checks.check_cast(src, dst)
    reference.cast_(src, dst)


def _adamw(grads, params, exp_avgs, exp_avg_sqs, copies, grad_scale, found_inf, step, lr, beta1, beta2, eps,
           weight_decay):
    checks.check_adamw(grads, params, exp_avgs, exp_avg_sqs, copies, grad_scale, found_inf, step, lr, beta1, beta2,
                       eps, weight_decay)
    reference.adamw_(grads, params, exp_avgs, exp_avg_sqs, copies, grad_scale, found_inf, step, lr, beta1, beta2,
                     eps, weight_decay)


def _no_kernel(op, device):
    raise NotImplementedError(f"hetcomm.{op}: this build of hetcomm has no kernel for {device.type} tensors; "
                              f"hetcomm.info() lists the kernels it has")


def _pack_no_kernel(src, scale, dtype):
    checks.check_pack_sources(src, scale)
    _no_kernel("pack", src[0].device)


def _pack_out_no_kernel(src, scale, *, out):
    checks.check_pack(src, scale, out)
    _no_kernel("pack", out.device)


def _unpack_no_kernel(flat, dst, scale, found_inf, sq_norm=None):
    checks.check_unpack(flat, dst, scale, found_inf, sq_norm)
    _no_kernel("unpack_", flat.device)


def _unscale_no_kernel(tensors, inv_scale, found_inf):
    checks.check_unscale(tensors, inv_scale, found_inf)
    _no_kernel("unscale_", found_inf.device)


def _no_cuda_kernels(op):
    raise NotImplementedError(f"hetcomm.{op}: this build of hetcomm has no CUDA kernels, whose launch shape it "
                              f"sets; hetcomm.info() lists the kernels it has")


# op: its CPU kernel, and the fallback for any other device.
_KERNELS = {
    "pack": (_pack, _pack_no_kernel),
    "pack.out": (_pack_out, _pack_out_no_kernel),
    "unpack_": (_unpack, _unpack_no_kernel),
    "unscale_": (_unscale, _unscale_no_kernel),
}
for _op, (_kernel, _fallback) in _KERNELS.items():
    _lib.impl(_op, _kernel, "CPU")
    _lib.impl(_op, _fallback, "CompositeExplicitAutograd")
_lib.impl("cast_", _cast, "CompositeExplicitAutograd")
_lib.impl("adamw_", _adamw, "CompositeExplicitAutograd")
_lib.impl("_set_launch_shape", lambda blocks_per_sm, items_per_thread: _no_cuda_kernels("_set_launch_shape"),
          "CompositeExplicitAutograd")
_lib.impl("_clear_launch_shape", lambda: _no_cuda_kernels("_clear_launch_shape"), "CompositeExplicitAutograd")
