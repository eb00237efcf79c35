"""Inputs for the op benchmarks: ~100 gradient-like tensors totalling N elements."""

import pytest
import torch

# Sizes in elements; 4M fits in a server's last-level cache, 16M and 64M do not.
SIZES = {"4M": 4 * 2**20, "16M": 16 * 2**20, "64M": 64 * 2**20}
NUM_TENSORS = 100


def tensor_sizes(total: int, count: int = NUM_TENSORS) -> list[int]:
    """Uneven sizes (like a model's parameters) that add up to exactly `total`."""
    weights = [1 + (i * 7919) % 13 for i in range(count)]
    sizes = [total * w // sum(weights) for w in weights]
    sizes[-1] += total - sum(sizes)
    return sizes


class Workload:
    """Preallocated buffers for one size, shared by every provider so that each times
    only its own work (no allocation inside the timed region)."""

    def __init__(self, total: int):
        self.total = total
        self.sizes = tensor_sizes(total)
        generator = torch.Generator().manual_seed(0)
        self.grads = [torch.randn(n, generator=generator) for n in self.sizes]
        self.grads_out = [torch.empty(n) for n in self.sizes]
        self.wire16 = torch.empty(total, dtype=torch.float16)
        self.wire16.copy_(torch.cat(self.grads))
        self.flat32 = torch.empty(total)
        self.model16 = [torch.empty(n, dtype=torch.bfloat16) for n in self.sizes]
        self.copy_src = torch.randn(total, generator=generator)
        self.copy_dst = torch.empty(total)
        self.scale = torch.tensor([0.25])
        self.inv_scale = torch.tensor([4.0])
        self.found_inf = torch.zeros(1)
        self.sq_norm = torch.zeros(1)
        # adamw_: fp32 masters and moments, the 16-bit gradients the wire leaves.
        self.masters = [g.clone() for g in self.grads]
        self.exp_avgs = [g * 0.1 for g in self.grads]
        self.exp_avg_sqs = [g * g * 1e-2 for g in self.grads]
        self.grads16 = [g.half() for g in self.grads]
        self.steps = [torch.tensor(10.0) for _ in self.grads]
        self.step = torch.tensor([10.0])


_cache: dict[str, Workload] = {}


@pytest.fixture(params=list(SIZES), scope="module")
def workload(request):
    # One size alive at a time keeps peak memory near 4 GB at 64M elements.
    if request.param not in _cache:
        _cache.clear()
        _cache[request.param] = Workload(SIZES[request.param])
    yield request.param, _cache[request.param]
