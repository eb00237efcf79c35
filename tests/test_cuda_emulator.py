"""The CPU emulator of the CUDA back end (tests/cuda_emulator) itself: that the op tests
on the emulated GPUs really run the CUDA kernels, that its conversions are the GPU's,
and what only several emulated GPUs can show at once. The kernels' own tests are the
emulated `device` parametrizations."""

import subprocess
from pathlib import Path

import cuda_emulator
import pytest
import torch
from conftest import make_tensors, scalar

import hetcomm
from hetcomm import reference


@pytest.mark.parametrize("gpu", cuda_emulator.GPUS)
def test_the_emulated_kernels_run_only_while_switched_on(gpu):
    emulated = cuda_emulator.emulated_gpu(gpu)
    src = make_tensors([(5000,), (3,)], torch.float32, "cpu")
    before = emulated.launches()
    with emulated.running():
        packed = hetcomm.pack(src, scalar(2.0), torch.bfloat16)
    assert emulated.launches() == before + 1
    hetcomm.pack(src, scalar(2.0), torch.bfloat16)  # the CPU kernels again
    assert emulated.launches() == before + 1
    assert torch.equal(packed, reference.pack(src, scalar(2.0), torch.bfloat16))


def test_sum_of_squares_is_the_same_on_every_gpu_and_schedule():
    """multi_tensor.cuh: the rounding of the sum depends only on kThreads, kChunk and the
    dtype pair, not on the items per thread, the grid or the GPU model: the sm_61/sm_80
    shape (2 items, 8 or 15 blocks) and the sm_75 shape (4 items, 8 blocks) agree."""
    shapes = [(1 + (i * 7919) % 50_000,) for i in range(40)]
    flat = torch.cat([t.reshape(-1) for t in make_tensors(shapes, torch.float32, "cpu", seed=8)]).bfloat16()
    norms = {}
    for gpu in cuda_emulator.GPUS:
        for schedule in cuda_emulator.SCHEDULES:
            dst = [torch.empty(s) for s in shapes]
            found, norm = torch.zeros(1), torch.zeros(1)
            with cuda_emulator.emulated_gpu(gpu).running(schedule):
                hetcomm.unpack_(flat, dst, scalar(0.01), found, norm)
            norms[gpu, schedule] = norm
    first = next(iter(norms.values()))
    assert all(torch.equal(first, norm) for norm in norms.values()), norms


def test_shim_conversions_agree_with_the_cpu_over_every_input(tmp_path):
    """The fp16 and bf16 conversions of the shim, over all 2^32 floats and 2^16 halves,
    against the CPU's F16C instructions (~8 s of CPU time)."""
    emulator = Path(cuda_emulator.__file__).parent
    binary = tmp_path / "conversions"
    subprocess.run([cuda_emulator.build.CXX, "-O2", "-std=c++20", "-pthread", f"-I{emulator / 'shim'}",
                    str(emulator / "selfcheck" / "conversions.cpp"), "-o", str(binary)], check=True)
    result = subprocess.run([str(binary)], capture_output=True, text=True)
    if result.returncode == 77:
        pytest.skip(result.stdout.strip())
    assert result.returncode == 0, result.stdout
