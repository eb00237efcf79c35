"""Every op rejects bad arguments with an error that names the argument and says what
was expected, before it writes anything."""

import re

import pytest
import torch
from conftest import scalar

import hetcomm


def f32(*shape):
    return torch.randn(*shape)


def case(name, call, match, exception=RuntimeError):
    return pytest.param(call, match, exception, id=name)


def unpack_args(flat=None, dst=None, scale=None, found_inf=None, sq_norm=None):
    """unpack_ arguments that are valid unless overridden."""
    dst = dst if dst is not None else [torch.zeros(3), torch.zeros(4)]
    flat = flat if flat is not None else f32(7)
    return (flat, dst, scale if scale is not None else scalar(1.0),
            found_inf if found_inf is not None else torch.zeros(1), sq_norm)


def shared_buffer():
    base = torch.zeros(10)
    return base, base[2:6], base[5:9]


CASES = [
    # empty lists
    case("pack-empty", lambda: hetcomm.pack([], scalar(1.0)), r"hetcomm\.pack: src is an empty list"),
    case("unpack-empty", lambda: hetcomm.unpack_(*unpack_args(flat=f32(0), dst=[])),
         r"hetcomm\.unpack_: dst is an empty list"),
    case("unscale-empty", lambda: hetcomm.unscale_([], scalar(1.0), torch.zeros(1)),
         r"hetcomm\.unscale_: tensors is an empty list"),
    case("cast-empty", lambda: hetcomm.cast_([], []), r"hetcomm\.cast_: src is an empty list"),
    # list lengths and sizes that do not match
    case("cast-lengths", lambda: hetcomm.cast_([f32(3), f32(3)], [f32(3)]),
         r"src has 2 tensors but dst has 1"),
    case("cast-shapes", lambda: hetcomm.cast_([f32(3, 2)], [f32(6)]),
         r"src\[0\] has shape \[3, 2\] but dst\[0\] has shape \[6\]"),
    case("unpack-flat-too-long", lambda: hetcomm.unpack_(*unpack_args(flat=f32(8))),
         r"flat has 8 elements but the tensors of dst hold 7 in all"),
    case("unpack-flat-too-short", lambda: hetcomm.unpack_(*unpack_args(flat=f32(6))),
         r"flat has 6 elements but the tensors of dst hold 7 in all"),
    case("unpack-flat-2d", lambda: hetcomm.unpack_(*unpack_args(flat=f32(7, 1))), r"flat must be 1-D"),
    case("pack-out-size", lambda: hetcomm.pack([f32(3), f32(4)], 1.0, out=torch.empty(8, dtype=torch.half)),
         r"hetcomm\.pack: out has 8 elements but the tensors of src hold 7"),
    # dtypes
    case("pack-int-src", lambda: hetcomm.pack([f32(3), torch.ones(3, dtype=torch.int32)], 1.0),
         r"src\[1\] has dtype torch\.int32; expected torch\.float32, torch\.float16 or torch\.bfloat16", TypeError),
    case("pack-double-src", lambda: hetcomm.pack([f32(3).double()], 1.0), r"src\[0\] has dtype torch\.float64",
         TypeError),
    case("pack-int-wire", lambda: hetcomm.pack([f32(3)], 1.0, torch.int8), r"dtype has dtype torch\.int8",
         TypeError),
    case("unpack-double-dst", lambda: hetcomm.unpack_(*unpack_args(dst=[f32(3), f32(4).double()])),
         r"dst\[1\] has dtype torch\.float64", TypeError),
    case("unpack-int-flat", lambda: hetcomm.unpack_(*unpack_args(flat=torch.zeros(7, dtype=torch.int16))),
         r"flat has dtype torch\.int16", TypeError),
    case("cast-int-dst", lambda: hetcomm.cast_([f32(3)], [torch.zeros(3, dtype=torch.int64)]),
         r"dst\[0\] has dtype torch\.int64", TypeError),
    # non-contiguous tensors
    case("pack-transposed", lambda: hetcomm.pack([f32(3), f32(4, 5).t()], 1.0),
         r"src\[1\] is not contiguous \(sizes \[5, 4\], strides \[1, 5\]\)"),
    case("unpack-strided-dst", lambda: hetcomm.unpack_(*unpack_args(dst=[f32(3), f32(8)[::2]])),
         r"dst\[1\] is not contiguous"),
    case("unpack-strided-flat", lambda: hetcomm.unpack_(*unpack_args(flat=f32(14)[::2])),
         r"flat is not contiguous"),
    case("unscale-strided", lambda: hetcomm.unscale_([f32(2, 6)[:, :3]], 1.0, torch.zeros(1)),
         r"tensors\[0\] is not contiguous"),
    # scales and flags
    case("pack-scale-2-elements", lambda: hetcomm.pack([f32(3)], torch.ones(2)),
         r"scale must be a 1-element torch\.float32 tensor; got shape \[2\] and dtype torch\.float32"),
    case("pack-scale-double", lambda: hetcomm.pack([f32(3)], torch.ones(1, dtype=torch.float64)),
         r"scale must be a 1-element torch\.float32 tensor; got shape \[1\] and dtype torch\.float64"),
    case("unpack-found-inf-int", lambda: hetcomm.unpack_(*unpack_args(found_inf=torch.zeros(1, dtype=torch.int32))),
         r"found_inf must be a 1-element torch\.float32 tensor"),
    case("unpack-sq-norm-shape", lambda: hetcomm.unpack_(*unpack_args(sq_norm=torch.zeros(2))),
         r"sq_norm must be a 1-element torch\.float32 tensor"),
    case("unscale-inv-scale-empty", lambda: hetcomm.unscale_([f32(3)], torch.ones(0), torch.zeros(1)),
         r"inv_scale must be a 1-element torch\.float32 tensor; got shape \[0\]"),
    # devices (meta stands in for a second device on machines without a GPU)
    case("pack-mixed-devices", lambda: hetcomm.pack([f32(3), torch.empty(3, device="meta")], scalar(1.0)),
         r"src\[1\] is on meta but the other tensors are on cpu"),
    case("cast-mixed-devices", lambda: hetcomm.cast_([f32(3)], [torch.empty(3, device="meta")]),
         r"dst\[0\] is on meta but the other tensors are on cpu"),
    # aliasing between what is read and what is written
    case("pack-out-aliases-src", lambda: (lambda b: hetcomm.pack([b[0:4]], 1.0, out=b[2:6]))(f32(8)),
         r"out and src\[0\] share memory|src\[0\] and out share memory"),
    case("unpack-flat-aliases-dst", lambda: (lambda b: hetcomm.unpack_(b[0:4], [b[3:7]], 1.0, torch.zeros(1)))(f32(8)),
         r"flat and dst\[0\] share memory|dst\[0\] and flat share memory"),
    case("unpack-dst-overlap", lambda: (lambda b: hetcomm.unpack_(f32(8), [b[1], b[2]], 1.0, torch.zeros(1)))(
        shared_buffer()), r"dst\[0\] and dst\[1\] share memory"),
    case("unpack-found-inf-in-dst", lambda: (lambda d: hetcomm.unpack_(f32(4), [d], 1.0, d[1:2]))(torch.zeros(4)),
         r"share memory"),
    case("unscale-duplicate", lambda: (lambda t: hetcomm.unscale_([t, t], 0.5, torch.zeros(1)))(f32(5)),
         r"tensors\[0\] and tensors\[1\] share memory"),
    case("cast-in-place", lambda: (lambda t: hetcomm.cast_([t], [t]))(f32(5)), r"share memory"),
]


@pytest.mark.parametrize("call, match, exception", CASES)
def test_bad_argument_is_named(call, match, exception):
    with pytest.raises(exception, match=match):
        call()


def test_rejected_unpack_writes_nothing():
    """The bad tensor is last in the list: the good ones before it stay untouched."""
    dst = [torch.full((3,), 7.0), torch.full((4,), 7.0, dtype=torch.float64)]
    found_inf, sq_norm = torch.zeros(1), torch.full((1,), 2.0)
    flat = torch.full((7,), float("inf"))
    with pytest.raises(TypeError, match=re.escape("dst[1] has dtype torch.float64")):
        hetcomm.unpack_(flat, dst, 1.0, found_inf, sq_norm)
    assert torch.equal(dst[0], torch.full((3,), 7.0))
    assert found_inf.item() == 0.0 and sq_norm.item() == 2.0


def test_rejected_unscale_writes_nothing():
    tensors = [torch.full((3,), float("inf")), torch.full((2, 4), 8.0)[:, :2]]
    found_inf = torch.zeros(1)
    with pytest.raises(RuntimeError, match=re.escape("tensors[1] is not contiguous")):
        hetcomm.unscale_(tensors, 0.5, found_inf)
    assert torch.isinf(tensors[0]).all() and found_inf.item() == 0.0


def test_rejected_pack_out_writes_nothing():
    out = torch.full((5,), 3.0, dtype=torch.float16)
    with pytest.raises(RuntimeError, match="share memory"):
        hetcomm.pack([f32(3), out[3:5]], 2.0, out=out)
    assert torch.equal(out, torch.full((5,), 3.0, dtype=torch.float16))


def test_disjoint_views_of_one_buffer_are_fine():
    """Aliasing is judged on bytes, not storages: gradient views of one flat buffer are legal."""
    storage = torch.zeros(10)
    flat = torch.arange(7, dtype=torch.float32)
    hetcomm.unpack_(flat, [storage[0:3], storage[3:7]], 1.0, torch.zeros(1))
    assert torch.equal(storage[:7], flat) and storage[7:].eq(0).all()
