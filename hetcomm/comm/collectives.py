"""The small collective steps around the gradient all-reduce: where control tensors
live, waiting with a deadline, and checks that every rank agrees on."""

import hashlib
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor


class CollectiveTimeout(TimeoutError):
    """A collective did not complete in time: a rank died, stalled, or never called in."""


class LayoutMismatch(RuntimeError):
    """The ranks' parameter lists differ; reducing them would mix unrelated gradients."""


def control_device(group) -> torch.device:
    """Where small control tensors go: NCCL reduces only CUDA tensors, Gloo prefers CPU ones."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def launch_all_reduce(tensor: Tensor, group, op=dist.ReduceOp.SUM):
    return dist.all_reduce(tensor, op=op, group=group, async_op=True)


def wait(work, timeout: timedelta | None, what: str) -> None:
    """Waits for an async collective; a timeout or a vanished peer becomes a
    CollectiveTimeout that says what was being waited for, and whether the deadline
    passed or a peer's connection failed before it."""
    start = time.monotonic()
    try:
        if timeout is None:
            work.wait()
        else:
            work.wait(timeout)
    except RuntimeError as error:
        text = str(error).lower()
        if any(word in text for word in ("timeout", "timed out", "connection closed", "connection reset",
                                          "broken pipe", "aborted")):
            waited = time.monotonic() - start
            if timeout is not None and waited >= 0.9 * timeout.total_seconds():
                happened = f"not every rank answered within {timeout.total_seconds():g} s"
            else:
                happened = f"a peer's connection failed after {waited:.1f} s"
            # The backend's own text (a source path, an address) stays in the chained error, which
            # a traceback (`--debug`) shows: the one line names what was waited for and how it ended.
            raise CollectiveTimeout(
                f"{what}: {happened}. A rank may have died, stalled or not called in the same collective; "
                f"the process group must be rebuilt."
            ) from error
        raise


def launch_gather_floats(values, group=None) -> tuple[object, Tensor]:
    """Starts gathering every rank's row of numbers onto every rank: one SUM all-reduce
    of a float64 [world, len(values)] table in which each rank fills its own row, so the
    rows arrive exactly as sent. Returns the collective's work and the table, which
    holds the rows once the work is done. Every rank must pass as many values."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    table = torch.zeros(world, len(values), dtype=torch.float64)
    table[rank] = torch.tensor([float(v) for v in values], dtype=torch.float64)
    table = table.to(control_device(group))
    return launch_all_reduce(table, group), table


def gather_floats(values, group=None) -> list[list[float]]:
    """Every rank's row of numbers, on every rank (launch_gather_floats, waited for)."""
    work, table = launch_gather_floats(values, group)
    work.wait()
    return table.tolist()


def layout_fingerprint(params) -> int:
    """A 62-bit digest of the parameters' count, order, shapes and dtypes."""
    digest = hashlib.sha256()
    for p in params:
        digest.update(f"{tuple(p.shape)}:{p.dtype};".encode())
    return int.from_bytes(digest.digest()[:8], "little") >> 2


def check_same_layout(params, group, timeout: timedelta | None, who: str, gather_size: int = 0,
                      settings: dict[str, tuple[int, str]] | None = None) -> None:
    """Raises LayoutMismatch on every rank if any two ranks' parameter lists, the sizes
    of what they gather along with the weights, or their `settings` (name -> a number
    to compare and this rank's setting in words) differ."""
    mine = layout_fingerprint(params)
    settings = settings or {}
    codes = [code for code, _ in settings.values()]
    # MAX of (x, -x) gives the largest and the negated smallest value in one call.
    values = [mine, len(params), gather_size, *codes]
    probe = torch.tensor([v for value in values for v in (value, -value)], dtype=torch.int64,
                         device=control_device(group))
    wait(launch_all_reduce(probe, group, dist.ReduceOp.MAX), timeout, f"{who}: the parameter layout check")
    largest, smallest, most, fewest = probe[0].item(), -probe[1].item(), probe[2].item(), -probe[3].item()
    if probe[4].item() != -probe[5].item():
        raise LayoutMismatch(f"{who}: the ranks' gather_size differs (between {-probe[5].item()} and "
                             f"{probe[4].item()}; this rank has {gather_size}); every rank must gather as many values")
    if largest != smallest:
        raise LayoutMismatch(
            f"{who}: the ranks' parameter lists differ (between {fewest} and {most} parameters; shapes, "
            f"dtypes or order differ). Every rank must pass the same model's parameters in the same order; "
            f"this rank has {len(params)} (layout digest {mine:x}).")
    for k, (name, (_, words)) in enumerate(settings.items(), start=3):
        if probe[2 * k].item() != -probe[2 * k + 1].item():
            raise LayoutMismatch(f"{who}: the ranks' {name} differs (this rank: {words}); every rank must "
                                 f"construct the reducer with the same settings")
