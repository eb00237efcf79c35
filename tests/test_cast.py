"""cast_: multi-tensor dtype conversion, bit-exact with torch's .to()."""

import pytest
import torch
from conftest import (FLOAT_DTYPES, NATIVE_DEVICES, ODD_SIZES, assert_same_bits, gpt_parameter_shapes,
                      make_tensors, special_values)

import hetcomm


@pytest.mark.parametrize("device", NATIVE_DEVICES, indirect=True)
@pytest.mark.parametrize("dst_dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("src_dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("size", ODD_SIZES)
def test_cast_is_torch_to(device, src_dtype, dst_dtype, size):
    src = make_tensors([(size,), (0,), (size, 2)], src_dtype, device)
    src[0][0] = float("inf")
    dst = [torch.empty_like(t, dtype=dst_dtype) for t in src]
    hetcomm.cast_(src, dst)
    for s, d in zip(src, dst):
        assert_same_bits(d, s.to(dst_dtype))


@pytest.mark.parametrize("device", NATIVE_DEVICES, indirect=True)
@pytest.mark.parametrize("dst_dtype", [torch.float16, torch.bfloat16])
def test_cast_rounding_edge_cases(device, dst_dtype):
    src = [special_values(torch.float32).to(device), torch.tensor([float("nan"), -float("nan")], device=device)]
    dst = [torch.empty_like(t, dtype=dst_dtype) for t in src]
    hetcomm.cast_(src, dst)
    for s, d in zip(src, dst):
        assert_same_bits(d, s.to(dst_dtype))


@pytest.mark.parametrize("device", NATIVE_DEVICES, indirect=True)
@pytest.mark.parametrize("misaligned", [False, True])
def test_cast_master_to_model_weights(device, misaligned):
    master = make_tensors(gpt_parameter_shapes(), torch.float32, device, misaligned=misaligned)
    model = [torch.empty_like(t, dtype=torch.bfloat16) for t in master]
    hetcomm.cast_(master, model)
    for s, d in zip(master, model):
        assert_same_bits(d, s.to(torch.bfloat16))


@pytest.mark.parametrize("device", NATIVE_DEVICES, indirect=True)
def test_cast_opcheck(device):
    src = make_tensors([(3, 5), (769,)], torch.float32, device)
    dst = [torch.empty_like(t, dtype=torch.float16) for t in src]
    torch.library.opcheck(torch.ops.hetcomm.cast_.default, (src, dst))
