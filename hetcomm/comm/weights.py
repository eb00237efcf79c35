"""Agreeing on each rank's weight w_i = n_i / N before any gradient is touched.

Every rank contributes its value and its local verdict to one small SUM all-reduce,
so every rank reaches the same verdict and raises the same error: a bad weight on one
rank never leaves the others hanging in the gradient all-reduce."""

import math
import numbers
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from hetcomm.comm.collectives import control_device, launch_all_reduce, wait

# Weights computed in fp32 by each rank carry ~6e-8 relative error each.
WEIGHT_SUM_TOLERANCE = 1e-6


@dataclass(frozen=True)
class Share:
    """This rank's agreed weight, and the global total it came from."""

    weight: float
    total: float       # N when counts were given, else the sum of the weights (≈ 1)
    by_count: bool
    users: list[int] | None = None  # per parameter, how many ranks had a gradient for it (when asked)
    gathered: list[list[float]] | None = None  # per rank, the values it sent along (when asked)


def local_problem(value: float, by_count: bool, gathered: list, gather_size: int) -> str | None:
    name = "count" if by_count else "weight"
    if not math.isfinite(value):
        return f"{name}={value} is not finite"
    if value < 0:
        return f"{name}={value} is negative"
    if len(gathered) != gather_size:
        return f"gather holds {len(gathered)} values; expected gather_size={gather_size}"
    for k, v in enumerate(gathered):
        # Any float goes through as sent, NaN included (a rank's loss may be one).
        if not isinstance(v, numbers.Real) or isinstance(v, bool):
            return f"gather[{k}] = {v!r} is not a number"
    return None


class Agreement:
    """One launched SUM all-reduce of [value, by_count, a problem flag per rank,
    optionally a has-a-gradient flag per parameter, gather_size values per rank, and
    per rank each setting every rank must share, each rank filling its own]. result()
    waits for it and judges: every rank reaches the same verdict from the same sums. The
    gathered values and settings arrive exactly as sent (each slot is one rank's value
    plus zeros).

    same: settings every rank must pass alike this step (the loss scale the gradients
    carry: unpacked with another rank's scale they would be wrong with no error), by
    name; a value may be a 1-element tensor on the device (no host sync).
    problem: a fault of this rank's call found before the agreement, to raise on every
    rank with the others."""

    def __init__(self, value: float, by_count: bool, group, who: str, used_here: list[bool] | None = None,
                 gathered: list[float] | None = None, gather_size: int = 0,
                 same: dict[str, float | torch.Tensor] | None = None, problem: str | None = None):
        self.value, self.by_count, self.group, self.who = value, by_count, group, who
        self.same = dict(same or {})
        self.world, rank = dist.get_world_size(group), dist.get_rank(group)
        gathered = [] if gathered is None else list(gathered)
        self.problem = problem or local_problem(value, by_count, gathered, gather_size)
        self.settings: dict[str, list[float]] = {}   # per setting, every rank's (known once result() has waited)
        self.used_here = [] if used_here is None else used_here
        self.gather_size = gather_size
        used_end = 2 + self.world + len(self.used_here)
        header = torch.zeros(used_end + self.world * gather_size, dtype=torch.float64)
        header[0] = value if self.problem is None else 0.0
        header[1] = float(by_count)
        header[2 + rank] = float(self.problem is not None)
        header[2 + self.world:used_end] = torch.tensor(self.used_here, dtype=torch.float64)
        if self.problem is None and gather_size:
            start = used_end + rank * gather_size
            header[start:start + gather_size] = torch.tensor(gathered, dtype=torch.float64)
        self.settings_start = used_end + self.world * gather_size
        self.header = torch.cat([header, torch.zeros(self.world * len(self.same), dtype=torch.float64)]).to(
            control_device(group))
        for k, setting in enumerate(self.same.values()):
            # Written where the header lives: a device tensor's value is never read on the host here.
            slot = self.settings_start + k * self.world + rank
            self.header[slot:slot + 1] = torch.as_tensor(setting, dtype=torch.float64).reshape(1).to(
                self.header.device)
        self.work = launch_all_reduce(self.header, group)
        self.counting_ranks: int | None = None  # known once result() has waited

    def result(self, timeout: timedelta | None) -> Share:
        """Raises ValueError on every rank if any rank's value is bad, the ranks mix counts
        and weights, counts add up to zero, or weights do not add up to 1."""
        who, world = self.who, self.world
        wait(self.work, timeout, f"{who}: the agreement on weights")
        header = self.header.cpu()
        total, self.counting_ranks = header[0].item(), round(header[1].item())
        used_end = 2 + world + len(self.used_here)
        users = [round(u) for u in header[2 + world:used_end].tolist()] if self.used_here else None
        gathered = header[used_end:self.settings_start].reshape(world, self.gather_size).tolist() \
            if self.gather_size else None
        settings = header[self.settings_start:].reshape(len(self.same), world).tolist()
        self.settings = dict(zip(self.same, settings))
        bad_ranks = [r for r in range(world) if header[2 + r].item() > 0]
        if bad_ranks:
            detail = f" (here: {self.problem})" if self.problem else ""
            raise ValueError(f"{who}: ranks {bad_ranks} passed an invalid weight, count or gather{detail}; "
                             f"weights and counts must be finite and non-negative, gather must hold "
                             f"gather_size={self.gather_size} values, and reduce()'s expected_total and "
                             f"grad_divisor must be begin()'s")
        if self.mixed:
            raise ValueError(f"{who}: {self.counting_ranks} of {world} ranks passed count= and the others weight=; "
                             f"all ranks must use the same one")
        for name, values in zip(self.same, settings):
            if len(set(values)) > 1:
                each = ", ".join(f"rank {r}: {v:g}" for r, v in enumerate(values))
                raise ValueError(f"{who}: the ranks' {name} differ ({each}); every rank must use the same")
        if self.by_count:
            if total <= 0:
                raise ValueError(f"{who}: the counts add up to {total:g} across {world} ranks; at least one rank "
                                 f"must have processed samples")
            return Share(weight=self.value / total, total=total, by_count=True, users=users, gathered=gathered)
        if abs(total - 1.0) > WEIGHT_SUM_TOLERANCE * max(1, world):
            raise ValueError(f"{who}: the weights add up to {total:.9g} across {world} ranks; expected 1 "
                             f"(pass count= instead to let hetcomm normalise)")
        return Share(weight=self.value, total=total, by_count=False, users=users, gathered=gathered)

    @property
    def others_sent_early(self) -> bool:
        """Some rank passed an expected total, so it sent its buckets before this
        agreement (known after result() waited)."""
        return any(v > 0 for v in self.settings.get("expected totals", []))

    @property
    def mixed(self) -> bool:
        """Some ranks passed count= and others weight= (known after result() waited)."""
        return self.counting_ranks not in (None, 0, self.world)


def agree_share(value: float, by_count: bool, group, timeout: timedelta | None, who: str,
                used_here: list[bool] | None = None, gathered: list[float] | None = None,
                gather_size: int = 0, same: dict[str, float | torch.Tensor] | None = None) -> Share:
    """Agreement(...).result(timeout) in one call."""
    return Agreement(value, by_count, group, who, used_here, gathered, gather_size, same).result(timeout)
