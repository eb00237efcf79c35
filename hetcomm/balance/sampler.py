"""A distributed sampler for unequal, changing per-rank batches: one global
permutation per epoch, dealt out one optimizer step at a time by the current split."""

from collections.abc import Iterator, Sequence

import torch


def proportional_shares(sizes: Sequence[int], total: int) -> tuple[int, ...]:
    """`total` samples split in proportion to `sizes` by largest remainders: each rank
    gets floor(total·b_i/B), and the samples left go one each to the largest fractional
    parts, ties to lower ranks. Integer arithmetic, so exact."""
    batch = sum(sizes)
    shares = [total * b // batch for b in sizes]
    by_remainder = sorted(range(len(sizes)), key=lambda i: (-(total * sizes[i] % batch), i))
    for i in by_remainder[: total - sum(shares)]:
        shares[i] += 1
    return tuple(shares)


class WeightedDistributedSampler:
    """Yields, for each optimizer step, the list of dataset indices this rank
    processes in it (use it as a DataLoader's batch_sampler with num_workers=0, or
    index the dataset directly: the split is read when a step is drawn, so a loader
    that draws steps ahead would deal them by a split that has since changed).

    Every rank builds one with the same dataset_size, split and seed and draws the
    same steps; step s deals the permutation's positions [s·B, s·B + B) in rank order,
    b_0 to rank 0, the next b_1 to rank 1 and so on. So within an epoch no index is
    repeated, every rank runs the same number of optimizer steps, and set_split may
    change the split between any two steps (on every rank alike).

    The last global batch of an epoch holds the R = dataset_size mod B samples left
    over (when R > 0): by default they form a smaller final step, split in proportion
    to the current split (proportional_shares; a rank may get 0 when R is smaller than
    the number of ranks), so no sample is dropped. Weighting each rank's gradient by
    n_i / N keeps that step's gradient the exact mean over its R samples. With
    drop_last=True they are skipped instead: every step is full, and the permutation
    changes each epoch so other samples sit out each time.

    After the last step of an epoch the sampler moves on to the next epoch by itself;
    set_epoch(e) jumps to the start of epoch e unless it is the current one (so a
    resumed sampler keeps its place in the usual `set_epoch(epoch)` loop).

    A full step may also be dealt in parts with take(shares): each part deals the next
    sum(shares) positions in rank order, and the parts must make up the global batch
    before the next step is drawn (the trainer times an equal part of its first step,
    then deals the rest by the speeds that timing shows).
    """

    def __init__(self, dataset_size: int, sizes: Sequence[int], rank: int, *, seed: int = 0,
                 drop_last: bool = False):
        if isinstance(dataset_size, bool) or not isinstance(dataset_size, int) or dataset_size < 1:
            raise ValueError(f"dataset_size = {dataset_size!r}: expected a positive integer")
        _check_split(sizes)
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < len(sizes):
            raise ValueError(f"rank = {rank!r}: expected an integer in [0, {len(sizes)}) for a split of "
                             f"{len(sizes)} ranks")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed = {seed!r}: expected an integer")
        if drop_last and dataset_size < sum(sizes):
            raise ValueError(f"dataset_size = {dataset_size} is smaller than the global batch {sum(sizes)}: with "
                             f"drop_last=True an epoch would have no step")
        self.dataset_size, self.rank, self.seed, self.drop_last = dataset_size, rank, seed, drop_last
        self.sizes = tuple(sizes)
        self.global_batch = sum(sizes)
        self.epoch = 0
        self.cursor = 0    # permutation positions already dealt in this epoch
        self.partial = 0   # positions of the current step dealt so far by take()
        self._drawn: tuple[torch.Tensor, int, tuple[int, ...]] | None = None  # the last step: order, start, shares
        self._permutation: tuple[int, torch.Tensor] | None = None

    @property
    def steps_per_epoch(self) -> int:
        full, rest = divmod(self.dataset_size, self.global_batch)
        return full + int(rest > 0 and not self.drop_last)

    @property
    def samples_per_epoch(self) -> int:
        return self.dataset_size if not self.drop_last else self.dataset_size // self.global_batch * self.global_batch

    def __len__(self) -> int:
        return self.steps_per_epoch

    def set_split(self, sizes: Sequence[int]) -> None:
        """The split for the steps drawn from now on; the global batch cannot change."""
        _check_split(sizes)
        if len(sizes) != len(self.sizes) or sum(sizes) != self.global_batch:
            raise ValueError(f"sizes = {list(sizes)}: expected {len(self.sizes)} entries adding up to the global "
                             f"batch {self.global_batch}, which stays fixed")
        self.sizes = tuple(sizes)

    def set_epoch(self, epoch: int) -> None:
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"epoch = {epoch!r}: expected a non-negative integer")
        if epoch != self.epoch:
            self.epoch, self.cursor = epoch, 0

    def permutation(self) -> torch.Tensor:
        """This epoch's order of the dataset, the same on every rank (seeded by seed + epoch)."""
        if self._permutation is None or self._permutation[0] != self.epoch:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            self._permutation = (self.epoch, torch.randperm(self.dataset_size, generator=generator))
        return self._permutation[1]

    def take(self, shares: Sequence[int]) -> list[int]:
        """This rank's indices of the next sum(shares) positions of the current step,
        dealt by `shares` in rank order: one part of a step dealt in parts. Only full
        steps can be dealt in parts."""
        _check_split(shares)
        if len(shares) != len(self.sizes):
            raise ValueError(f"shares = {list(shares)}: expected one count per rank ({len(self.sizes)})")
        if self.cursor + self.global_batch > self.samples_per_epoch:
            raise ValueError("take: the current step is the epoch's last, smaller one; only full steps can be "
                             "dealt in parts")
        if self.partial + sum(shares) > self.global_batch:
            raise ValueError(f"shares = {list(shares)}: {self.partial} of this step's {self.global_batch} samples "
                             f"are dealt already, {self.global_batch - self.partial} are left")
        start = self.cursor + self.partial + sum(shares[: self.rank])
        indices = self.permutation()[start: start + shares[self.rank]].tolist()
        self.partial += sum(shares)
        if self.partial == self.global_batch:
            self.cursor, self.partial = self.cursor + self.global_batch, 0
            if self.cursor == self.samples_per_epoch:
                self.epoch, self.cursor = self.epoch + 1, 0
        return indices

    def __iter__(self) -> Iterator[list[int]]:
        if self.partial:
            raise RuntimeError(f"a step dealt in parts is incomplete ({self.partial} of {self.global_batch} "
                               f"samples); take() the rest first")
        while self.cursor < self.samples_per_epoch:
            yield self.draw()
        self.epoch, self.cursor = self.epoch + 1, 0

    def draw(self, minimum: int = 0) -> list[int]:
        """This rank's indices of the next step, moving on to the next epoch first when
        this one is done (a caller that stops iterating at an epoch's end, as a trainer
        that counts its steps does, still starts the next epoch where it should). On an
        epoch's smaller last step every rank gets `minimum` samples first and the rest
        in proportion to the split: a framework that runs the same number of
        micro-batches on every rank needs one sample for each."""
        if self.partial:
            raise RuntimeError(f"a step dealt in parts is incomplete ({self.partial} of {self.global_batch} "
                               f"samples); take() the rest first")
        if self.cursor == self.samples_per_epoch:
            self.epoch, self.cursor = self.epoch + 1, 0
        batch = min(self.global_batch, self.samples_per_epoch - self.cursor)
        if batch == self.global_batch:
            shares = self.sizes
        else:
            if batch < minimum * len(self.sizes):
                raise ValueError(f"the epoch's last step holds {batch} samples, fewer than {minimum} for each of "
                                 f"the {len(self.sizes)} ranks")
            rest = proportional_shares(self.sizes, batch - minimum * len(self.sizes))
            shares = tuple(minimum + r for r in rest)
        self._drawn = (self.permutation(), self.cursor, tuple(shares))
        self.cursor += batch
        return self.drawn_indices(self.rank)

    @property
    def drawn_shares(self) -> tuple[int, ...]:
        """Every rank's count in the step last drawn by iteration (the split, or on an
        epoch's smaller last step its proportional shares)."""
        if self._drawn is None:
            raise RuntimeError("drawn_shares: no step has been drawn by iteration yet")
        return self._drawn[2]

    def drawn_indices(self, rank: int) -> list[int]:
        """The indices `rank` got in the step last drawn by iteration (every rank can
        tell every rank's: a straggler's samples handed to others are named by position)."""
        if self._drawn is None:
            raise RuntimeError("drawn_indices: no step has been drawn by iteration yet")
        order, start, shares = self._drawn
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < len(shares):
            raise ValueError(f"rank = {rank!r}: expected an integer in [0, {len(shares)})")
        start += sum(shares[:rank])
        return order[start: start + shares[rank]].tolist()

    def state_dict(self) -> dict:
        if self.partial:
            raise RuntimeError(f"state_dict: a step dealt in parts is incomplete ({self.partial} of "
                               f"{self.global_batch} samples)")
        return {"dataset_size": self.dataset_size, "seed": self.seed, "drop_last": self.drop_last,
                "sizes": list(self.sizes), "epoch": self.epoch, "cursor": self.cursor}

    def load_state_dict(self, state: dict) -> None:
        """Resumes exactly where state_dict() was taken. Raises ValueError if the state
        belongs to another dataset, seed, drop_last setting or global batch."""
        for key in ("dataset_size", "seed", "drop_last"):
            if state[key] != getattr(self, key):
                raise ValueError(f"state_dict: saved with {key} = {state[key]!r}, this sampler has "
                                 f"{getattr(self, key)!r}")
        if not 0 <= state["cursor"] <= self.samples_per_epoch or not 0 <= state["epoch"]:
            raise ValueError(f"state_dict: epoch = {state['epoch']!r}, cursor = {state['cursor']!r} are not a "
                             f"position in an epoch of {self.samples_per_epoch} samples")
        self.set_split(state["sizes"])
        self.epoch, self.cursor = state["epoch"], state["cursor"]


def _check_split(sizes: Sequence[int]) -> None:
    if len(sizes) == 0 or any(isinstance(b, bool) or not isinstance(b, int) or b < 0 for b in sizes) \
            or sum(sizes) < 1:
        raise ValueError(f"sizes = {list(sizes)!r}: expected one non-negative integer per rank, adding up to at "
                         f"least 1")
