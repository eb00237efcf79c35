"""What is specific to the CUDA kernels: long lists, launch counts, alignment, device
mixing, determinism of the sum of squares, CUDA-graph capture. The reference tests of
each op run on CUDA as the "cuda" parametrizations of test_pack/unpack/unscale/cast."""

import math

import pytest
import torch
from conftest import FLOAT_DTYPES, assert_same_bits, make_tensors, scalar
from torch.autograd import DeviceType

from hetcomm import reference

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

ops = torch.ops.hetcomm
SEGMENTS_PER_LAUNCH = 160  # kMaxSegments in csrc/kernels/launch_args.h
CHUNK = 8192               # kChunk in csrc/kernels/launch_args.h

# 1,200 tensors of uneven sizes, some empty, some straddling chunk boundaries.
MANY_SHAPES = [((i * 37) % 3001,) for i in range(1190)] + [(CHUNK + 1,), (3 * CHUNK - 1,)] * 5


def hetcomm_launches(run) -> int:
    """The number of hetcomm kernels `run` launches, counted by the profiler."""
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == DeviceType.CUDA
               and ("multi_tensor_kernel" in e.name or "add_sum_of_squares_kernel" in e.name))


def test_pack_and_unpack_a_list_of_1200_tensors():
    src = make_tensors(MANY_SHAPES, torch.float32, "cuda")
    scale, inv_scale = scalar(2.0**12, "cuda"), scalar(2.0**-12, "cuda")
    wire = ops.pack(src, scale, torch.bfloat16)
    assert_same_bits(wire, reference.pack(src, scale, torch.bfloat16))

    dst = [torch.empty_like(t) for t in src]
    expected = [torch.empty_like(t) for t in src]
    found, norm = torch.zeros(1, device="cuda"), torch.zeros(1, device="cuda")
    ref_found, ref_norm = torch.zeros(1, device="cuda"), torch.zeros(1, device="cuda")
    ops.unpack_(wire, dst, inv_scale, found, norm)
    reference.unpack_(wire, expected, inv_scale, ref_found, ref_norm)
    for got, want in zip(dst, expected):
        assert_same_bits(got, want)
    assert found.item() == 0.0
    torch.testing.assert_close(norm, ref_norm, rtol=1e-6, atol=0)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_unscale_and_cast_a_list_of_1200_tensors(dtype):
    tensors = make_tensors(MANY_SHAPES, dtype, "cuda")
    theirs = [t.clone() for t in tensors]
    tensors[-1][-1] = float("inf")  # in the last launch, last chunk
    theirs[-1][-1] = float("inf")
    found, their_found = torch.zeros(1, device="cuda"), torch.zeros(1, device="cuda")
    ops.unscale_(tensors, scalar(0.125, "cuda"), found)
    torch._amp_foreach_non_finite_check_and_unscale_(theirs, their_found, scalar(0.125, "cuda"))
    assert found.item() == their_found.item() == 1.0
    for got, want in zip(tensors, theirs):
        assert_same_bits(got, want)

    dst = [torch.empty_like(t, dtype=torch.float16) for t in tensors]
    ops.cast_(tensors, dst)
    for s, d in zip(tensors, dst):
        assert_same_bits(d, s.to(torch.float16))


def test_a_handful_of_launches_per_list():
    src = make_tensors([(1000 + i,) for i in range(1000)], torch.float32, "cuda")
    scale = scalar(0.5, "cuda")
    wire = torch.empty(sum(t.numel() for t in src), dtype=torch.float16, device="cuda")
    per_list = math.ceil(len(src) / SEGMENTS_PER_LAUNCH)  # 7
    assert hetcomm_launches(lambda: ops.pack.out(src, scale, out=wire)) == per_list
    found, norm = torch.zeros(1, device="cuda"), torch.zeros(1, device="cuda")
    assert hetcomm_launches(lambda: ops.unpack_(wire, src, scale, found, norm)) == per_list + 1
    assert hetcomm_launches(lambda: ops.unpack_(wire, src, scale, found)) == per_list
    assert hetcomm_launches(lambda: ops.unscale_(src, scale, found)) == per_list
    assert hetcomm_launches(lambda: ops.cast_(src, [t.half() for t in src])) == per_list


def test_one_launch_per_dtype_pair_for_large_tensors():
    """64M elements (256 MB of fp32) over 100 tensors: one launch; mixed source dtypes: one per pair."""
    src = [torch.ones(640_000, device="cuda") for _ in range(100)]
    assert hetcomm_launches(lambda: ops.pack(src, scalar(1.0, "cuda"), torch.float16)) == 1
    mixed = src[:50] + [t.half() for t in src[50:60]] + [t.bfloat16() for t in src[60:]]
    assert hetcomm_launches(lambda: ops.pack(mixed, scalar(1.0, "cuda"), torch.float16)) == 3


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_misaligned_views_every_op(dtype):
    """Views starting at element 1 take the element-wise path; results are the same bits."""
    shapes = [(1,), (7,), (CHUNK + 3,), (769, 3)]
    src = make_tensors(shapes, dtype, "cuda", misaligned=True)
    assert all(t.data_ptr() % 16 != 0 for t in src)
    scale = scalar(3.0, "cuda")
    assert_same_bits(ops.pack(src, scale, torch.float16), reference.pack(src, scale, torch.float16))

    dst = [torch.empty(t.numel() + 1, dtype=torch.bfloat16, device="cuda")[1:].view(t.shape) for t in src]
    ops.cast_(src, dst)
    for s, d in zip(src, dst):
        assert_same_bits(d, s.to(torch.bfloat16))

    theirs = [t.clone() for t in src]
    found, their_found = torch.zeros(1, device="cuda"), torch.zeros(1, device="cuda")
    ops.unscale_(src, scale, found)
    torch._amp_foreach_non_finite_check_and_unscale_(theirs, their_found, scale)
    for got, want in zip(src, theirs):
        assert_same_bits(got, want)


def test_sum_of_squares_is_deterministic_and_independent_of_alignment():
    """The same bits on every run, and whether or not the data is 16-byte aligned: the
    element-to-thread mapping and so every rounding depend only on the dtype pair."""
    shapes = [(1 + (i * 7919) % 50_000,) for i in range(300)]
    values = torch.cat([t.reshape(-1) for t in make_tensors(shapes, torch.float32, "cuda", seed=3)])
    aligned = values.half()
    misaligned = torch.cat([aligned.new_zeros(1), aligned])[1:]
    norms = []
    for flat in (aligned, aligned, misaligned):
        dst = [torch.empty(s, device="cuda") for s in shapes]
        found, norm = torch.zeros(1, device="cuda"), torch.zeros(1, device="cuda")
        ops.unpack_(flat, dst, scalar(0.01, "cuda"), found, norm)
        norms.append(norm)
    assert torch.equal(norms[0], norms[1]) and torch.equal(norms[0], norms[2])
    exact = ((aligned.float() * scalar(0.01, "cuda")).double() ** 2).sum()
    torch.testing.assert_close(norms[0].double(), exact.reshape(1), rtol=1e-6, atol=0)


def test_empty_tensors_write_nothing():
    empty = [torch.empty(0, device="cuda"), torch.empty(0, 3, device="cuda", dtype=torch.float16)]
    packed = ops.pack(empty, scalar(1.0, "cuda"), torch.bfloat16)
    assert packed.shape == (0,) and packed.device.type == "cuda"
    found, norm = torch.full((1,), 0.0, device="cuda"), torch.full((1,), 5.0, device="cuda")
    assert hetcomm_launches(lambda: ops.unpack_(packed, empty, scalar(1.0, "cuda"), found, norm)) == 0
    ops.unscale_(empty, scalar(2.0, "cuda"), found)
    ops.cast_(empty, [torch.empty(0, device="cuda", dtype=torch.bfloat16), torch.empty(0, 3, device="cuda")])
    assert found.item() == 0.0 and norm.item() == 5.0


def _mixed_device_calls():
    cuda = make_tensors([(5,), (7,)], torch.float32, "cuda")
    cpu = make_tensors([(7,)], torch.float32, "cpu")
    one, one_cpu = scalar(1.0, "cuda"), scalar(1.0, "cpu")
    flag, flag_cpu = torch.zeros(1, device="cuda"), torch.zeros(1)
    wire = torch.empty(12, device="cuda")
    return [
        (lambda: ops.pack(cuda, one_cpu, torch.float16),
         r"hetcomm\.pack: scale is on cpu but the data is on cuda:0"),
        (lambda: ops.pack([cuda[0], cpu[0]], one, torch.float16),
         r"hetcomm\.pack: src\[1\] is on cpu but the other tensors are on cuda:0"),
        (lambda: ops.pack.out(cuda, one, out=torch.empty(12)),
         r"hetcomm\.pack: out is on cpu but the other tensors are on cuda:0"),
        (lambda: ops.unpack_(wire, cuda, one, flag_cpu),
         r"hetcomm\.unpack_: found_inf is on cpu but the data is on cuda:0"),
        (lambda: ops.unpack_(wire, cuda, one, flag, torch.zeros(1)),
         r"hetcomm\.unpack_: sq_norm is on cpu but the data is on cuda:0"),
        (lambda: ops.unpack_(wire.cpu(), cuda, one_cpu, flag_cpu),
         r"hetcomm\.unpack_: dst\[0\] is on cuda:0 but the other tensors are on cpu"),
        (lambda: ops.unscale_(cuda, one_cpu, flag),
         r"hetcomm\.unscale_: inv_scale is on cpu but the data is on cuda:0"),
        (lambda: ops.cast_(cuda[:1], cpu),
         r"hetcomm\.cast_: dst\[0\] is on cpu but the other tensors are on cuda:0"),
    ]


@pytest.mark.parametrize("case", range(8))
def test_mixed_devices_are_rejected_by_name(case):
    call, message = _mixed_device_calls()[case]
    with pytest.raises(RuntimeError, match=message):
        call()


def test_mixed_dtype_list_opcheck():
    src = make_tensors([(3, 5)], torch.float32, "cuda") + make_tensors([(769,)], torch.bfloat16, "cuda")
    flat = torch.randn(784, device="cuda").half()
    found, norm = torch.zeros(1, device="cuda"), torch.zeros(1, device="cuda")
    torch.library.opcheck(ops.pack.default, (src, scalar(0.5, "cuda"), torch.float16))
    torch.library.opcheck(ops.unpack_.default, (flat, src, scalar(0.5, "cuda"), found, norm))
    torch.library.opcheck(ops.unscale_.default, (src, scalar(0.5, "cuda"), found))


def test_pack_unpack_captured_in_a_cuda_graph():
    """Capture fails on any host synchronisation; replays must see new values."""
    src = make_tensors([(1000 + 13 * i,) for i in range(200)], torch.float32, "cuda")
    wire = torch.empty(sum(t.numel() for t in src), dtype=torch.float16, device="cuda")
    dst = [torch.empty_like(t) for t in src]
    scale, inv_scale = scalar(2.0**8, "cuda"), scalar(2.0**-8, "cuda")
    found, norm = torch.zeros(1, device="cuda"), torch.zeros(1, device="cuda")

    def step():
        ops.pack.out(src, scale, out=wire)
        ops.unpack_(wire, dst, inv_scale, found, norm)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up outside the capture, as CUDA graphs require
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()

    for t in src:
        t.mul_(-3.0)
    src[7][5] = 1e6  # overflows fp16 on the wire
    found.zero_()
    norm.zero_()
    graph.replay()
    expected = [torch.empty_like(t) for t in src]
    ref_found, ref_norm = torch.zeros(1, device="cuda"), torch.zeros(1, device="cuda")
    reference.unpack_(reference.pack(src, scale, torch.float16), expected, inv_scale, ref_found, ref_norm)
    torch.cuda.synchronize()
    for got, want in zip(dst, expected):
        assert_same_bits(got, want)
    assert found.item() == ref_found.item() == 1.0
    assert torch.isinf(norm).item() and torch.isinf(ref_norm).item()


def test_tensor_longer_than_one_segment():
    """Tensors over 2^30 elements are split into several table entries."""
    numel = 2**30 + 3
    if torch.cuda.mem_get_info()[0] < 3 * numel * 2 + 2**30:
        pytest.skip("needs ~7 GB of free GPU memory")
    src = torch.empty(numel, dtype=torch.float16, device="cuda")
    src[: 2**20].normal_()
    src[2**20:].fill_(0.5)
    src[-3:] = torch.tensor([1.0, -2.0, 3.0], device="cuda")
    packed = ops.pack([src], scalar(1.0, "cuda"), torch.float16)
    assert torch.equal(packed, src)
    del packed
    assert hetcomm_launches(lambda: ops.pack([src], scalar(1.0, "cuda"), torch.float16)) == 1
