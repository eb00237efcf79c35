"""The CUDA back end's launch-shape override (torch.ops.hetcomm._set_launch_shape and
_clear_launch_shape, csrc/cuda/launch_shape.h), through which benchmarks/sweep_launch.py
times the kernels at shapes other than csrc/cuda/launch_shape.cu's table, on the emulated
GPUs: it really changes the launch (the grid and the kernel instance the emulator ran),
results keep their bits, it lasts until cleared and never past a switch-off, and a bad
shape is refused by the argument's name."""

import cuda_emulator
import pytest
import torch
from conftest import assert_same_bits, make_tensors, scalar

from hetcomm import reference

ops = torch.ops.hetcomm
CHUNK = 8192  # kChunk in csrc/kernels/launch_args.h


@pytest.fixture
def sm80():
    """The emulated sm_80 switched on: 3 SMs, the table's {8 blocks per SM, 2 items per
    thread}, 5 blocks resident per SM, so a launch of 40 chunks has a grid of 15."""
    gpu = cuda_emulator.emulated_gpu("sm80")
    with gpu.running():
        yield gpu


def launched(gpu, src, wire, expected):
    """The one launch of a pack of src into wire, whose bits it checks."""
    gpu.take_recent_launches()
    wire.fill_(float("nan"))
    ops.pack.out(src, scalar(0.5), out=wire)
    assert_same_bits(wire, expected)
    [launch] = gpu.take_recent_launches()
    return launch


def test_an_override_changes_the_grid_and_the_kernel_until_cleared(sm80):
    src = make_tensors([(40 * CHUNK,)], torch.float32, "cpu")
    wire = torch.empty(40 * CHUNK, dtype=torch.bfloat16)
    expected = reference.pack(src, scalar(0.5), torch.bfloat16)
    launches = {"table": launched(sm80, src, wire, expected)}
    for blocks, items in [(1, 4), (2, 2), (8, 4)]:
        ops._set_launch_shape(blocks, items)
        launches[blocks, items] = launched(sm80, src, wire, expected)
    ops._clear_launch_shape()
    launches["cleared"] = launched(sm80, src, wire, expected)

    assert launches["table"].grid == 15  # 3 SMs x min(8, 5 resident)
    assert [launches[shape].grid for shape in [(1, 4), (2, 2), (8, 4)]] == [3, 6, 15]  # 8 capped at 5 resident
    assert launches[2, 2].kernel == launches["table"].kernel  # 2 items: the table's instance
    assert launches[1, 4].kernel == launches[8, 4].kernel != launches["table"].kernel  # 4 items: the other one
    assert launches["cleared"] == launches["table"]


def test_switching_the_emulated_gpu_on_starts_from_the_table():
    gpu = cuda_emulator.emulated_gpu("sm80")
    src = make_tensors([(40 * CHUNK,)], torch.float32, "cpu")
    wire = torch.empty(40 * CHUNK, dtype=torch.float16)
    expected = reference.pack(src, scalar(0.5), torch.float16)
    with gpu.running():
        ops._set_launch_shape(1, 2)
        assert launched(gpu, src, wire, expected).grid == 3
    with gpu.running():  # as a new process would: an override left behind does not shape it
        assert launched(gpu, src, wire, expected).grid == 15


@pytest.mark.parametrize("blocks, items, named", [(0, 2, "blocks_per_sm"), (-1, 4, "blocks_per_sm"),
                                                  (33, 2, "blocks_per_sm"), (4, 3, "items_per_thread"),
                                                  (4, 8, "items_per_thread")])
def test_a_bad_shape_is_refused_by_name_and_changes_nothing(sm80, blocks, items, named):
    src = make_tensors([(40 * CHUNK,)], torch.float32, "cpu")
    with pytest.raises(ValueError, match=f"hetcomm._set_launch_shape: {named} must be"):
        ops._set_launch_shape(blocks, items)
    sm80.take_recent_launches()
    ops.pack(src, scalar(1.0), torch.float16)
    assert [launch.grid for launch in sm80.take_recent_launches()] == [15]
