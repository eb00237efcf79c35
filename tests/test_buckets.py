"""Buckets cut at exact byte counts: every gradient element in exactly one bucket, in
reverse parameter order, sizes as planned (a small first one, equal shares after it),
parameters spanning buckets, devices never mixed."""

import pytest
import torch

from hetcomm.comm.buckets import bucket_budgets, make_buckets

MB = 2**20


@pytest.mark.parametrize("total, cap, expected", [
    (100, 25 * MB, [100]),
    (MB + 10, 25 * MB, [MB, 10]),
    (51 * MB, 25 * MB, [MB, 25 * MB, 25 * MB]),
    (51 * MB + 1, 25 * MB, [MB, 17476267, 17476267, 17476267]),   # 50 MB + 1 in three equal shares
    (10 * MB, MB // 2, [MB // 2] * 20),                             # a cap under 1 MB caps the first too
])
def test_budgets(total, cap, expected):
    assert bucket_budgets(total, cap) == expected
    assert sum(expected) == total


@pytest.mark.parametrize("total, cap, expected", [
    (MB + 12, 25 * MB, [MB + 12]),                     # within the cap: one all-reduce
    (25 * MB, 25 * MB, [25 * MB]),
    (51 * MB, 25 * MB, [MB, 25 * MB, 25 * MB]),        # over it: the small first bucket still pays
])
def test_budgets_without_overlap(total, cap, expected):
    assert bucket_budgets(total, cap, small_first=False) == expected
    assert [b.numel * 4 for b in make_buckets(params_of((total // 4,)), cap, small_first=False)] == expected


def params_of(*shapes, dtype=torch.float32, device="cpu"):
    return [torch.nn.Parameter(torch.zeros(shape, dtype=dtype, device=device)) for shape in shapes]


def covered(buckets):
    """(param id, element) pairs in the order the buckets hold them."""
    return [(id(s.param), i) for b in buckets for s in b.segments for i in range(s.start, s.stop)]


def test_every_element_once_in_reverse_order_and_sizes_as_planned():
    params = params_of((300, 1000), (7,), (1000, 1000), (5, 3), (200_000,))
    cap = 2 * MB
    buckets = make_buckets(params, cap)
    expected = [(id(p), i) for p in reversed(params) for i in range(p.numel())]
    assert covered(buckets) == expected
    budgets = bucket_budgets(sum(p.numel() * 4 for p in params), cap)
    assert [b.numel * 4 for b in buckets] == budgets    # fp32: every budget is a whole number of elements
    assert buckets[0].numel * 4 == MB and len({b.numel for b in buckets[1:]}) <= 2   # equal shares after the first
    spanning = [p for p in params if sum(any(q is p for q in b.params) for b in buckets) > 1]
    assert spanning, "a parameter larger than a bucket spans several"


def test_segments_are_views_that_write_through():
    params = params_of((1000, 700))
    for p in params:
        p.grad = torch.arange(p.numel(), dtype=torch.float32).reshape(p.shape)
    buckets = make_buckets(params, MB)
    assert len(buckets) > 1
    for bucket in buckets:
        for grad in bucket.grads():
            grad.mul_(-1)
    assert torch.equal(params[0].grad.view(-1), -torch.arange(params[0].numel(), dtype=torch.float32))


def test_mixed_dtypes_and_devices():
    cpu16 = params_of((600_000,), dtype=torch.float16)
    meta = params_of((600_000,), device="meta")
    buckets = make_buckets(cpu16 + meta, MB)
    # Reverse order: the meta parameter's buckets first; no bucket mixes devices.
    assert all(len({s.param.device for s in b.segments}) == 1 for b in buckets)
    assert [b.segments[0].param.device.type for b in buckets][0] == "meta"
    assert sum(b.numel for b in buckets) == 1_200_000
    half_buckets = [b for b in buckets if b.segments[0].param.device.type == "cpu"]
    assert half_buckets[0].numel * 2 == MB   # bytes, not elements: fp16 buckets hold twice the elements
