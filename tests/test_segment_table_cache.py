"""The CUDA back end's device tables (csrc/cuda/device_tables.h) on the emulated GPUs: a
list too long for one launch's argument table runs from kernel arguments on its first
call, from a table uploaded on its second, and from the same table while it recurs; a
list changed in any way its table depends on is a new list. Every result is compared bit
for bit with the reference, and with what the argument path wrote."""

import cuda_emulator
import pytest
import torch
from conftest import assert_same_bits, make_tensors, scalar

from hetcomm import reference

ops = torch.ops.hetcomm
SEGMENTS_PER_LAUNCH = 160  # kMaxSegments in csrc/kernels/launch_args.h
ADAMW_PER_LAUNCH = 80      # kMaxAdamWSegments in csrc/kernels/adamw.cuh
MAX_TABLES = 16            # kMaxTables in csrc/cuda/device_tables.cu
HYPER = {"lr": 3e-3, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.1}
GPUS = [pytest.param(gpu, id=f"emu-{gpu}") for gpu in cuda_emulator.GPUS]


@pytest.fixture
def gpu(request):
    """The emulated GPU switched on, its table cache empty (EmulatedGpu.running)."""
    emulated = cuda_emulator.emulated_gpu(request.param if hasattr(request, "param") else "sm80")
    with emulated.running():
        yield emulated


def calls(gpu, run, times=1):
    """The launches of each of `times` calls of run(), and the cache's counters after."""
    launches = []
    for _ in range(times):
        before = gpu.launches()
        run()
        launches.append(gpu.launches() - before)
    return launches, gpu.table_cache_stats()


def shapes(count, seed=0):
    return [(1 + (i * 7919 + seed) % 300,) for i in range(count)]


def unscale_and_check(gpu, tensors, times=1):
    """unscale_ `times` times, each call checked against the reference; returns calls()."""
    inv_scale = scalar(0.5)
    expected = [t.clone() for t in tensors]
    launches = []
    for _ in range(times):
        found, their_found = torch.zeros(1), torch.zeros(1)
        counted, stats = calls(gpu, lambda: ops.unscale_(tensors, inv_scale, found))
        reference.unscale_(expected, inv_scale, their_found)
        for got, want in zip(tensors, expected, strict=True):
            assert_same_bits(got, want)
        assert found.item() == their_found.item()
        launches += counted
    return launches, stats


@pytest.mark.parametrize("gpu", GPUS, indirect=True)
def test_a_recurring_list_is_uploaded_once_and_runs_in_one_launch_emulated(gpu):
    src = make_tensors(shapes(1000), torch.float32, "cpu")
    scale = scalar(0.25)
    wire = torch.empty(sum(t.numel() for t in src), dtype=torch.bfloat16)
    expected = reference.pack(src, scale, torch.bfloat16)
    launches = []
    for _ in range(3):
        wire.fill_(float("nan"))
        counted, stats = calls(gpu, lambda: ops.pack.out(src, scale, out=wire))
        assert_same_bits(wire, expected)
        launches += counted
    assert launches == [7, 1, 1]  # ceil(1000 / 160) from arguments, then one per dtype pair
    assert stats == (2, 1, 1, 1, 1)  # hits, misses, uploads, entries, launches of the last call


@pytest.mark.parametrize("gpu", GPUS, indirect=True)
def test_the_first_call_runs_from_arguments_the_next_from_the_table_emulated(gpu):
    tensors = make_tensors(shapes(1000), torch.float32, "cpu")
    launches, stats = unscale_and_check(gpu, tensors, times=3)
    assert launches == [7, 1, 1]  # ceil(1000 / 160), then one launch per dtype pair
    assert (stats.hits, stats.misses, stats.uploads) == (2, 1, 1)


def test_the_sum_of_squares_is_the_same_bits_from_a_table_emulated(gpu):
    """The table's one launch sums its chunks in the order of the argument path's launches."""
    src = make_tensors(shapes(1000), torch.float32, "cpu")
    wire = reference.pack(src, scalar(1.0), torch.float16)
    dst = [torch.empty_like(t) for t in src]
    found, norm = torch.zeros(1), torch.zeros(1)
    first, _ = calls(gpu, lambda: ops.unpack_(wire, dst, scalar(0.5), found, norm))
    first_dst, first_norm = [t.clone() for t in dst], norm.clone()
    for t in dst:
        t.fill_(float("nan"))
    norm.zero_()
    second, _ = calls(gpu, lambda: ops.unpack_(wire, dst, scalar(0.5), found, norm))
    assert first == [8] and second == [2]  # the walk, then the sum of squares
    assert_same_bits(norm, first_norm)
    for got, want in zip(dst, first_dst, strict=True):
        assert_same_bits(got, want)


def test_one_launch_per_dtype_pair_from_a_table_emulated(gpu):
    src = (make_tensors(shapes(400), torch.float32, "cpu") + make_tensors(shapes(300, 1), torch.bfloat16, "cpu")
           + make_tensors(shapes(20, 2), torch.float16, "cpu"))
    dst = [torch.empty_like(t, dtype=torch.float16) for t in src]
    launches, _ = calls(gpu, lambda: ops.cast_(src, dst), times=3)
    assert launches == [3 + 2 + 1, 3, 3]
    for s, d in zip(src, dst, strict=True):
        assert_same_bits(d, s.to(torch.float16))


def test_a_tensor_split_into_pieces_has_a_row_per_piece_emulated():
    """The emulated sm_61 cuts tensors into 2^20-element pieces (build.DEVICES)."""
    emulated = cuda_emulator.emulated_gpu("sm61")
    with emulated.running():
        tensors = make_tensors(shapes(200) + [(3 * 2**20 + 5,)], torch.float32, "cpu")
        launches, stats = unscale_and_check(emulated, tensors, times=2)
    assert launches == [2, 1] and stats.uploads == 1


def changed_lists():
    """(what changed, function(list) -> the changed list), each keeping the list's length."""
    def moved(tensors):  # the same size and values at another address
        return [*tensors[:5], tensors[5].clone(), *tensors[6:]]

    def resized(tensors):  # the same address, one element fewer
        return [*tensors[:5], tensors[5].resize_(tensors[5].numel() - 1), *tensors[6:]]

    def recast(tensors):  # every tensor the same address and count as float16
        out = []
        for t in tensors:
            half = t.view(torch.float16)[: t.numel()]
            half.copy_(torch.linspace(-2, 2, t.numel()))
            out.append(half)
        return out

    return [("moved", moved), ("resized", resized), ("recast", recast)]


@pytest.mark.parametrize("change", changed_lists(), ids=lambda c: c[0])
def test_a_changed_list_is_a_new_list_emulated(gpu, change):
    tensors = make_tensors(shapes(500), torch.float32, "cpu")
    unscale_and_check(gpu, tensors, times=2)
    changed = change[1](tensors)
    before = gpu.table_cache_stats()
    launches, stats = unscale_and_check(gpu, changed, times=2)
    assert launches == [4, 1]
    assert (stats.misses - before.misses, stats.uploads - before.uploads) == (1, 1)


def test_another_op_over_the_same_tensors_starts_from_arguments_emulated(gpu):
    """One op's first call of a list is a first call whatever another op did with it."""
    src = make_tensors(shapes(1000), torch.float32, "cpu")
    wire = reference.pack(src, scalar(1.0), torch.float16)
    found, norm = torch.zeros(1), torch.zeros(1)
    with_norm, _ = calls(gpu, lambda: ops.unpack_(wire, src, scalar(1.0), found, norm), times=2)
    without, stats = calls(gpu, lambda: ops.unpack_(wire, src, scalar(1.0), found), times=2)
    assert with_norm == [8, 2] and without == [7, 1]
    assert (stats.misses, stats.uploads) == (2, 2)


def test_lists_that_fit_one_launch_never_reach_the_cache_emulated(gpu):
    tensors = make_tensors(shapes(SEGMENTS_PER_LAUNCH), torch.float32, "cpu")
    launches, stats = unscale_and_check(gpu, tensors, times=2)
    assert launches == [1, 1]
    assert (stats.hits, stats.misses, stats.entries) == (0, 0, 0)


def test_the_cache_keeps_the_most_recent_lists_emulated(gpu):
    lists = [make_tensors([(1,)] * (SEGMENTS_PER_LAUNCH + 1), torch.float32, "cpu", seed=i)
             for i in range(MAX_TABLES + 1)]
    for tensors in lists:
        unscale_and_check(gpu, tensors, times=2)
    stats = gpu.table_cache_stats()
    assert stats.entries == MAX_TABLES and stats.uploads == MAX_TABLES + 1
    assert unscale_and_check(gpu, lists[-1])[0] == [1]  # still held
    assert unscale_and_check(gpu, lists[0])[0] == [2]   # the oldest went first
    assert gpu.table_cache_stats().entries == MAX_TABLES


def adamw_state(count):
    params = make_tensors(shapes(count), torch.float32, "cpu")
    grads = make_tensors(shapes(count), torch.float16, "cpu", seed=3)
    avg = make_tensors(shapes(count), torch.float32, "cpu", seed=4)
    sq = [t.abs() * 1e-3 for t in make_tensors(shapes(count), torch.float32, "cpu", seed=5)]
    copies = [torch.empty_like(p, dtype=torch.bfloat16) for p in params]
    return [grads, params, avg, sq, copies]


@pytest.mark.parametrize("gpu", GPUS, indirect=True)
def test_adamw_steps_from_a_table_are_the_reference_emulated(gpu):
    state = adamw_state(1000)
    expected = [[t.clone() for t in tensors] for tensors in state]
    scale, found = scalar(0.5), torch.zeros(1)
    launches = []
    for step in range(1, 4):
        count = scalar(float(step))
        counted, stats = calls(gpu, lambda: ops.adamw_(*state, scale, found, count, **HYPER))
        reference.adamw_(*expected, scale, found, count, **HYPER)
        for got, want in zip(sum(state[1:], []), sum(expected[1:], []), strict=True):
            assert_same_bits(got, want)
        launches += counted
    assert launches == [13, 1, 1]  # ceil(1000 / 80), then one per dtype pair
    assert (stats.hits, stats.misses, stats.uploads) == (2, 1, 1)


def test_adamw_with_a_moved_moment_is_a_new_list_emulated(gpu):
    state = adamw_state(ADAMW_PER_LAUNCH + 1)
    scale, found, count = scalar(0.5), torch.zeros(1), scalar(3.0)
    assert calls(gpu, lambda: ops.adamw_(*state, scale, found, count, **HYPER), times=2)[0] == [2, 1]
    # The old moment stays alive, so that a stale table writes there (a wrong result)
    # rather than into freed memory (a crash of the test process).
    moved_from = state[3][40]
    state[3][40] = moved_from.clone()
    expected = [[t.clone() for t in tensors] for tensors in state]
    launches, stats = calls(gpu, lambda: ops.adamw_(*state, scale, found, count, **HYPER))
    reference.adamw_(*expected, scale, found, count, **HYPER)
    for got, want in zip(sum(state[1:], []), sum(expected[1:], []), strict=True):
        assert_same_bits(got, want)
    assert launches == [2] and stats.misses == 2
