"""unpack_: flat * scale back into a tensor list, with found_inf and the sum of squares."""

import pytest
import torch
from conftest import DEVICES, FLOAT_DTYPES, ODD_SIZES, assert_same_bits, gpt_parameter_shapes, make_tensors, scalar
from tolerances import apart, fp32_squares_run, sq_norm_rtol, sum_rtol

import hetcomm
from hetcomm import reference


def run_both(flat, shapes, dst_dtype, scale_value, device, with_norm=True):
    """Runs hetcomm.unpack_ and the reference on identical fresh buffers."""
    results = []
    for impl in (hetcomm.unpack_, reference.unpack_):
        dst = [torch.full(s, -1.0, dtype=dst_dtype, device=device) for s in shapes]
        found_inf = torch.zeros(1, device=device)
        sq_norm = torch.zeros(1, device=device) if with_norm else None
        impl(flat, dst, scalar(scale_value, device), found_inf, sq_norm)
        results.append((dst, found_inf, sq_norm))
    return results


@pytest.mark.parametrize("device", DEVICES, indirect=True)
@pytest.mark.parametrize("dst_dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("wire_dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("size", ODD_SIZES)
def test_unpack_matches_reference(request, device, wire_dtype, dst_dtype, size):
    shapes = [(size,), (0,), (2, size)]
    flat = make_tensors([(3 * size,)], wire_dtype, device)[0]
    (dst, found, norm), (ref_dst, ref_found, ref_norm) = run_both(flat, shapes, dst_dtype, 1 / 1024, device)
    for got, want in zip(dst, ref_dst):
        assert_same_bits(got, want)
    assert found.item() == ref_found.item() == 0.0
    # Each within its own count of roundings of the exact sum of squares of the same values.
    backend = request.node.callspec.params["device"]
    rtol = apart(sq_norm_rtol(3 * size, fp32_squares_run(backend, device)), sq_norm_rtol(3 * size))
    torch.testing.assert_close(norm, ref_norm, rtol=rtol, atol=0)


@pytest.mark.parametrize("device", DEVICES, indirect=True)
@pytest.mark.parametrize("misaligned", [False, True])
def test_unpack_gpt_parameter_list(request, device, misaligned):
    shapes = gpt_parameter_shapes()
    flat = torch.cat([t.reshape(-1) for t in make_tensors(shapes, torch.float16, device)])
    if misaligned:
        flat = torch.cat([flat.new_zeros(1), flat])[1:]
    (dst, found, norm), (ref_dst, _, ref_norm) = run_both(flat, shapes, torch.float32, 2**-16, device)
    for got, want in zip(dst, ref_dst):
        assert_same_bits(got, want)
    assert found.item() == 0.0
    exact = sum((t.double() ** 2).sum() for t in ref_dst)
    n = flat.numel()
    rtol = apart(sq_norm_rtol(n, fp32_squares_run(request.node.callspec.params["device"], device)),
                 sum_rtol(n, torch.float64))
    torch.testing.assert_close(norm.double().cpu(), exact.reshape(1).cpu(), rtol=rtol, atol=0)
    # The bound tells the sum from one that missed the last mlp matrix (under 3% of it).
    missed = exact - (ref_dst[-4].double() ** 2).sum()
    assert (norm.double().cpu() - missed.cpu()).abs().item() > 10 * rtol * exact.item()


@pytest.mark.parametrize("device", DEVICES, indirect=True)
@pytest.mark.parametrize("bad_value", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("position", [0, 5, 4999])
def test_unpack_flags_nonfinite_anywhere(device, bad_value, position):
    flat = torch.randn(5000, device=device).half()
    flat[position] = bad_value
    (dst, found, _), (ref_dst, ref_found, _) = run_both(flat, [(10,), (4990,)], torch.float32, 0.5, device)
    assert found.item() == ref_found.item() == 1.0
    for got, want in zip(dst, ref_dst):
        assert_same_bits(got, want)


@pytest.mark.parametrize("device", DEVICES, indirect=True)
def test_unpack_flags_overflow_of_destination_dtype(device):
    """A finite wire value that overflows fp16 after scaling is caught as it is written."""
    flat = torch.tensor([1.0, 2.0, 40000.0], device=device)
    (dst, found, _), _ = run_both(flat, [(3,)], torch.float16, 2.0, device)
    assert found.item() == 1.0 and dst[0][2].item() == float("inf")


@pytest.mark.parametrize("device", DEVICES, indirect=True)
def test_unpack_never_clears_found_inf_and_accumulates_norm(device):
    flat = torch.ones(10, device=device)
    dst = [torch.empty(10, device=device)]
    found_inf, sq_norm = torch.ones(1, device=device), torch.full((1,), 5.0, device=device)
    hetcomm.unpack_(flat, dst, scalar(3.0, device), found_inf, sq_norm)
    assert found_inf.item() == 1.0
    assert sq_norm.item() == 5.0 + 10 * 9.0


def test_unpack_sum_of_squares_is_independent_of_thread_count():
    flat = torch.randn(1_000_003).bfloat16()
    shapes = [(1_000_000,), (3,)]
    norms = []
    for threads in (1, 2):
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            (_, _, norm), _ = run_both(flat, shapes, torch.float32, 0.1, "cpu")
        finally:
            torch.set_num_threads(previous)
        norms.append(norm)
    assert torch.equal(norms[0], norms[1])


@pytest.mark.parametrize("device", DEVICES, indirect=True)
def test_unpack_opcheck(device):
    flat = torch.randn(784, device=device).bfloat16()
    dst = make_tensors([(3, 5), (769,), (0,)], torch.float32, device)
    found_inf, sq_norm = torch.zeros(1, device=device), torch.zeros(1, device=device)
    torch.library.opcheck(torch.ops.hetcomm.unpack_.default, (flat, dst, scalar(0.5, device), found_inf, sq_norm))
    torch.library.opcheck(torch.ops.hetcomm.unpack_.default, (flat, dst, scalar(0.5, device), found_inf))
