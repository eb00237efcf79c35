"""What is specific to the CUDA kernels: long lists, launch counts, alignment, device
mixing, determinism of the sum of squares, CUDA-graph capture. The reference tests of
each op run on CUDA as the CUDA `device` parametrizations of test_pack/unpack/unscale/cast.

Every test runs on each CUDA device of conftest.CUDA_DEVICES: a real GPU when there is
one, and the emulated sm_61, sm_75 and sm_80 GPUs of tests/cuda_emulator under three
thread schedules (their tensors are CPU tensors)."""

import math
import re
from pathlib import Path

import cuda_emulator
import pytest
import torch
from conftest import CUDA_DEVICES, FLOAT_DTYPES, assert_same_bits, make_tensors, scalar, torch_unscale_
from tolerances import apart, fp32_squares_run, sq_norm_rtol, sum_rtol

from hetcomm import reference

pytestmark = pytest.mark.parametrize("device", CUDA_DEVICES, indirect=True)

ops = torch.ops.hetcomm
SEGMENTS_PER_LAUNCH = 160  # kMaxSegments in csrc/kernels/launch_args.h
CHUNK = 8192               # kChunk in csrc/kernels/launch_args.h

# 1,200 tensors of uneven sizes, some empty, some straddling chunk boundaries.
MANY_SHAPES = [((i * 37) % 3001,) for i in range(1190)] + [(CHUNK + 1,), (3 * CHUNK - 1,)] * 5


def needs_a_real_gpu(device, why):
    if device != "cuda":
        pytest.skip(f"the emulated GPU {why}")


def test_pack_and_unpack_a_list_of_1200_tensors(device):
    src = make_tensors(MANY_SHAPES, torch.float32, device)
    scale, inv_scale = scalar(2.0**12, device), scalar(2.0**-12, device)
    wire = ops.pack(src, scale, torch.bfloat16)
    assert_same_bits(wire, reference.pack(src, scale, torch.bfloat16))

    dst = [torch.empty_like(t) for t in src]
    expected = [torch.empty_like(t) for t in src]
    found, norm = torch.zeros(1, device=device), torch.zeros(1, device=device)
    ref_found, ref_norm = torch.zeros(1, device=device), torch.zeros(1, device=device)
    ops.unpack_(wire, dst, inv_scale, found, norm)
    reference.unpack_(wire, expected, inv_scale, ref_found, ref_norm)
    for got, want in zip(dst, expected):
        assert_same_bits(got, want)
    assert found.item() == 0.0
    n = wire.numel()
    torch.testing.assert_close(norm, ref_norm, rtol=apart(sq_norm_rtol(n, fp32_squares_run("cuda")), sq_norm_rtol(n)),
                               atol=0)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_unscale_and_cast_a_list_of_1200_tensors(device, dtype):
    tensors = make_tensors(MANY_SHAPES, dtype, device)
    theirs = [t.clone() for t in tensors]
    tensors[-1][-1] = float("inf")  # in the last launch, last chunk
    theirs[-1][-1] = float("inf")
    found, their_found = torch.zeros(1, device=device), torch.zeros(1, device=device)
    ops.unscale_(tensors, scalar(0.125, device), found)
    torch_unscale_(theirs, their_found, scalar(0.125, device))
    assert found.item() == their_found.item() == 1.0
    for got, want in zip(tensors, theirs):
        assert_same_bits(got, want)

    dst = [torch.empty_like(t, dtype=torch.float16) for t in tensors]
    ops.cast_(tensors, dst)
    for s, d in zip(tensors, dst):
        assert_same_bits(d, s.to(torch.float16))


def test_a_handful_of_launches_per_list(device, count_launches):
    src = make_tensors([(1000 + i,) for i in range(1000)], torch.float32, device)
    scale = scalar(0.5, device)
    wire = torch.empty(sum(t.numel() for t in src), dtype=torch.float16, device=device)
    per_list = math.ceil(len(src) / SEGMENTS_PER_LAUNCH)  # 7
    assert count_launches(lambda: ops.pack.out(src, scale, out=wire)) == per_list
    found, norm = torch.zeros(1, device=device), torch.zeros(1, device=device)
    assert count_launches(lambda: ops.unpack_(wire, src, scale, found, norm)) == per_list + 1
    assert count_launches(lambda: ops.unpack_(wire, src, scale, found)) == per_list
    assert count_launches(lambda: ops.unscale_(src, scale, found)) == per_list
    assert count_launches(lambda: ops.cast_(src, [t.half() for t in src])) == per_list


def test_one_launch_per_dtype_pair_for_large_tensors(device, count_launches):
    """64M elements (256 MB of fp32) over 100 tensors: one launch; mixed source dtypes: one per pair."""
    src = [torch.ones(640_000, device=device) for _ in range(100)]
    assert count_launches(lambda: ops.pack(src, scalar(1.0, device), torch.float16)) == 1
    mixed = src[:50] + [t.half() for t in src[50:60]] + [t.bfloat16() for t in src[60:]]
    assert count_launches(lambda: ops.pack(mixed, scalar(1.0, device), torch.float16)) == 3


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_misaligned_views_every_op(device, dtype):
    """Views starting at element 1 take the element-wise path; results are the same bits."""
    shapes = [(1,), (7,), (CHUNK + 3,), (769, 3)]
    src = make_tensors(shapes, dtype, device, misaligned=True)
    assert all(t.data_ptr() % 16 != 0 for t in src)
    scale = scalar(3.0, device)
    assert_same_bits(ops.pack(src, scale, torch.float16), reference.pack(src, scale, torch.float16))

    dst = [torch.empty(t.numel() + 1, dtype=torch.bfloat16, device=device)[1:].view(t.shape) for t in src]
    ops.cast_(src, dst)
    for s, d in zip(src, dst):
        assert_same_bits(d, s.to(torch.bfloat16))

    theirs = [t.clone() for t in src]
    found, their_found = torch.zeros(1, device=device), torch.zeros(1, device=device)
    ops.unscale_(src, scale, found)
    torch_unscale_(theirs, their_found, scale)
    for got, want in zip(src, theirs):
        assert_same_bits(got, want)


GUARD = 64  # sentinel elements on each side of a guarded tensor


def guarded(shape, dtype, device, misaligned):
    """A tensor inside a buffer whose GUARD elements on each side hold -7."""
    numel = math.prod(shape)
    start = GUARD + int(misaligned)
    buffer = torch.full((start + numel + GUARD,), -7.0, dtype=dtype, device=device)
    return buffer, buffer[start:start + numel].view(shape)


def assert_guards_intact(buffer, tensor):
    start = tensor.storage_offset()
    assert (buffer[:start] == -7.0).all() and (buffer[start + tensor.numel():] == -7.0).all(), \
        "a kernel wrote outside the tensor"


@pytest.mark.parametrize("misaligned", [False, True], ids=["aligned", "misaligned"])
def test_nothing_written_outside_the_tensors(device, misaligned):
    """Every op writes exactly its outputs: the elements just before and after each
    output tensor keep their values, for sizes that end inside a vector group, on a
    chunk boundary and one past it."""
    shapes = [(1,), (7,), (9,), (CHUNK,), (CHUNK + 1,), (769, 3)]
    src = make_tensors(shapes, torch.float32, device, seed=11, misaligned=misaligned)
    total = sum(t.numel() for t in src)
    for wire_dtype in FLOAT_DTYPES:
        buffer, wire = guarded((total,), wire_dtype, device, misaligned)
        ops.pack.out(src, scalar(0.5, device), out=wire)
        assert_guards_intact(buffer, wire)
        assert_same_bits(wire, reference.pack(src, scalar(0.5, device), wire_dtype))

        outputs = [guarded(s, dtype, device, misaligned) for s, dtype in zip(shapes, FLOAT_DTYPES * 2)]
        found, norm = torch.zeros(1, device=device), torch.zeros(1, device=device)
        ops.unpack_(wire, [t for _, t in outputs], scalar(2.0, device), found, norm)
        ops.unscale_([t for _, t in outputs], scalar(0.25, device), found)
        ops.cast_(src, [t for _, t in outputs])
        for (buffer, t), s in zip(outputs, src):
            assert_guards_intact(buffer, t)
            assert_same_bits(t, s.to(t.dtype))


def test_sum_of_squares_is_deterministic_and_independent_of_alignment(device):
    """The same bits on every run, and whether or not the data is 16-byte aligned: the
    element-to-thread mapping and so every rounding depend only on the dtype pair."""
    shapes = [(1 + (i * 7919) % 50_000,) for i in range(300)]
    values = torch.cat([t.reshape(-1) for t in make_tensors(shapes, torch.float32, device, seed=3)])
    aligned = values.half()
    misaligned = torch.cat([aligned.new_zeros(1), aligned])[1:]
    norms = []
    for flat in (aligned, aligned, misaligned):
        dst = [torch.empty(s, device=device) for s in shapes]
        found, norm = torch.zeros(1, device=device), torch.zeros(1, device=device)
        ops.unpack_(flat, dst, scalar(0.01, device), found, norm)
        norms.append(norm)
    assert torch.equal(norms[0], norms[1]) and torch.equal(norms[0], norms[2])
    exact = ((aligned.float() * scalar(0.01, device)).double() ** 2).sum()
    n = values.numel()
    rtol = apart(sq_norm_rtol(n, fp32_squares_run("cuda")), sum_rtol(n, torch.float64))
    torch.testing.assert_close(norms[0].double(), exact.reshape(1), rtol=rtol, atol=0)
    # A scale off by 1% (2% in the sum) lands far outside.
    assert abs(norms[0].item() / (1.01 ** 2 * exact.item()) - 1) > 10 * rtol


def test_empty_tensors_write_nothing(device, count_launches):
    empty = [torch.empty(0, device=device), torch.empty(0, 3, device=device, dtype=torch.float16)]
    packed = ops.pack(empty, scalar(1.0, device), torch.bfloat16)
    assert packed.shape == (0,) and packed.device.type == device
    found, norm = torch.full((1,), 0.0, device=device), torch.full((1,), 5.0, device=device)
    assert count_launches(lambda: ops.unpack_(packed, empty, scalar(1.0, device), found, norm)) == 0
    ops.unscale_(empty, scalar(2.0, device), found)
    ops.cast_(empty, [torch.empty(0, device=device, dtype=torch.bfloat16), torch.empty(0, 3, device=device)])
    assert found.item() == 0.0 and norm.item() == 5.0


def _mixed_device_calls(device):
    cuda = make_tensors([(5,), (7,)], torch.float32, device)
    cpu = make_tensors([(7,)], torch.float32, "cpu")
    one, one_cpu = scalar(1.0, device), scalar(1.0, "cpu")
    flag, flag_cpu = torch.zeros(1, device=device), torch.zeros(1)
    wire = torch.empty(12, device=device)
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
def test_mixed_devices_are_rejected_by_name(device, case):
    needs_a_real_gpu(device, "has no device of its own: its tensors are CPU tensors")
    call, message = _mixed_device_calls(device)[case]
    with pytest.raises(RuntimeError, match=message):
        call()


def test_mixed_dtype_list_opcheck(device):
    src = make_tensors([(3, 5)], torch.float32, device) + make_tensors([(769,)], torch.bfloat16, device)
    flat = torch.randn(784, device=device).half()
    found, norm = torch.zeros(1, device=device), torch.zeros(1, device=device)
    torch.library.opcheck(ops.pack.default, (src, scalar(0.5, device), torch.float16))
    torch.library.opcheck(ops.unpack_.default, (flat, src, scalar(0.5, device), found, norm))
    torch.library.opcheck(ops.unscale_.default, (src, scalar(0.5, device), found))


def test_pack_unpack_captured_in_a_cuda_graph(device):
    """Capture fails on any host synchronisation; replays must see new values."""
    needs_a_real_gpu(device, "has no streams or graphs")
    src = make_tensors([(1000 + 13 * i,) for i in range(200)], torch.float32, device)
    wire = torch.empty(sum(t.numel() for t in src), dtype=torch.float16, device=device)
    dst = [torch.empty_like(t) for t in src]
    scale, inv_scale = scalar(2.0**8, device), scalar(2.0**-8, device)
    found, norm = torch.zeros(1, device=device), torch.zeros(1, device=device)

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
    ref_found, ref_norm = torch.zeros(1, device=device), torch.zeros(1, device=device)
    reference.unpack_(reference.pack(src, scale, torch.float16), expected, inv_scale, ref_found, ref_norm)
    torch.cuda.synchronize()
    for got, want in zip(dst, expected):
        assert_same_bits(got, want)
    assert found.item() == ref_found.item() == 1.0
    assert torch.isinf(norm).item() and torch.isinf(ref_norm).item()


def free_memory(device) -> int:
    if device == "cuda":
        return torch.cuda.mem_get_info()[0]
    meminfo = Path("/proc/meminfo").read_text()  # the emulator runs on Linux only
    return int(re.search(r"MemAvailable:\s+(\d+) kB", meminfo)[1]) * 1024


def segment_numel(target: str) -> int:
    """kMaxSegmentNumel of the back end under test: 2^30 on a real GPU, the emulated GPU's own."""
    if target == "cuda":
        return 2**30
    return cuda_emulator.build.DEVICES[target.split("-")[1]].max_segment_numel


def test_tensor_longer_than_one_segment(request, device, count_launches):
    """Tensors longer than a segment (2^30 elements) are split into several table
    entries, in one launch. The emulated sm_61 is built with 2^20-element segments, so
    that it takes the split with a tensor of three segments; 2^30 elements would take
    ~30 s there."""
    segment = segment_numel(request.node.callspec.params["device"])
    if device != "cuda" and segment == 2**30:
        pytest.skip("2^30 elements on an emulated GPU: the emulated sm_61's short segments take the split")
    numel = segment + 3 if device == "cuda" else 3 * segment + 3
    if free_memory(device) < 3 * numel * 2 + 2**30:
        pytest.skip(f"needs ~{(6 * numel + 2**30) / 1e9:.0f} GB of free {device} memory")
    src = torch.empty(numel, dtype=torch.float16, device=device)
    src[: numel // 2].normal_()
    src[numel // 2:].fill_(0.5)
    src[-3:] = torch.tensor([1.0, -2.0, 3.0], device=device)
    packed = ops.pack([src], scalar(1.0, device), torch.float16)
    assert torch.equal(packed, src)
    del packed
    assert count_launches(lambda: ops.pack([src], scalar(1.0, device), torch.float16)) == 1
