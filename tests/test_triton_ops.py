"""The Triton back end (hetcomm/triton): the same reference tests as the native ops,
bit for bit, plus back-end selection, errors, and life without triton.

Without a GPU, conftest.py makes Triton run these kernels on CPU tensors in its
interpreter; with one, they run natively on CUDA tensors.
"""

import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import (FLOAT_DTYPES, assert_same_bits, gpt_parameter_shapes, make_tensors, scalar, special_values,
                      torch_unscale_)
from test_bad_input import CASES
from tolerances import UNIT_ROUNDOFF, fp32_squares_run, sq_norm_rtol, sum_rtol
from torch.utils._python_dispatch import TorchDispatchMode

import hetcomm
from hetcomm import ops, reference

pytest.importorskip("triton")
from hetcomm.triton import configs, kernels, multi_tensor  # noqa: E402

DEVICE = "cpu" if kernels.INTERPRETED else "cuda"
if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.skip("triton kernels need a CUDA GPU or TRITON_INTERPRET=1", allow_module_level=True)

# 1 and 8 make tail-only rows; 769 and 5125 make full blocks plus a tail; CHUNK + 5
# cuts a tensor into two rows. Kept moderate: the interpreter is slow.
SIZES = [1, 8, 769, 5125, multi_tensor.CHUNK + 5]

triton_ops = torch.ops.hetcomm_triton

# The interpreter computes with numpy, which warns when a cast overflows to inf (the
# tests make it do so on purpose).
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")


def scale_of(value):
    return scalar(value, DEVICE)


def zeros():
    return torch.zeros(1, device=DEVICE)


# --- pack ----------------------------------------------------------------------------

@pytest.mark.parametrize("wire_dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("src_dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("size", SIZES)
def test_pack_matches_reference(src_dtype, wire_dtype, size):
    src = make_tensors([(size,), (3, size), (0,), (size + 1,)], src_dtype, DEVICE)
    scale = scale_of(0.3125)
    packed = hetcomm.pack(src, scale, wire_dtype, backend="triton")
    assert packed.shape == (5 * size + 1,) and packed.device.type == DEVICE
    assert_same_bits(packed, reference.pack(src, scale, wire_dtype))


@pytest.mark.parametrize("misaligned", [False, True])
@pytest.mark.parametrize("wire_dtype", FLOAT_DTYPES)
def test_pack_gpt_parameter_list(wire_dtype, misaligned):
    src = make_tensors(gpt_parameter_shapes(), torch.float32, DEVICE, misaligned=misaligned)
    scale = scale_of(3 / 24 * 2**16)
    assert_same_bits(hetcomm.pack(src, scale, wire_dtype, backend="triton"), reference.pack(src, scale, wire_dtype))


@pytest.mark.parametrize("wire_dtype", FLOAT_DTYPES)
def test_pack_cast_is_torch_cast(wire_dtype):
    """With scale 1, packing is torch's own .to(): ties, subnormals, overflow, NaN."""
    values = torch.cat([special_values(torch.float32), torch.tensor([float("nan"), float("inf")]),
                        torch.randn(1000) * 1e3]).to(DEVICE)
    assert_same_bits(hetcomm.pack([values], 1.0, wire_dtype, backend="triton"), values.to(wire_dtype))


def test_pack_into_buffer_mixed_dtypes():
    """Three source dtypes: three launches over one row table, into one buffer."""
    src = (make_tensors([(5,), (769,)], torch.float16, DEVICE) + make_tensors([(33,)], torch.bfloat16, DEVICE)
           + make_tensors([(2, 9)], torch.float32, DEVICE))
    out = torch.full((825,), 7.0, dtype=torch.bfloat16, device=DEVICE)
    assert hetcomm.pack(src, scale_of(-2.0), out=out, backend="triton") is out
    assert_same_bits(out, reference.pack(src, scale_of(-2.0), torch.bfloat16))


def test_pack_of_empty_tensors_only():
    packed = hetcomm.pack([torch.empty(0, device=DEVICE), torch.empty(0, 3, device=DEVICE)], 1.0, backend="triton")
    assert packed.shape == (0,) and packed.dtype == torch.float16


# --- unpack_ -------------------------------------------------------------------------

def norm_atol(n, squares, reference_terms=None):
    """How far the Triton unpack_'s sq_norm of n values whose squares sum to `squares`,
    added to an sq_norm of 5, may land from the reference's (reference_terms=0) or from
    the float64 sum (None): each side's rounding of the sum of squares, and the fp32
    addition to 5 relative to 5 + squares."""
    u32 = UNIT_ROUNDOFF[torch.float32]
    ours = sq_norm_rtol(n, fp32_squares_run("triton", DEVICE), additions=0) * squares + u32 * (5 + squares)
    if reference_terms is None:
        theirs = sum_rtol(n, torch.float64) * squares
    else:
        theirs = sq_norm_rtol(n, reference_terms, additions=0) * squares + u32 * (5 + squares)
    return (ours + theirs) * (1 + sum_rtol(n, torch.float64))   # squares, a float64 sum, may fall that short


def unpack_both(flat, shapes, dst_dtype, scale_value, with_norm=True, found_value=0.0):
    """Runs the triton unpack_ and the reference on identical fresh buffers."""
    results = []
    for impl in (lambda *args: hetcomm.unpack_(*args, backend="triton"), reference.unpack_):
        dst = [torch.full(s, -1.0, dtype=dst_dtype, device=DEVICE) for s in shapes]
        found_inf = torch.full((1,), found_value, device=DEVICE)
        sq_norm = torch.full((1,), 5.0, device=DEVICE) if with_norm else None
        impl(flat, dst, scale_of(scale_value), found_inf, sq_norm)
        results.append((dst, found_inf, sq_norm))
    return results


@pytest.mark.parametrize("dst_dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("wire_dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("size", SIZES)
def test_unpack_matches_reference(wire_dtype, dst_dtype, size):
    shapes = [(size,), (0,), (2, size)]
    flat = make_tensors([(3 * size,)], wire_dtype, DEVICE)[0]
    (dst, found, norm), (ref_dst, ref_found, ref_norm) = unpack_both(flat, shapes, dst_dtype, 1 / 1024)
    for got, want in zip(dst, ref_dst):
        assert_same_bits(got, want)
    assert found.item() == ref_found.item() == 0.0
    # fp32 squares summed in fp32 per block, fp64 across blocks, against fp64 throughout;
    # both then added to sq_norm's 5 in fp32.
    squares = sum((t.double() ** 2).sum() for t in ref_dst).item()
    torch.testing.assert_close(norm, ref_norm, rtol=0, atol=norm_atol(3 * size, squares, reference_terms=0))


@pytest.mark.parametrize("misaligned", [False, True])
def test_unpack_gpt_parameter_list(misaligned):
    shapes = gpt_parameter_shapes()
    flat = torch.cat([t.reshape(-1) for t in make_tensors(shapes, torch.float16, DEVICE)])
    if misaligned:
        flat = torch.cat([flat.new_zeros(1), flat])[1:]
    (dst, found, norm), (ref_dst, _, _) = unpack_both(flat, shapes, torch.float32, 2**-16)
    for got, want in zip(dst, ref_dst):
        assert_same_bits(got, want)
    assert found.item() == 0.0
    squares = sum((t.double() ** 2).sum() for t in ref_dst)
    atol = norm_atol(flat.numel(), squares.item())
    torch.testing.assert_close(norm.double().cpu(), (5.0 + squares).reshape(1).cpu(), rtol=0, atol=atol)
    # The bound tells the sum from one that missed the last mlp matrix (under 3% of it).
    missed = 5.0 + squares - (ref_dst[-4].double() ** 2).sum()
    assert (norm.double().cpu() - missed.cpu()).abs().item() > 10 * atol


@pytest.mark.parametrize("bad_value", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("position", [0, 5, 4999])
def test_unpack_flags_nonfinite_anywhere(bad_value, position):
    flat = torch.randn(5000, device=DEVICE).half()
    flat[position] = bad_value
    (dst, found, _), (ref_dst, ref_found, _) = unpack_both(flat, [(10,), (4990,)], torch.bfloat16, 0.5)
    assert found.item() == ref_found.item() == 1.0
    for got, want in zip(dst, ref_dst):
        assert_same_bits(got, want)


@pytest.mark.parametrize("dst_dtype", [torch.float16, torch.bfloat16])
def test_unpack_flags_overflow_of_destination_dtype(dst_dtype):
    """A finite wire value that overflows the destination after scaling is caught as
    it is written."""
    big = 40000.0 if dst_dtype == torch.float16 else 3e38
    flat = torch.tensor([1.0, 2.0, big], device=DEVICE)
    (dst, found, _), (ref_dst, _, _) = unpack_both(flat, [(3,)], dst_dtype, 2.0)
    assert found.item() == 1.0 and dst[0][2].item() == float("inf")
    assert_same_bits(dst[0], ref_dst[0])


def test_unpack_never_clears_found_inf_and_accumulates_norm():
    (dst, found, norm), _ = unpack_both(torch.ones(10, device=DEVICE), [(10,)], torch.float32, 3.0, found_value=1.0)
    assert found.item() == 1.0
    assert norm.item() == 5.0 + 10 * 9.0
    (_, found, _), _ = unpack_both(torch.ones(10, device=DEVICE), [(10,)], torch.float32, 3.0, with_norm=False)
    assert found.item() == 0.0


def test_unpack_sum_of_squares_is_the_same_every_run():
    flat = make_tensors([(3 * multi_tensor.CHUNK + 11,)], torch.bfloat16, DEVICE, seed=5)[0]
    shapes = [(multi_tensor.CHUNK * 2 + 3,), (multi_tensor.CHUNK + 8,)]
    norms = [unpack_both(flat, shapes, torch.float32, 0.1)[0][2] for _ in range(3)]
    assert torch.equal(norms[0], norms[1]) and torch.equal(norms[0], norms[2])


# --- unscale_ ------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("size", SIZES)
def test_unscale_matches_reference_and_torch(dtype, size):
    tensors = make_tensors([(size,), (0,), (size, 3)], dtype, DEVICE)
    expected = [t.clone() for t in tensors]
    torch_result = [t.clone() for t in tensors]
    found, ref_found, torch_found = zeros(), zeros(), zeros()
    inv_scale = scale_of(2**-13)
    hetcomm.unscale_(tensors, inv_scale, found, backend="triton")
    reference.unscale_(expected, inv_scale, ref_found)
    torch_unscale_(torch_result, torch_found, inv_scale)
    for got, want, theirs in zip(tensors, expected, torch_result):
        assert_same_bits(got, want)
        assert_same_bits(got, theirs)
    assert found.item() == ref_found.item() == torch_found.item() == 0.0


def test_unscale_mixed_dtypes_gpt_list():
    tensors = [t.to(FLOAT_DTYPES[i % 3]) for i, t in enumerate(make_tensors(gpt_parameter_shapes(), torch.float32,
                                                                           DEVICE, misaligned=True))]
    expected = [t.clone() for t in tensors]
    found, ref_found = zeros(), zeros()
    hetcomm.unscale_(tensors, 1 / 3, found, backend="triton")
    reference.unscale_(expected, scale_of(1 / 3), ref_found)
    for got, want in zip(tensors, expected):
        assert_same_bits(got, want)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("bad_value", [float("inf"), float("-inf"), float("nan")])
def test_unscale_flags_nonfinite_input(dtype, bad_value):
    tensors = make_tensors([(100,), (6000,)], dtype, DEVICE)
    tensors[1][5999] = bad_value
    torch_result = [t.clone() for t in tensors]
    found, torch_found = zeros(), zeros()
    hetcomm.unscale_(tensors, 0.5, found, backend="triton")
    torch_unscale_(torch_result, torch_found, scale_of(0.5))
    assert found.item() == torch_found.item() == 1.0
    for got, theirs in zip(tensors, torch_result):
        assert_same_bits(got, theirs)


def test_unscale_checks_inputs_not_outputs():
    """GradScaler's rule: a finite input that overflows once scaled is not flagged."""
    tensors = [torch.tensor([1.0, 40000.0], device=DEVICE).half()]
    found = zeros()
    hetcomm.unscale_(tensors, 2.0, found, backend="triton")
    assert tensors[0][1].item() == float("inf") and found.item() == 0.0


# --- every launch shape --------------------------------------------------------------

@pytest.mark.parametrize("config", configs.CONFIGS, ids=lambda c: f"block{c.kwargs['BLOCK']}-warps{c.num_warps}")
def test_every_config_gives_the_reference(monkeypatch, config):
    """Each shape the autotuner or a GPU generation may pick, on the three ops."""
    monkeypatch.setattr(configs, "default_config", lambda device: config)
    shapes = [(3,), (config.kwargs["BLOCK"],), (config.kwargs["BLOCK"] + 1,), (2, 1000)]
    src = make_tensors(shapes, torch.float32, DEVICE, seed=1)
    packed = hetcomm.pack(src, scale_of(0.75), torch.bfloat16, backend="triton")
    assert_same_bits(packed, reference.pack(src, scale_of(0.75), torch.bfloat16))
    (dst, _, norm), (ref_dst, _, ref_norm) = unpack_both(packed, shapes, torch.float16, 3.0)
    for got, want in zip(dst, ref_dst):
        assert_same_bits(got, want)
    squares = sum((t.double() ** 2).sum() for t in ref_dst).item()
    torch.testing.assert_close(norm, ref_norm, rtol=0, atol=norm_atol(sum(t.numel() for t in dst), squares,
                                                                      reference_terms=0))
    expected = [t.clone() for t in dst]
    hetcomm.unscale_(dst, 0.125, zeros(), backend="triton")
    reference.unscale_(expected, scale_of(0.125), zeros())
    for got, want in zip(dst, expected):
        assert_same_bits(got, want)


# --- registration: opcheck and torch.compile -----------------------------------------

def test_opcheck():
    src = make_tensors([(3, 5), (769,), (0,)], torch.float32, DEVICE)
    scale = scale_of(0.5)
    torch.library.opcheck(triton_ops.pack.default, (src, scale, torch.float16))
    torch.library.opcheck(triton_ops.pack.out, (src, scale, torch.empty(784, dtype=torch.bfloat16, device=DEVICE)))
    flat = torch.randn(784, device=DEVICE).bfloat16()
    torch.library.opcheck(triton_ops.unpack_.default, (flat, src, scale, zeros(), zeros()))
    torch.library.opcheck(triton_ops.unpack_.default, (flat, src, scale, zeros()))
    torch.library.opcheck(triton_ops.unscale_.default, (src, scale, zeros()))


def test_compiled_fullgraph_matches_eager():
    def step(grads, found_inf, sq_norm):
        flat = hetcomm.pack(grads, scale_of(1024.0), torch.float16, backend="triton")
        hetcomm.unpack_(flat, grads, scale_of(1 / 1024), found_inf, sq_norm, backend="triton")
        hetcomm.unscale_(grads, scale_of(0.5), found_inf, backend="triton")

    results = []
    for fn in (step, torch.compile(step, fullgraph=True, backend="aot_eager")):
        grads, found_inf, sq_norm = make_tensors([(5, 3), (769,)], torch.float32, DEVICE, seed=3), zeros(), zeros()
        fn(grads, found_inf, sq_norm)
        results.append(grads + [found_inf, sq_norm])
    for got, want in zip(*results):
        assert torch.equal(got, want)


# --- back-end selection --------------------------------------------------------------

class OpsCalled(TorchDispatchMode):
    """Records the operators that run."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.name())
        return func(*args, **(kwargs or {}))


def namespaces_used(call) -> set[str]:
    with OpsCalled() as called:
        call()
    return {name.split("::")[0] for name in called.names if name.startswith("hetcomm")}


def three_calls(**backend):
    src = [torch.randn(5, device=DEVICE)]
    hetcomm.pack(src, 2.0, **backend)
    hetcomm.unpack_(torch.ones(5, device=DEVICE), src, 0.5, zeros(), zeros(), **backend)
    hetcomm.unscale_(src, 0.5, zeros(), **backend)


@pytest.fixture
def restore_backend():
    previous = hetcomm.get_backend()
    yield
    hetcomm.set_backend(previous)


def test_backend_per_call():
    assert namespaces_used(lambda: three_calls(backend="triton")) == {"hetcomm_triton"}
    if DEVICE == "cpu":
        assert namespaces_used(lambda: three_calls(backend="native")) == {"hetcomm"}


def test_backend_setting(restore_backend):
    hetcomm.set_backend("triton")
    assert hetcomm.get_backend() == "triton"
    assert namespaces_used(three_calls) == {"hetcomm_triton"}
    if DEVICE == "cpu":
        assert namespaces_used(lambda: three_calls(backend="auto")) == {"hetcomm"}  # a call's choice wins
    with pytest.raises(ValueError, match=r"backend must be 'auto', 'native' or 'triton'; got 'cuda'"):
        hetcomm.set_backend("cuda")
    assert hetcomm.get_backend() == "triton"


def test_bad_backend_argument():
    with pytest.raises(ValueError, match=r"backend must be 'auto', 'native' or 'triton'; got 'Triton'"):
        hetcomm.unscale_([torch.ones(2, device=DEVICE)], 0.5, zeros(), backend="Triton")


@pytest.mark.parametrize("native_devices, expected", [({"cpu"}, "hetcomm_triton"), ({"cpu", "cuda"}, "hetcomm")])
def test_auto_takes_triton_on_cuda_only_without_native_cuda_kernels(monkeypatch, native_devices, expected):
    monkeypatch.setattr(ops, "_NATIVE_DEVICE_TYPES", frozenset(native_devices))
    assert ops._library("pack", "auto", torch.device("cuda", 0)) is getattr(torch.ops, expected)
    assert ops._library("pack", "auto", torch.device("cpu")) is torch.ops.hetcomm


def test_auto_matches_what_the_dispatcher_has():
    has_cuda = torch._C._dispatch_has_kernel_for_dispatch_key("hetcomm::unpack_", "CUDA")
    expected = torch.ops.hetcomm if has_cuda else torch.ops.hetcomm_triton
    assert ops._library("unpack_", "auto", torch.device("cuda", 0)) is expected


def run_python(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=dict(os.environ, **env))


def test_backend_from_environment():
    result = run_python("import hetcomm; print(hetcomm.get_backend(), hetcomm.info()['backend'])",
                        HETCOMM_BACKEND="triton")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["triton", "triton"]
    result = run_python("import hetcomm", HETCOMM_BACKEND="gpu")
    assert result.returncode != 0
    assert "HETCOMM_BACKEND must be 'auto', 'native' or 'triton'; got 'gpu'" in result.stderr


# --- errors --------------------------------------------------------------------------

@pytest.mark.parametrize("call, match, exception", CASES)
def test_bad_argument_is_named_as_by_the_native_ops(restore_backend, call, match, exception):
    """Every case of test_bad_input.py, with the triton back end as the default."""
    hetcomm.set_backend("triton")
    with pytest.raises(exception, match=match):
        call()


def test_rejected_calls_write_nothing():
    dst = [torch.full((3,), 7.0), torch.full((4,), 7.0, dtype=torch.float64)]
    found_inf, sq_norm = torch.zeros(1), torch.full((1,), 2.0)
    with pytest.raises(TypeError, match=re.escape("dst[1] has dtype torch.float64")):
        triton_ops.unpack_(torch.full((7,), float("inf")), dst, scalar(1.0), found_inf, sq_norm)
    assert torch.equal(dst[0], torch.full((3,), 7.0)) and found_inf.item() == 0.0 and sq_norm.item() == 2.0
    tensors = [torch.full((3,), float("inf")), torch.full((2, 4), 8.0)[:, :2]]
    with pytest.raises(RuntimeError, match=re.escape("tensors[1] is not contiguous")):
        triton_ops.unscale_(tensors, scalar(0.5), found_inf)
    assert torch.isinf(tensors[0]).all() and found_inf.item() == 0.0
    out = torch.full((5,), 3.0, dtype=torch.float16)
    with pytest.raises(RuntimeError, match="share memory"):
        triton_ops.pack.out([torch.randn(3), out[3:5]], scalar(2.0), out)
    assert torch.equal(out, torch.full((5,), 3.0, dtype=torch.float16))


def test_gpu_too_old_for_triton_is_named(monkeypatch):
    monkeypatch.setattr(kernels, "INTERPRETED", False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (6, 1))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA GeForce GTX 1080 Ti")
    with pytest.raises(RuntimeError, match=re.escape("hetcomm.unpack_: the triton back end needs a GPU of compute "
                                                     "capability 7.0 or newer (Triton's minimum), but cuda:0 is a "
                                                     "NVIDIA GeForce GTX 1080 Ti (sm_61); use backend='native'")):
        multi_tensor.check_device("unpack_", torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (7, 0))
    multi_tensor.check_device("unpack_", torch.device("cuda", 0))  # Volta and newer run it, bf16 included
    with pytest.raises(RuntimeError, match=r"hetcomm\.pack: the triton back end runs on CUDA tensors"):
        multi_tensor.check_device("pack", torch.device("cpu"))


# --- without triton, and on GPU targets --------------------------------------------

def test_hetcomm_works_without_triton():
    result = run_python("""
        import sys
        sys.modules["triton"] = None  # makes `import triton` fail, as if it were not installed
        import torch, hetcomm
        assert hetcomm.info()["backends"]["triton"] == {"importable": False}
        grads = [torch.randn(7), torch.randn(3, 3)]
        flat = hetcomm.pack(grads, 2.0, torch.bfloat16)
        found_inf, sq_norm = torch.zeros(1), torch.zeros(1)
        hetcomm.unpack_(flat, grads, 0.5, found_inf, sq_norm)
        hetcomm.unscale_(grads, 0.5, found_inf)
        hetcomm.set_backend("triton")
        try:
            hetcomm.unscale_(grads, 0.5, found_inf)
        except ImportError as error:
            print(error)
    """)
    assert result.returncode == 0, result.stderr
    assert ("hetcomm.unscale_: the triton back end needs the triton package, which cannot be imported here"
            in result.stdout)


def test_kernels_compile_for_volta_turing_and_ampere():
    """Triton's code generation, no GPU needed: every dtype pair, bf16 included below
    sm_80, and 16-byte vector accesses on the aligned path."""
    result = run_python("""
        import itertools
        import triton, triton.language as tl
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from hetcomm.triton import kernels
        assert not kernels.INTERPRETED
        signature = {"table": "*i64", "first_row": "i32", "scale_ptr": "*fp32", "found_inf_ptr": "*fp32",
                     "partials_ptr": "*fp64", "size_class": "i32", **dict.fromkeys(
                         ["SRC", "DST", "ALIGNED", "CHECK_INPUT", "CHECK_OUTPUT", "SUM_SQ", "BLOCK"], "constexpr")}
        dtypes = [tl.float32, tl.float16, tl.bfloat16]
        for capability, (src, dst) in zip(itertools.cycle([70, 75, 80]), itertools.product(dtypes, dtypes)):
            constants = dict(SRC=src, DST=dst, ALIGNED=True, CHECK_INPUT=False, CHECK_OUTPUT=True, SUM_SQ=True,
                             BLOCK=1024)
            compiled = triton.compile(ASTSource(kernels.scale_cast_rows, signature, constants),
                                      target=GPUTarget("cuda", capability, 32), options={"num_warps": 2})
            assert "ld.global.v4.b32" in compiled.asm["ptx"], (capability, src, dst)
        triton.compile(ASTSource(kernels.add_sum, {"partials_ptr": "*fp64", "count": "i32", "sq_norm_ptr": "*fp32",
                                                   "BLOCK": "constexpr"}, {"BLOCK": 1024}),
                       target=GPUTarget("cuda", 70, 32))
    """, TRITON_INTERPRET="0")
    assert result.returncode == 0, result.stderr[-3000:]
