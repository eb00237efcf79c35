"""unscale_: GradScaler's unscale with its check, against the reference and torch's own op."""

import pytest
import torch
from conftest import (DEVICES, FLOAT_DTYPES, ODD_SIZES, assert_same_bits, gpt_parameter_shapes, make_tensors, scalar,
                      torch_unscale_)

import hetcomm
from hetcomm import reference


@pytest.mark.parametrize("device", DEVICES, indirect=True)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("size", ODD_SIZES)
def test_unscale_matches_reference_and_torch(device, dtype, size):
    tensors = make_tensors([(size,), (0,), (size, 3)], dtype, device)
    expected = [t.clone() for t in tensors]
    torch_result = [t.clone() for t in tensors]
    found, ref_found, torch_found = (torch.zeros(1, device=device) for _ in range(3))
    inv_scale = scalar(2**-13, device)
    hetcomm.unscale_(tensors, inv_scale, found)
    reference.unscale_(expected, inv_scale, ref_found)
    torch_unscale_(torch_result, torch_found, inv_scale)
    for got, want, theirs in zip(tensors, expected, torch_result):
        assert_same_bits(got, want)
        assert_same_bits(got, theirs)
    assert found.item() == ref_found.item() == torch_found.item() == 0.0


@pytest.mark.parametrize("device", DEVICES, indirect=True)
def test_unscale_mixed_dtypes_gpt_list(device):
    shapes = gpt_parameter_shapes()
    tensors = [t.to(FLOAT_DTYPES[i % 3]) for i, t in enumerate(make_tensors(shapes, torch.float32, device))]
    expected = [t.clone() for t in tensors]
    found, ref_found = torch.zeros(1, device=device), torch.zeros(1, device=device)
    hetcomm.unscale_(tensors, 1 / 3, found)
    reference.unscale_(expected, scalar(1 / 3, device), ref_found)
    for got, want in zip(tensors, expected):
        assert_same_bits(got, want)


@pytest.mark.parametrize("device", DEVICES, indirect=True)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("bad_value", [float("inf"), float("-inf"), float("nan")])
def test_unscale_flags_nonfinite_input(device, dtype, bad_value):
    tensors = make_tensors([(100,), (40000,)], dtype, device)
    tensors[1][39999] = bad_value
    torch_result = [t.clone() for t in tensors]
    found, torch_found = torch.zeros(1, device=device), torch.zeros(1, device=device)
    hetcomm.unscale_(tensors, 0.5, found)
    torch_unscale_(torch_result, torch_found, scalar(0.5, device))
    assert found.item() == torch_found.item() == 1.0
    for got, theirs in zip(tensors, torch_result):
        assert_same_bits(got, theirs)


@pytest.mark.parametrize("device", DEVICES, indirect=True)
def test_unscale_opcheck(device):
    tensors = make_tensors([(3, 5), (769,)], torch.float16, device)
    torch.library.opcheck(torch.ops.hetcomm.unscale_.default,
                          (tensors, scalar(0.25, device), torch.zeros(1, device=device)))
