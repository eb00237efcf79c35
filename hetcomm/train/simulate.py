"""Simulated heterogeneity for CPU runs (DESIGN.md): a rank with speed factor s waits
after its compute so that its step takes 1/s of the real compute time, and a card may
start throttling at some step (--slowdown RANK:STEP:FACTOR)."""

import time
from dataclasses import dataclass

from hetcomm.train.per_rank import parse_per_rank


@dataclass(frozen=True)
class Slowdown:
    rank: int
    step: int
    factor: float  # multiplies the rank's speed from `step` on (0.5: twice as slow)


def parse_speeds(text: str, world_size: int) -> list[float]:
    """"1,1,0.5,0.25" -> one positive speed factor per rank."""
    speeds = parse_per_rank("--speeds", text, world_size, float, "1,1,0.5,0.25")
    if not all(0 < s <= 1000 for s in speeds):
        raise ValueError(f"--speeds {text!r}: every factor must be positive (1 = the machine's real speed)")
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
    if slowdown.step < 0 or not 0 < slowdown.factor <= 1000:
        raise ValueError(f"--slowdown {text!r}: the step must be >= 0 and the factor positive")
    return slowdown


@dataclass
class SimulatedSpeed:
    """This rank's simulated speed over the run."""

    rank: int
    speed: float
    slowdowns: tuple[Slowdown, ...] = ()

    def factor(self, step: int) -> float:
        factor = self.speed
        for s in self.slowdowns:
            if s.rank == self.rank and step >= s.step:
                factor *= s.factor
        return factor

    def stretch(self, step: int, real_seconds: float) -> None:
        """Waits so that a compute phase of real_seconds takes real_seconds / factor."""
        extra = real_seconds * (1.0 / self.factor(step) - 1.0)
        if extra > 0:
            time.sleep(extra)
