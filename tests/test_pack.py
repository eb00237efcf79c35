"""pack: concat(src * scale) cast to the wire dtype, against the reference, bit for bit."""

import pytest
import torch
from conftest import (DEVICES, FLOAT_DTYPES, ODD_SIZES, assert_same_bits, gpt_parameter_shapes, make_tensors,
                      scalar, special_values)

import hetcomm
from hetcomm import reference


@pytest.mark.parametrize("device", DEVICES, indirect=True)
@pytest.mark.parametrize("wire_dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("src_dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("size", ODD_SIZES)
def test_pack_matches_reference(device, src_dtype, wire_dtype, size):
    src = make_tensors([(size,), (3, size), (0,), (size + 1,)], src_dtype, device)
    scale = scalar(0.3125, device)
    packed = hetcomm.pack(src, scale, wire_dtype)
    assert packed.shape == (5 * size + 1,) and packed.device.type == device
    assert_same_bits(packed, reference.pack(src, scale, wire_dtype))


@pytest.mark.parametrize("device", DEVICES, indirect=True)
@pytest.mark.parametrize("misaligned", [False, True])
@pytest.mark.parametrize("wire_dtype", FLOAT_DTYPES)
def test_pack_gpt_parameter_list(device, wire_dtype, misaligned):
    src = make_tensors(gpt_parameter_shapes(), torch.float32, device, misaligned=misaligned)
    assert len(src) == 148
    scale = scalar(3 / 24 * 2**16, device)  # a rank's weight times a loss scale
    assert_same_bits(hetcomm.pack(src, scale, wire_dtype), reference.pack(src, scale, wire_dtype))


@pytest.mark.parametrize("device", DEVICES, indirect=True)
@pytest.mark.parametrize("wire_dtype", FLOAT_DTYPES)
def test_pack_cast_is_torch_cast(device, wire_dtype):
    """With scale 1, packing is exactly torch's own .to(): ties, subnormals, overflow."""
    values = torch.cat([special_values(torch.float32), torch.randn(1000) * 1e3]).to(device)
    packed = hetcomm.pack([values], 1.0, wire_dtype)
    assert_same_bits(packed, values.to(wire_dtype))


@pytest.mark.parametrize("device", DEVICES, indirect=True)
def test_pack_into_preallocated_buffer_mixed_dtypes(device):
    src = make_tensors([(5,), (769,)], torch.float16, device) + make_tensors([(33,)], torch.bfloat16, device)
    out = torch.full((807,), 7.0, dtype=torch.bfloat16, device=device)
    returned = hetcomm.pack(src, scalar(-2.0, device), out=out)
    assert returned is out
    assert_same_bits(out, reference.pack(src, scalar(-2.0, device), torch.bfloat16))


@pytest.mark.parametrize("device", DEVICES, indirect=True)
def test_pack_passes_nonfinite_through(device):
    src = [torch.tensor([1.0, float("inf"), float("-inf"), float("nan"), 1e30], device=device)]
    packed = hetcomm.pack(src, 1.0, torch.float16)
    assert_same_bits(packed, reference.pack(src, scalar(1.0, device), torch.float16))
    assert packed[4].item() == float("inf")  # an overflow on the wire shows as inf, for unpack_ to catch


def test_pack_of_empty_tensors_only():
    packed = hetcomm.pack([torch.empty(0), torch.empty(0, 3)], 1.0, torch.float16)
    assert packed.shape == (0,) and packed.dtype == torch.float16


@pytest.mark.parametrize("device", DEVICES, indirect=True)
def test_pack_opcheck(device):
    src = make_tensors([(3, 5), (769,), (0,)], torch.float32, device)
    scale = scalar(0.5, device)
    torch.library.opcheck(torch.ops.hetcomm.pack.default, (src, scale, torch.float16))
    out = torch.empty(784, dtype=torch.bfloat16, device=device)
    torch.library.opcheck(torch.ops.hetcomm.pack.out, (src, scale), {"out": out})
