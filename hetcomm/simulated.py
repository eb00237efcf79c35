"""Simulated heterogeneity for CPU runs (DESIGN.md): a rank with speed factor s waits
after its compute so that the compute takes 1/s of the time it needed, and a card may
start throttling at some step (--slowdown RANK:STEP:FACTOR).

On CPU the time a compute "needed" is the CPU time the worker got for it, over its
threads, not its wall time. The simulated ranks share one machine's cores, so a rank's
wall time depends on which other ranks compute at the same moment, and the stretch
multiplies that: a rank of speed 1/8 that waited 50 ms for a core would lose 400 ms.
Its own CPU time is what it takes on cores of its own, as a card of its own would: the
simulated speeds stay what they were set to whatever split the balancer picks. A GPU is
a device of its own, and its compute is timed by the wall clock.
"""

import os
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from hetcomm.per_rank import parse_per_rank


# The share of the machine's cores a simulated cluster may keep busy at most.
CORE_SHARE = 0.75
# The largest speed factor taken: one above 1 already runs at the machine's real speed,
# so a cap loses nothing and keeps inf (and NaN) out.
MAX_FACTOR = 1000


def fit_to_cores(relative: Sequence[float], cores: int, share: float = CORE_SHARE) -> list[float]:
    """`relative` speed factors scaled down (never up) until the ranks keep at most
    `share` of `cores` busy. A rank of speed s computes for s of its step, so together
    they need sum(s) cores; 4 ranks of speeds 1, 1, 0.5, 0.25 want 2.75, and on 2 cores
    they would wait for one another's cores as no cluster of separate cards does."""
    scale = min(1.0, share * cores / sum(relative))
    return [scale * s for s in relative]


def speeds_for_this_machine(relative: Sequence[float]) -> str:
    """The --speeds text for `relative` speed factors fitted to this machine's cores."""
    return ",".join(f"{s:.4g}" for s in fit_to_cores(relative, os.cpu_count() or 1))


@dataclass(frozen=True)
class Slowdown:
    rank: int
    step: int
    factor: float  # multiplies the rank's speed from `step` on (0.5: twice as slow)


def parse_speeds(text: str, world_size: int) -> list[float]:
    """"1,1,0.5,0.25" -> one positive speed factor per rank."""
    speeds = parse_per_rank("--speeds", text, world_size, float, "1,1,0.5,0.25")
    if not all(0 < s <= MAX_FACTOR for s in speeds):   # also false for NaN
        raise ValueError(f"--speeds {text!r}: every factor must be a number in (0, {MAX_FACTOR}] (1 = the "
                         f"machine's real speed)")
    return speeds


def parse_slowdown(text: str, world_size: int) -> Slowdown:
    """"RANK:STEP:FACTOR", e.g. "2:30:0.5": rank 2 runs at half its speed from step 30."""
    parts = text.split(":")
    try:
        if len(parts) != 3:
            raise ValueError
        slowdown = Slowdown(int(parts[0]), int(parts[1]), float(parts[2]))
    except ValueError:
        raise ValueError(f"--slowdown {text!r}: expected RANK:STEP:FACTOR such as 2:30:0.5") from None
    if not 0 <= slowdown.rank < world_size:
        raise ValueError(f"--slowdown {text!r}: rank {slowdown.rank} does not exist ({world_size} ranks)")
    if slowdown.step < 0 or not 0 < slowdown.factor <= MAX_FACTOR:   # also false for NaN
        raise ValueError(f"--slowdown {text!r}: the step must be >= 0 and the factor a number in (0, {MAX_FACTOR}]")
    return slowdown


def _cpu_seconds_per_thread() -> float:
    """The compute's CPU time. With one intra-op thread it all runs on the calling thread
    (CPU autograd included), whose own clock leaves out Gloo's threads: their CPU while
    the rank sleeps off its stretch would otherwise be owed again, 1/factor times over,
    at every settle (a rank at speed 0.005 never woke up)."""
    threads = torch.get_num_threads()
    return time.thread_time() if threads == 1 else time.process_time() / threads


@dataclass
class SimulatedSpeed:
    """This rank's simulated speed over the run."""

    rank: int
    speed: float
    slowdowns: tuple[Slowdown, ...] = ()
    device_type: str = "cpu"

    def factor(self, step: int) -> float:
        factor = self.speed
        for s in self.slowdowns:
            if s.rank == self.rank and step >= s.step:
                factor *= s.factor
        return factor

    @contextmanager
    def compute(self, step: int, waited: Callable[[], float] | None = None) -> Iterator[Callable[[], None]]:
        """Around a compute phase of `step`: afterwards, waits until the phase has taken
        the time it needed divided by the speed factor. It yields a settle() that does
        the same for the phase so far, so that a time read within the phase (the
        handoff's timed forward) is at the simulated speed too, and so that the stretch
        is paid as the compute goes (BalancedLoop settles after every leaf module's
        forward and every gradient, as a slower device is slower at each operation).
        Both count from the phase's start, so a wait for a core early in the phase still
        counts against the stretch owed later, as with no settle at all. A factor above 1
        cannot make it faster than it was. `waited`: the seconds spent blocked on other
        ranks so far (sharded weights' gathers), which a slower device spends idle, not
        computing: they count as neither compute nor stretch."""
        clock: Callable[[], float] = _cpu_seconds_per_thread if self.device_type == "cpu" else time.perf_counter
        wall, needed = time.perf_counter(), clock()
        idle = waited() if waited is not None else 0.0

        def settle() -> None:
            blocked = waited() - idle if waited is not None else 0.0
            remaining = (clock() - needed) / self.factor(step) - (time.perf_counter() - wall - blocked)
            if remaining > 0:
                time.sleep(remaining)

        yield settle
        settle()


def stretch_as_it_goes(model: torch.nn.Module, params: list[torch.nn.Parameter], settle: Callable[[], None]) -> None:
    """Has a simulated speed's stretch paid as the compute goes, after each leaf module's
    forward and each gradient's accumulation, as a slower device is slower at every
    operation, instead of all at the end of a compute phase. Paid at the end, every rank
    started a step computing at once and then slept: on the benchmark's 4 ranks on 2 cores
    the slowest rank's compute ran 3.8-6.5% over its median a run, 0.7-3.7% paid as it goes."""
    for module in model.modules():
        if next(module.children(), None) is None:
            module.register_forward_hook(lambda *_: settle())
    for p in params:
        p.register_post_accumulate_grad_hook(lambda _: settle())
