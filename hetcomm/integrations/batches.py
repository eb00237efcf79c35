"""The batches a framework's data loader draws on each rank, balanced by speed: each
optimizer step's global batch dealt by the current split (one permutation per epoch,
nothing dropped or repeated), cut into the same number of micro-batches on every rank,
each rank timed, and the split rebalanced while training. Knows nothing of any framework:
the integrations call step_started / compute_done / step_finished around each step."""

import logging
import math
from itertools import accumulate
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist

from hetcomm.balance import (DistributedRebalancer, Rebalancer, WeightedDistributedSampler, equal_split, solve_split,
                             wait_for_compute)
from hetcomm.balance.profile import TimedSteps
from hetcomm.balance.rebalancer import THRESHOLD, TRAINING_SETTINGS
from hetcomm.comm.collectives import gather_floats
from hetcomm.integrations.settings import check_settings

# The step whose times give the first split: the first one's hold one-time costs. On the
# simulated cluster (speeds 1,1,0.5,0.25), the first step's times split 16 as [9, 4, 2, 1].
TIMED_STEP = 1
logger = logging.getLogger("hetcomm")
if not logger.handlers:
    # The split's changes are a line on rank 0's stderr, as Trainer's own progress is. To route
    # them elsewhere: logging.getLogger("hetcomm").handlers.clear(), propagate = True.
    logger.addHandler(logging.StreamHandler())
    logger.setLevel(logging.INFO)
    logger.propagate = False


class BalancedBatches(TimedSteps):
    """A DataLoader's batch_sampler: yields this rank's micro-batches (lists of dataset
    indices), `accumulation` of them for every optimizer step on every rank, their
    sizes adding up to the rank's share of the step.

    Every rank builds one alike (same dataset size, global batch, seed). A new split
    takes effect `steps_ahead` steps after it is decided, on every rank at the same
    step, so that a loader whose workers draw batches ahead deals them by the split
    every rank uses (loader_steps_ahead gives the number for a loader's settings).

    Args:
        dataset_size: samples in the dataset.
        global_batch: samples per optimizer step over all ranks.
        accumulation: micro-batches per optimizer step on every rank; every rank's share
            is at least this, so that no micro-batch is empty.
        balance: "dynamic" (split from the second step's timing, rebalanced while
            training), "static" (from the second step's timing only) or "equal".
        split: a fixed split, one count per rank (no balancing).
        max_micro_batch: the largest micro-batch a rank can hold, one for all or one per
            rank (None: no cap); a rank's share is at most accumulation times it.
        seed, drop_last: the permutation's seed; whether an epoch's leftover samples
            (fewer than a global batch) are left out instead of forming a smaller step.
        rebalance_threshold: adopt a new split only for this much less predicted time.

    Every argument is checked here (TypeError, ValueError naming it): see
    hetcomm.integrations.settings. A step's compute is timed by BalancedBatches.clock,
    which BalancedLoop shares (hetcomm.balance.profile.TimedSteps).
    """

    def __init__(self, dataset_size: int, global_batch: int, *, accumulation: int = 1, balance: str = "dynamic",
                 split: Sequence[int] | None = None, max_micro_batch: int | Sequence[int] | None = None,
                 seed: int = 0, drop_last: bool = False, steps_ahead: int = 0,
                 rebalance_threshold: float = THRESHOLD, who: str = "hetcomm"):
        distributed = dist.is_available() and dist.is_initialized()
        self.rank, self.world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
        self.who = who
        self.fixed, caps = check_settings(dataset_size, global_batch, self.world, accumulation=accumulation,
                                          balance=balance, split=split, max_micro_batch=max_micro_batch, seed=seed,
                                          drop_last=drop_last, steps_ahead=steps_ahead,
                                          rebalance_threshold=rebalance_threshold, who=who)
        self.global_batch, self.accumulation, self.balance = global_batch, accumulation, balance
        self.steps_ahead = steps_ahead
        self.max_micro_batch = None if caps is None else [c // accumulation for c in caps]
        start = self.fixed or _start_split(global_batch, self.world, caps, accumulation)
        self.sampler = WeightedDistributedSampler(dataset_size, start, self.rank, seed=seed, drop_last=drop_last)
        self.rebalancer = None
        if not self.fixed and balance != "equal" and self.world > 1:
            self.rebalancer = DistributedRebalancer(Rebalancer(
                global_batch, start, memory_caps=caps, policy="move" if caps else "accumulate",
                min_per_rank=accumulation, threshold=rebalance_threshold, review_first=balance == "dynamic",
                **TRAINING_SETTINGS))
        self.caps = caps
        self.drawn = 0                   # steps drawn so far (the next one's number)
        self.positions: dict[int, tuple[int, int, tuple[int, ...]]] = {}   # step -> epoch, cursor, split before it
        self.shares: dict[int, tuple[int, ...]] = {}   # step -> every rank's samples in it
        self.scheduled: dict[int, tuple[int, ...]] = {}  # step -> split from then on, not yet drawn
        self.placeholders = 0            # empty micro-batches to yield first, for a loader that skips them
        self.finished = 0                # steps whose timing is in
        self.started: float | None = None
        self.computed: float | None = None
        self.device: torch.device | None = None   # the gradients' device, as the hook reports it

    # --- what the data loader draws ---------------------------------------------------

    def __len__(self) -> int:
        return self.sampler.steps_per_epoch * self.accumulation

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def __iter__(self) -> Iterator[list[int]]:
        """The micro-batches from the current position to the end of its epoch (from the
        next epoch's start when the current one is done), after any placeholders."""
        while self.placeholders:
            self.placeholders -= 1
            yield []
        while True:
            for part in self._cut(self._draw_step()):
                yield part
            if self.sampler.cursor == self.sampler.samples_per_epoch:
                return

    def _draw_step(self) -> list[int]:
        step = self.drawn
        for at in sorted(k for k in self.scheduled if k <= step):
            self.sampler.set_split(self.scheduled.pop(at))
        self.positions[step] = (self.sampler.epoch, self.sampler.cursor, self.sampler.sizes)
        indices = self.sampler.draw(minimum=self.accumulation)
        self.shares[step] = self.sampler.drawn_shares
        for old in [k for k in self.positions if k < step - 4 * (self.steps_ahead + 2)]:
            del self.positions[old], self.shares[old]
        self.drawn += 1
        return indices

    def _cut(self, indices: list[int]) -> list[list[int]]:
        """A share cut into `accumulation` micro-batches, as even as integers allow."""
        sizes = equal_split(len(indices), self.accumulation)
        return [indices[end - size: end] for size, end in zip(sizes, accumulate(sizes))]

    # --- around each optimizer step ----------------------------------------------------

    @property
    def split(self) -> tuple[int, ...]:
        """The split of the step now running (the last one drawn if none runs)."""
        return self.shares.get(self.finished, self.sampler.sizes)

    def step_started(self) -> None:
        self._device_done()   # the previous step's optimizer work is not this step's
        self.started, self.computed = self.clock(), None

    def compute_done(self, device: torch.device | None = None) -> None:
        """This rank's compute of the step is done (the integrations' DDP hook calls it at
        the last gradient bucket, or at the first when an agreement there waits for the
        other ranks, with the gradients' device); the first call counts."""
        if self.computed is None:
            if device is not None:
                self.device = device
            self._device_done()
            self.computed = self.clock()

    def _device_done(self) -> None:
        """Waits for this rank's GPU (its compute stream). Kernels run behind the host: at
        the last bucket the host has only queued the backward, and a slow card's queue is
        the longer one, so the host's clock alone would split by how fast the hosts launch
        kernels. Not the whole device: the earlier buckets' all-reduces wait for the other
        ranks, and a fast rank would count a slow one's backward as its own. The wait
        costs little at the last bucket, whose reduction needs that backward anyway, and
        none is paid in a step that is not timed. The first step is not, so the device the
        hook reports then serves from the second step's start on."""
        if self._timed(self.finished):
            wait_for_compute(self.device)

    def _timed(self, step: int) -> bool:
        """Whether a split is decided from `step`'s times: not from the first step's, which
        hold one-time costs (allocator, thread pools, autotuning)."""
        return self.rebalancer is not None and step > 0 and (self.balance != "static" or step <= TIMED_STEP)

    def step_finished(self) -> None:
        """Every rank's compute time of the step just done, gathered; the split of a later
        step decided from them (the same on every rank). Call on every rank."""
        step = self.finished
        self.finished += 1
        if self.started is None:
            raise RuntimeError(f"{self.who}: step_finished without step_started")
        if self.computed is None:
            self.compute_done()
        seconds = self.computed - self.started
        self.started = None
        if not self._timed(step):
            return
        rows = gather_floats([seconds])
        times = [row[0] for row in rows]
        done = list(self.shares[step])
        if step == TIMED_STEP:
            # The first split from the second step's throughputs; the rebalancer reviews it
            # once its own estimates are in.
            sizes = solve_split(self.global_batch, [(0.0, t / n) for t, n in zip(times, done)], self.caps,
                                self.rebalancer.rebalancer.policy, min_per_rank=self.accumulation).sizes
            self.rebalancer.rebalancer.adopt(sizes)
        else:
            sizes = self.rebalancer.step(seconds, times, done).sizes
        self._schedule(sizes, times)

    def _schedule(self, sizes: tuple[int, ...], times: list[float]) -> None:
        at = self.finished + self.steps_ahead
        latest = self.scheduled[max(self.scheduled)] if self.scheduled else self.sampler.sizes
        if tuple(sizes) == tuple(latest):
            return
        self.scheduled[at] = tuple(sizes)
        if self.rank == 0:
            seconds = " ".join(f"{t:.3g}" for t in times)
            logger.info("%s: split %s of %d from step %d (was %s; compute seconds of step %d by rank: %s)",
                        self.who, list(sizes), self.global_batch, at, list(latest), self.finished - 1, seconds)

    # --- checkpoints ----------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Where the data stands after the steps finished so far (a loader may have drawn
        further), the splits of the steps to come, and the rebalancer's estimates; plain
        JSON-able values, the same on every rank; with the settings that decide which
        samples each step draws, which load_state_dict compares."""
        step = self.finished
        epoch, cursor, sizes = self.positions.get(step, (self.sampler.epoch, self.sampler.cursor,
                                                         self.sampler.sizes))
        coming = {k: list(self.positions[k][2]) for k in range(step + 1, self.drawn)}
        coming.update({k: list(v) for k, v in self.scheduled.items()})
        return {"run": self.settings(), "steps": step,
                "sampler": {**self.sampler.state_dict(), "epoch": epoch, "cursor": cursor, "sizes": list(sizes)},
                "scheduled": {str(k): v for k, v in coming.items() if k > step},
                "rebalancer": self.rebalancer.rebalancer.state_dict() if self.rebalancer else None}

    def settings(self) -> dict:
        """What decides which samples each rank draws at each step: a state goes on only
        in batches built alike."""
        return {"dataset_size": self.sampler.dataset_size, "global_batch": self.global_batch,
                "accumulation": self.accumulation, "world": self.world, "seed": self.sampler.seed,
                "drop_last": self.sampler.drop_last, "balance": self.balance,
                "split": None if self.fixed is None else list(self.fixed), "max_micro_batch": self.max_micro_batch}

    def done_in_epoch(self) -> int:
        """Micro-batches of the current epoch already run (where a resumed run stands)."""
        return self.sampler.cursor // self.global_batch * self.accumulation

    def load_state_dict(self, state: dict, *, skipped_by_loader: bool = False) -> None:
        """Continues where state_dict() was taken, by batches of the same settings()
        (ValueError naming each one that differs).
        skipped_by_loader: the framework skips the micro-batches its epoch has run by
        drawing them from a fresh loader and dropping them (accelerate's
        skip_first_batches): that many empty placeholders come first, which it drops
        without loading anything."""
        saved = state.get("run")
        if not isinstance(saved, dict):
            raise ValueError(f"{self.who}: the balancing state holds no run settings (taken by hetcomm before they "
                             f"were recorded): where its data stood in this run is unknown")
        differences = [f"{key} {saved.get(key)!r} there, {mine!r} here" for key, mine in self.settings().items()
                       if saved.get(key) != mine]
        if differences:
            raise ValueError(f"{self.who}: the balancing state belongs to a run of other settings: "
                             + ", ".join(differences))
        self.sampler.load_state_dict(state["sampler"])
        self.finished = self.drawn = int(state["steps"])
        self.positions, self.shares = {}, {}
        self.scheduled = {int(k): tuple(v) for k, v in state["scheduled"].items()}
        if self.rebalancer is not None and state["rebalancer"] is not None:
            self.rebalancer.rebalancer.load_state_dict(state["rebalancer"])
        self.placeholders = self.done_in_epoch() if skipped_by_loader else 0


def loader_steps_ahead(num_workers: int, prefetch_factor: int | None, accumulation: int) -> int:
    """How many steps past the running one a DataLoader may have drawn: none in the main
    process; with workers, prefetch_factor (default 2) micro-batches per worker."""
    if num_workers == 0:
        return 0
    return math.ceil(num_workers * (prefetch_factor or 2) / accumulation)


def _start_split(global_batch: int, world: int, caps: list[int] | None, accumulation: int) -> tuple[int, ...]:
    """The shares before any timing: equal, or as near it as the caps allow (a card
    must not hold more than its cap on the first steps either)."""
    equal = equal_split(global_batch, world)
    if caps is None or all(b <= c for b, c in zip(equal, caps)):
        return equal
    return solve_split(global_batch, [(0.0, 1.0)] * world, caps, "move", min_per_rank=accumulation).sizes
