"""WeightedReducer: the weighted gradient all-reduce for custom training loops."""

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

from hetcomm import ops
from hetcomm.comm.buckets import Bucket, make_buckets
from hetcomm.comm.collectives import check_same_layout, launch_all_reduce, wait
from hetcomm.comm.weights import agree_share

WIRE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass
class ReduceResult:
    """What one reduce() found. Identical on every rank: it is computed from the
    all-reduced data."""

    found_inf: Tensor   # 1-element fp32: 1 if any reduced gradient is ±inf/NaN (skip the step)
    grad_norm: Tensor   # 1-element fp32: L2 norm of the whole reduced, unscaled gradient
    weight: float       # this rank's weight n_i / N
    total: float        # N when counts were given, else the sum of the weights


def check_wire_dtype(wire_dtype: torch.dtype, group, who: str) -> None:
    if wire_dtype not in WIRE_DTYPES:
        raise ValueError(f"{who}: wire_dtype must be torch.float32, torch.float16 or torch.bfloat16; "
                         f"got {wire_dtype}")
    if wire_dtype == torch.bfloat16 and dist.get_backend(group) == "gloo":
        raise ValueError(f"{who}: the Gloo backend cannot all-reduce bfloat16; use wire_dtype=torch.float16 "
                         f"(with a loss scale) or torch.float32 on Gloo, or NCCL for a bfloat16 wire")


def scalar_on(value: float | Tensor, device: torch.device) -> Tensor:
    """A 1-element fp32 tensor on `device`; a fill kernel, not a host-to-device copy."""
    if isinstance(value, Tensor):
        return value.to(device=device, dtype=torch.float32).reshape(1)
    return torch.full((1,), float(value), dtype=torch.float32, device=device)


class WeightedReducer:
    """Reduces the gradients of `params` across the ranks of `process_group` so that
    every rank ends with sum_i w_i g_i, w_i = n_i / N: the gradient of the mean loss over
    the union of all ranks' samples, however unevenly they were split.

    Each bucket of gradients (about `bucket_cap_mb` MB) is packed onto the wire with
    the weight fused in, its all-reduce is launched at once so packing the next bucket
    overlaps it, and it is unpacked with the loss scale removed, the overflow check
    and the squared norm fused in.

    Args:
        params: the parameters, in the same order on every rank (checked at the first reduce).
        process_group: the group to reduce over (default: the world).
        wire_dtype: float32, float16 or bfloat16 (not on Gloo). A 16-bit wire halves the bytes;
            use a loss scale with float16 so small gradients do not underflow.
        bucket_cap_mb: gradient megabytes per all-reduce.
        timeout: how long to wait for any collective before raising CollectiveTimeout
            (default: the process group's own timeout).
    """

    who = "hetcomm.WeightedReducer"

    def __init__(self, params: Iterable[torch.nn.Parameter], process_group=None,
                 wire_dtype: torch.dtype = torch.float16, bucket_cap_mb: float = 25.0,
                 timeout: timedelta | None = None):
        if not dist.is_initialized():
            raise RuntimeError(f"{self.who}: torch.distributed is not initialised; call "
                               f"dist.init_process_group first (torchrun sets up its environment)")
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError(f"{self.who}: params holds no parameter that requires grad")
        if bucket_cap_mb <= 0:
            raise ValueError(f"{self.who}: bucket_cap_mb must be positive; got {bucket_cap_mb}")
        self.group = process_group
        check_wire_dtype(wire_dtype, process_group, self.who)
        self.wire_dtype = wire_dtype
        self.timeout = timeout
        self.buckets: list[Bucket] = make_buckets(self.params, int(bucket_cap_mb * 2**20))
        self._layout_checked = False

    def reduce(self, weight: float | None = None, *, count: float | None = None,
               loss_scale: float | Tensor | None = None) -> ReduceResult:
        """Reduces the gradients in place (`p.grad`) and returns what it found.

        Args:
            weight: this rank's share n_i / N of the global batch; the weights of all ranks
                must add up to 1.
            count: instead of weight, this rank's n_i (samples, or tokens that carry loss);
                N is obtained with one tiny all-reduce.
            loss_scale: the factor the local gradients carry (the loss was multiplied by
                it before backward); divided out while unpacking.

        A parameter whose grad is None on this rank contributes zeros; one whose grad is
        None on every rank keeps grad None, as under DDP.
        """
        if (weight is None) == (count is None):
            raise ValueError(f"{self.who}.reduce: pass exactly one of weight= and count=")
        device = self.params[0].device
        if not self._layout_checked:
            check_same_layout(self.params, self.group, self.timeout, self.who)
            self._layout_checked = True
        used_here = [p.grad is not None for p in self.params]
        share = agree_share(float(weight if count is None else count), count is not None, self.group,
                            self.timeout, self.who, used_here)
        self._prepare_grads()

        scale = scalar_on(share.weight, device)
        inv_loss_scale = scalar_on(1.0, device) if loss_scale is None else scalar_on(loss_scale, device).reciprocal()
        found_inf = torch.zeros(1, device=device)
        sq_norm = torch.zeros(1, device=device)
        pending = []
        for bucket in self.buckets:
            grads = [p.grad for p in bucket.params]
            if bucket.wire is None:
                bucket.wire = torch.empty(bucket.numel, dtype=self.wire_dtype, device=bucket.params[0].device)
            ops.pack(grads, scale, out=bucket.wire)
            pending.append(launch_all_reduce(bucket.wire, self.group))
        for index, (bucket, work) in enumerate(zip(self.buckets, pending)):
            wait(work, self.timeout, f"{self.who}: the all-reduce of bucket {index}")
            ops.unpack_(bucket.wire, [p.grad for p in bucket.params], inv_loss_scale, found_inf, sq_norm)
        for p, used in zip(self.params, share.used_anywhere):
            if not used:
                p.grad = None
        return ReduceResult(found_inf=found_inf, grad_norm=sq_norm.sqrt(), weight=share.weight,
                            total=share.total)

    def _prepare_grads(self) -> None:
        """Gives zeros to parameters without a gradient here, and makes every gradient
        contiguous (the packing kernels read them as flat memory)."""
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p, memory_format=torch.contiguous_format)
            elif not p.grad.is_contiguous():
                p.grad = p.grad.contiguous()
