"""The Triton back end's plan cache (hetcomm/triton/plan_cache.py): a list of tensors
is planned once and its plan reused while the same tensors come back; a tensor moved,
resized or of another dtype is planned again; the oldest plans go first; and the
cache keeps no tensor alive.

Every call here is checked against hetcomm.reference bit for bit, so a stale plan
(one that writes where a tensor used to be) fails the test, not only the counters.
"""

import gc
import weakref

import pytest
import torch
from conftest import assert_same_bits, make_tensors, scalar

import hetcomm
from hetcomm import reference

pytest.importorskip("triton")
import hetcomm.triton  # noqa: E402
from hetcomm.triton import multi_tensor  # noqa: E402

pytestmark = [pytest.mark.parametrize("device", ["triton"], indirect=True),
              # The interpreter computes with numpy, which warns when a cast overflows.
              pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")]

# Small lists: every kernel runs in the interpreter without a GPU. 769 makes a full
# block plus a tail, CHUNK + 5 a tensor of two rows.
SHAPES = [(3, 7), (0,), (769,), (multi_tensor.CHUNK + 5,)]


@pytest.fixture(autouse=True)
def empty_cache(monkeypatch):
    monkeypatch.setattr(multi_tensor.PLANS, "max_plans", multi_tensor.PLANS.max_plans)
    monkeypatch.setattr(multi_tensor.PLANS, "max_rows", multi_tensor.PLANS.max_rows)
    hetcomm.triton.clear_plan_cache()
    yield
    hetcomm.triton.clear_plan_cache()


def plans_built() -> int:
    return hetcomm.triton.plan_cache_stats().misses


def pack_into(src, out, scale=0.375):
    hetcomm.pack(src, scalar(scale, out.device), out=out)
    expected = reference.pack(src, scalar(scale, out.device), out.dtype)
    assert_same_bits(out, expected)
    return out.clone()


def unscale_checked(tensors, inv_scale=0.5):
    expected = [t.clone() for t in tensors]
    found_inf, expected_inf = torch.zeros(1, device=tensors[0].device), torch.zeros(1, device=tensors[0].device)
    hetcomm.unscale_(tensors, scalar(inv_scale, found_inf.device), found_inf)
    reference.unscale_(expected, scalar(inv_scale, found_inf.device), expected_inf)
    for got, want in zip(tensors, expected):
        assert_same_bits(got, want)
    assert found_inf.item() == expected_inf.item()


def test_second_pack_of_the_same_tensors_builds_no_plan(device):
    src = make_tensors(SHAPES, torch.float32, device, seed=1)
    out = torch.empty(sum(t.numel() for t in src), dtype=torch.bfloat16, device=device)
    first = pack_into(src, out)
    assert plans_built() == 1
    second = pack_into(src, out)
    assert plans_built() == 1 and hetcomm.triton.plan_cache_stats().hits == 1
    assert_same_bits(second, first)


def test_second_unpack_of_the_same_tensors_builds_no_plan(device):
    flat = make_tensors([(sum(torch.Size(s).numel() for s in SHAPES),)], torch.float16, device, seed=2)[0]
    dst = [torch.empty(s, dtype=torch.float32, device=device) for s in SHAPES]
    expected = [torch.empty_like(t) for t in dst]
    ref_found, ref_norm = torch.zeros(1, device=device), torch.zeros(1, device=device)
    reference.unpack_(flat, expected, scalar(0.25, device), ref_found, ref_norm)
    norms, written = [], []
    for _ in range(2):
        found_inf, sq_norm = torch.zeros(1, device=device), torch.zeros(1, device=device)
        hetcomm.unpack_(flat, dst, 0.25, found_inf, sq_norm)
        for got, want in zip(dst, expected):
            assert_same_bits(got, want)
        assert found_inf.item() == ref_found.item()
        norms.append(sq_norm.clone())
        written.append([t.clone() for t in dst])
        for t in dst:
            t.fill_(float("nan"))  # the second call must write everything again
    assert plans_built() == 1
    assert torch.equal(norms[0], norms[1])
    torch.testing.assert_close(norms[0], ref_norm, rtol=1e-5, atol=0)


def test_replaced_tensor_is_planned_again_and_written(device):
    tensors = make_tensors(SHAPES, torch.float32, device, seed=3)
    unscale_checked(tensors)
    old = tensors[2]
    moved = old.clone()  # the same size and dtype at another address; old stays alive
    before = old.clone()
    tensors[2] = moved
    unscale_checked(tensors)
    assert plans_built() == 2
    assert_same_bits(old, before)  # a stale plan would have unscaled the old tensor
    unscale_checked(tensors)
    assert plans_built() == 2  # and the new list's plan is kept in turn


def test_resized_tensor_is_planned_again(device):
    """The same address with more elements: the new plan must cover them."""
    src = make_tensors(SHAPES, torch.float32, device, seed=4)
    grown = make_tensors([(27,)], torch.float32, device, seed=5)[0]
    out = torch.empty(sum(t.numel() for t in src[:-1]) + 27, dtype=torch.float16, device=device)
    # Last in the list, so that no other tensor's place in out moves.
    src[-1] = grown[:21]
    pack_into(src, out[:-6])
    src[-1] = grown
    pack_into(src, out)
    assert plans_built() == 2
    pack_into(src, out)
    assert plans_built() == 2


def test_recast_tensor_is_planned_again(device):
    """The same address and element count, another dtype: the new plan must read it as
    that dtype."""
    src = make_tensors(SHAPES, torch.float16, device, seed=4)
    out = torch.empty(sum(t.numel() for t in src), dtype=torch.float32, device=device)
    pack_into(src, out)
    src[2] = src[2].view(torch.bfloat16)
    pack_into(src, out)
    assert plans_built() == 2
    pack_into(src, out)
    assert plans_built() == 2


def test_least_recently_used_plan_is_evicted(device):
    multi_tensor.PLANS.max_plans = 2
    lists = {name: make_tensors([(5,), (9,)], torch.float32, device, seed=seed) for seed, name in enumerate("abc")}
    for name, expected_built in [("a", 1), ("b", 2), ("a", 2), ("c", 3), ("a", 3), ("b", 4)]:
        unscale_checked(lists[name])
        assert plans_built() == expected_built, name  # c evicts b (used before a), then b evicts c
    assert hetcomm.triton.plan_cache_stats().plans == 2


def test_row_budget_evicts_the_oldest(device):
    big = make_tensors([(multi_tensor.CHUNK * 2 + 1,)], torch.float32, device, seed=5)  # 3 rows
    small = make_tensors([(4,)], torch.float32, device, seed=6)  # 1 row
    multi_tensor.PLANS.max_rows = 3
    unscale_checked(small)
    unscale_checked(big)
    assert hetcomm.triton.plan_cache_stats().plans == 1 and hetcomm.triton.plan_cache_stats().rows == 3
    unscale_checked(big)
    unscale_checked(small)
    assert plans_built() == 3


def test_clear_drops_the_plans(device):
    tensors = make_tensors([(7,)], torch.float32, device, seed=7)
    unscale_checked(tensors)
    assert hetcomm.triton.plan_cache_stats().plans == 1
    hetcomm.triton.clear_plan_cache()
    assert hetcomm.triton.plan_cache_stats() == (0, 0, 0, 0)
    unscale_checked(tensors)
    assert plans_built() == 1


def test_cache_keeps_no_tensor_alive(device):
    tensors = make_tensors(SHAPES, torch.float32, device, seed=8)
    out = torch.empty(sum(t.numel() for t in tensors), dtype=torch.float16, device=device)
    storage_refs = [torch._C._storage_Use_Count(t.untyped_storage()._cdata) for t in [*tensors, out]]
    pack_into(tensors, out)
    assert hetcomm.triton.plan_cache_stats().plans == 1
    assert [torch._C._storage_Use_Count(t.untyped_storage()._cdata) for t in [*tensors, out]] == storage_refs
    gone = weakref.ref(tensors[2])
    del tensors[2]
    gc.collect()
    assert gone() is None
    assert hetcomm.triton.plan_cache_stats().plans == 1  # the plan outlives the tensor
