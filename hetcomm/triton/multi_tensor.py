"""Tensor lists turned into the row table of kernels.py, and the launches over it.

A call becomes a list of segments (one per tensor: source and destination address,
dtypes, element count). Segments are grouped by their (source, destination) dtype
pair, since a pointer's element type is fixed when a kernel is compiled, and each
group is cut into rows of at most CHUNK elements. All rows go into one int64 table,
copied to the device once per list (plan_cache keeps the plan for the next call with
the same tensors); each dtype group is then one launch over its rows. A call
therefore costs at most three scale-and-cast launches (one per dtype present),
whatever the number of tensors.
"""

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from hetcomm.triton import configs, kernels, plan_cache

# Elements per row at most. A 4M-element gradient makes 256 programs, enough to fill
# the SMs of the largest GPUs targeted; the table costs 24 bytes per CHUNK elements.
# CHUNK times any element size is a multiple of 16, so rows keep their tensor's
# alignment.
CHUNK = 16384

_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}

# The launches that may be timed (see configs for which): once per key on first use.
# The check and sum flags are in the key: they change the registers a program needs.
_scale_cast_rows_tuned = triton.autotune(
    configs=list(configs.CONFIGS),
    key=["size_class", "SRC", "DST", "ALIGNED", "CHECK_INPUT", "CHECK_OUTPUT", "SUM_SQ"])(kernels.scale_cast_rows)

PLANS = plan_cache.PlanCache()


class Segment(NamedTuple):
    """numel elements read from address src, written to address dst. Plain values, no
    tensors: segments are the plan cache's keys (see plan_cache)."""
    src: int
    dst: int
    src_dtype: torch.dtype
    dst_dtype: torch.dtype
    numel: int


def segment(src: Tensor, dst: Tensor, src_offset: int, dst_offset: int, numel: int) -> Segment:
    """numel elements of src from element src_offset to dst from element dst_offset."""
    return Segment(src.data_ptr() + src_offset * src.element_size(), dst.data_ptr() + dst_offset * dst.element_size(),
                   src.dtype, dst.dtype, numel)


@dataclass(frozen=True)
class Launch:
    src_dtype: torch.dtype
    dst_dtype: torch.dtype
    first_row: int
    rows: int
    aligned: bool  # every address of these rows is 16-byte aligned


@dataclass(frozen=True)
class Plan:
    table: Tensor  # int64 [rows, 3] on the device: source address, destination address, count
    launches: tuple[Launch, ...]
    rows: int


def check_device(op: str, device: torch.device) -> None:
    """Fails, naming the GPU or the reason, where these kernels cannot run."""
    if kernels.INTERPRETED:
        if device.type != "cpu":
            raise RuntimeError(f"hetcomm.{op}: Triton runs in its interpreter in this process (TRITON_INTERPRET=1), "
                               f"which runs the triton back end on CPU tensors only; got {device.type} tensors")
    elif device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if major < 7:
            raise RuntimeError(f"hetcomm.{op}: the triton back end needs a GPU of compute capability 7.0 or newer "
                               f"(Triton's minimum), but {device} is a {torch.cuda.get_device_name(device)} "
                               f"(sm_{major}{minor}); use backend='native' (hetcomm's CUDA kernels) on this GPU")
    elif device.type == "cpu":
        raise RuntimeError(f"hetcomm.{op}: the triton back end runs on CUDA tensors (and on CPU tensors only "
                           f"under TRITON_INTERPRET=1); use backend='native' for CPU tensors")
    else:
        raise NotImplementedError(f"hetcomm.{op}: the triton back end has no kernel for {device.type} tensors")


def _rows(segments: Sequence[Segment]) -> Tensor:
    """The rows of one dtype group, built with a few tensor operations rather than a
    Python loop over chunks (a large model has thousands)."""
    src_size, dst_size = segments[0].src_dtype.itemsize, segments[0].dst_dtype.itemsize
    src = torch.tensor([s.src for s in segments], dtype=torch.int64)
    dst = torch.tensor([s.dst for s in segments], dtype=torch.int64)
    numel = torch.tensor([s.numel for s in segments], dtype=torch.int64)
    chunks = (numel + CHUNK - 1) // CHUNK
    owner = torch.repeat_interleave(torch.arange(len(segments)), chunks)
    first_chunk = torch.cumsum(chunks, 0) - chunks
    start = (torch.arange(owner.numel()) - first_chunk[owner]) * CHUNK
    count = torch.clamp(numel[owner] - start, max=CHUNK)
    return torch.stack([src[owner] + start * src_size, dst[owner] + start * dst_size, count], dim=1)


def plan(segments: Sequence[Segment], device: torch.device) -> Plan:
    """The plan of these segments on device: from PLANS, or built (and kept) there.

    Empty tensors are left out of the key: they are not planned, and their addresses
    may change from call to call. The stream is in it for CUDA: a table is copied on
    the current stream and, once evicted, freed through the caching allocator, which
    reuses a block on the stream that allocated it; so every launch that reads a
    table must run on that stream, after the copy and before the reuse.
    """
    live = tuple(s for s in segments if s.numel > 0)
    stream = torch.cuda.current_stream(device).stream_id if device.type == "cuda" else None
    return PLANS.get((device, stream, live), lambda: _build(live, device))


def _build(segments: Sequence[Segment], device: torch.device) -> Plan:
    groups: dict[tuple[torch.dtype, torch.dtype], list[Segment]] = {}
    for s in segments:
        groups.setdefault((s.src_dtype, s.dst_dtype), []).append(s)
    tables, launches, first_row = [], [], 0
    for (src_dtype, dst_dtype), group in groups.items():
        rows = _rows(group)
        aligned = bool((rows[:, :2] % 16 == 0).all())
        launches.append(Launch(src_dtype, dst_dtype, first_row, rows.shape[0], aligned))
        tables.append(rows)
        first_row += rows.shape[0]
    table = torch.cat(tables) if tables else torch.empty((0, 3), dtype=torch.int64)
    if device.type == "cuda":
        # From pinned memory, so the copy does not wait for the GPU; the caching host
        # allocator keeps the buffer until the copy has run.
        table = table.pin_memory().to(device, non_blocking=True)
    return Plan(table, tuple(launches), first_row)


def _on(device: torch.device):
    """Triton launches on the current CUDA device: make it the tensors' one."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def run(plan: Plan, scale: Tensor, *, found_inf: Tensor | None = None, partials: Tensor | None = None,
        check_input: bool = False, check_output: bool = False, tune: bool = False) -> None:
    """One scale-and-cast launch per dtype group of the plan.

    found_inf is set to 1 on a non-finite input (check_input) or output (check_output);
    partials[row] receives each row's sum of squares when given. tune=True picks the
    launch shape by timing (safe only for ops that can be rerun on the same data).
    """
    device = scale.device
    with _on(device):
        for launch in plan.launches:
            args = (plan.table, launch.first_row, scale, found_inf, partials, launch.rows.bit_length())
            meta = dict(SRC=_TL_DTYPES[launch.src_dtype], DST=_TL_DTYPES[launch.dst_dtype], ALIGNED=launch.aligned,
                        CHECK_INPUT=check_input, CHECK_OUTPUT=check_output, SUM_SQ=partials is not None)
            grid = (launch.rows,)
            if tune and not kernels.INTERPRETED:
                _scale_cast_rows_tuned[grid](*args, **meta)
            else:
                kernels.scale_cast_rows[grid](*args, **meta, **configs.default_config(device).all_kwargs())


def add_sum(partials: Tensor, count: int, sq_norm: Tensor) -> None:
    """sq_norm += the fixed-order sum of partials[0:count]."""
    with _on(sq_norm.device):
        kernels.add_sum[(1,)](partials, count, sq_norm, BLOCK=1024, num_warps=4)
