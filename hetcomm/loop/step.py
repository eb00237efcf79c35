"""One optimizer step of a BalancedLoop: this rank's micro-batches, timed, with the
first step's timing parts or a straggler's handoff dealt between them, then the
weighted reduction.

The gradients a step accumulates are of the loss summed over the rank's items and
divided by a normaliser known before the first backward: the samples the rank is to do
(times items_per_sample when given). When the samples the rank ends up doing change
within the step (the first step's parts, a handoff), the gradients are rescaled to the
new count once. The reduction then weights them by normaliser / N, N the step's items
over all ranks, which makes sum_i (normaliser_i / N) g_i the gradient of the mean loss
over the global batch, however the samples were split."""

import math
import numbers
import time
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from torch import Tensor

from hetcomm.balance import handoff, predict_rank_times, solve_split, wait_for_compute
from hetcomm.comm.collectives import gather_floats, launch_gather_floats, wait
from hetcomm.loop.batches import micro_batches

# What each rank sends along with every step's agreement on the weights, in this order:
# this step's compute seconds, summed loss, loss items (count) and samples done, and the
# previous step's reduce seconds (the reduction, including the wait for slower ranks)
# and update seconds (from reduce() returning to the next step: the optimizer step),
# whether the rank was asked to stop (BalancedLoop.request_stop), and the seconds and
# samples the rebalancer measures the rank's speed by: its compute and samples, or in a
# step with a handoff report those of its own share as dealt (samples taken on left
# out; a giver's share as its timed forward predicted it).
GATHERED = ("compute", "loss_sum", "count", "samples", "previous_reduce", "previous_update", "stop",
            "measured_s", "measured_samples")


@dataclass(frozen=True)
class RankRow:
    """One rank's figures of a step (its reduce and update seconds are the previous step's)."""

    compute_s: float
    loss_sum: float
    count: float
    samples: int
    previous_reduce_s: float
    previous_update_s: float


@dataclass
class StepResult:
    """What a step's reduction found; the same on every rank."""

    number: int
    skipped: bool          # a gradient was inf/NaN somewhere: skip the optimizer step (every rank does)
    grad_norm: float       # L2 norm of the whole reduced, unscaled gradient
    loss: float            # the mean loss over the step's items on all ranks
    loss_scale: float      # the scale this step's losses were multiplied by
    split: tuple[int, ...]  # the samples each rank was dealt
    regime: str            # "balanced", "static split", "equal split" or "fixed split"
    ranks: list[RankRow]
    handoff: handoff.Handoff | None   # the plan by which a straggler handed samples off, if any
    _norm: Tensor = field(repr=False, default=None)
    _params: list | None = field(repr=False, default_factory=list)   # None: sharded

    def clip_coefficient(self, max_norm: float) -> torch.Tensor:
        """What the gradients must be multiplied by for their global norm to be at most
        max_norm (torch's clip_grad_norm_ rule), from the norm the reduction computed: a
        1-element device tensor, for an optimizer that takes it (hetcomm.optim.AdamW's
        grad_scale) and clips in its own pass."""
        if not (isinstance(max_norm, numbers.Real) and math.isfinite(max_norm) and max_norm > 0):
            raise ValueError(f"clip_grad_norm_: max_norm = {max_norm!r}: expected a finite positive number")
        return (max_norm / (self._norm + 1e-6)).clamp(max=1.0).reshape(1)

    def clip_grad_norm_(self, max_norm: float) -> None:
        """Scales the trained gradients so that their global norm is at most max_norm,
        using the norm the reduction computed (no pass of its own, no host sync)."""
        if self._params is None:
            raise RuntimeError("clip_grad_norm_: a sharded loop's gradients are reduced onto their owners; pass "
                               "step.clip_coefficient(max_norm) to ShardedAdamW.step(grad_scale=...) instead")
        coefficient = self.clip_coefficient(max_norm).reshape(())
        torch._foreach_mul_([p.grad for p in self._params if p.grad is not None], coefficient)


class LoopStep:
    """Iterate it for this rank's micro-batches (collated, on the device); call
    backward(loss, count) once for each; then reduce() once. The gradients are zeroed
    when the first micro-batch is drawn. With dynamic balancing the first step also
    yields a few untimed warm-up micro-batches first, whose gradients and losses are
    discarded (they pay for allocation, so that the timing that splits the batch is fair)."""

    def __init__(self, loop):
        self.loop = loop
        self.number = loop.step
        self.regime = loop._regime(self.number)
        self.split = loop.split
        self.scale = loop.scaler.scale if loop.scaler else 1.0
        self.compute = 0.0           # seconds of this rank's compute (its timed parts)
        self.samples = 0             # samples done, counted as they are dealt
        self.loss_sum: Tensor | float = 0.0
        self.count: Tensor | float = 0
        self.normaliser = 1          # the samples the gradients are normalised by
        self.step_samples = loop.global_batch
        self.timed_first = False
        self.handed_off: handoff.Handoff | None = None
        # The seconds and samples of the rank's own share as dealt, in a step with a handoff
        # report: timed (taken-on samples left out), or a giver's as its forward predicted it.
        self.measured: tuple[float, int] | None = None
        self.reduced = False
        self._state = "new"
        self._awaiting: int | None = None   # the size of the micro-batch yielded and not yet backward'ed
        self._reporting: _Reporting | None = None   # this step's handoff report, when it has one
        self._cut: str | None = None        # a giver's plan ends its run: "dropped" or "kept" its first micro-batch
        self._started = 0.0                 # when the current run began
        # Whether the micro-batch yielded is the step's last, so that its backward can send
        # the buckets as they are final: True, False, or "unless it receives" (a handoff
        # step's own share: the last unless the plan hands this rank samples).
        self._last: bool | str = False
        self._settle = no_stretch           # brings the simulated speed's stretch up to now
        self._padding = False               # the micro-batch yielded only aligns sharded weights' gathers
        self._stream_total: float | None = None   # streamed gradients' divisor (_streamed_total)

    # --- the micro-batches -----------------------------------------------------------

    def __iter__(self):
        if self._state != "new":
            raise RuntimeError(f"BalancedLoop: step {self.number}'s micro-batches can be iterated once")
        self._state = "iterating"
        loop = self.loop
        loop._close_update()
        loop.zero_grads()
        if loop.time_first_step:
            yield from self._first_step_in_parts()
        else:
            indices = self._draw()
            self.normaliser = max(1, len(indices))
            if loop.handoff_enabled and self.number >= loop.equal_steps:
                yield from self._with_handoff(indices)
            else:
                yield from self._run(indices, final=True, counts=list(loop.sampler.drawn_shares))
        self._state = "done"

    def _draw(self) -> list[int]:
        """This rank's samples of the step (the sampler moves on to the next epoch by itself)."""
        sampler = self.loop.sampler
        for _ in range(2):
            for indices in sampler:
                self.step_samples = sum(sampler.drawn_shares)   # an epoch's last step may be smaller
                return indices
        raise RuntimeError("the sampler produced no step")

    def _run(self, indices: list[int], timed: bool = True, first: int | None = None, final: bool | str = False,
             counts: list[int] | None = None):
        """Yields the micro-batches of `indices` (the first of at most `first` samples);
        returns the seconds they took, waiting for the device, stretched to the rank's
        simulated speed when timed. A giver's handoff (see _report_forward) may end it
        after its first micro-batch. `final`: whether the run ends the step (self._last).
        `counts`: every rank's samples in this run (sharded weights align the ranks'
        micro-batches by them: BalancedLoop.runs_of)."""
        loop = self.loop
        # The loop's clock (TimedSteps.clock) times the compute that splits are decided from;
        # the first step's waits and the reduction are the host's seconds.
        start, waited = loop.clock(), loop.waited()
        done = 0
        with loop.compute_context(self.number) if timed else nullcontext() as settle:
            self._started, self._settle = start, settle or no_stretch
            loop.settle_now = self._settle
            try:
                if loop.sharded_weights is not None:
                    micros = loop.runs_of(indices, counts)
                else:
                    micros = micro_batches(indices, loop.cap(), first)
                for k, micro in enumerate(micros):
                    self._padding = micro is None
                    if self._padding:   # a sample to run the layers' gathers with; its loss counts zero
                        micro = []
                    batch = loop.load(micro or [indices[0] if indices else 0])
                    self._awaiting = max(1, len(micro))
                    self._last = final if k == len(micros) - 1 else False
                    yield batch
                    if self._awaiting is not None:
                        raise RuntimeError(f"BalancedLoop: step {self.number}: step.backward(loss) was not called "
                                           f"for a micro-batch; call it once for each micro-batch the step yields")
                    if self._cut == "dropped":
                        break
                    done += len(micro)
                    if self._cut == "kept":
                        break
                self._device_done()
            finally:
                loop.settle_now = no_stretch
                self._last = False
                self._padding = False
        # The waits for other ranks' gathers are theirs, not this rank's compute.
        seconds = loop.clock() - start - (loop.waited() - waited)
        if timed:
            self.compute += seconds
            self.samples += done
        return seconds

    def _device_done(self) -> None:
        # The compute stream only: with overlap the last micro-batch's buckets are already
        # on the wire, and their all-reduces wait for the other ranks.
        wait_for_compute(self.loop.device)

    def _retarget(self, now: int) -> None:
        """Gradients normalised by self.normaliser samples made those normalised by
        `now` (the samples the rank now does in the step, some of them still to come)."""
        if now != self.normaliser and now > 0:
            grads = [p.grad for p in self.loop.model.parameters() if p.grad is not None]
            if grads:
                torch._foreach_mul_(grads, self.normaliser / now)
            self.normaliser = now

    def _first_step_in_parts(self):
        """The first step, timed in parts on its own samples (no pass that trains nothing),
        after an untimed warm-up that pays for allocation:

          1. every rank does one sample at its (simulated) speed;
          2. about half the global batch is dealt by the speeds those times suggest, so
             that the ranks compute side by side for about the same time, each timing
             many samples (on shared CPU cores a rank left computing alone runs faster
             than it will in training);
          3. the step's split follows the second part's throughputs within the memory
             caps, each rank keeping at least the samples it has done, and the rest of
             the step is dealt by it.

        The next steps' split is chosen at reduce() from the second and third parts
        together (measured: the rank's seconds and samples in both): dealt to finish
        together, they time every rank over the whole step but its first sample, where
        the second part alone, which this step's split had to rest on, times it over
        half of it. A first split rests on that timing until the rebalancer's estimates
        beat the noise margin (on a noisy host, 10-20 steps), so its noise costs on
        every step; taking this step's own split for the steps after would also keep the
        floor of samples done, which a rank timed fast on its one sample overshoots (a
        GPT benchmark run began at 36/36/14/10 where about 35/35/17/9 was right: 25%
        over the bound a step, for the five steps the rebalancer took to move it).

        A faster rank waits for the slowest rank's first sample, and for the second part
        only as long as the first samples misjudged the speeds."""
        loop, rank = self.loop, self.loop.rank
        start = time.perf_counter()
        batch, world = loop.global_batch, loop.world
        share = batch // world
        warm_up = max(1, share // 8)
        yield from self._run([i % len(loop.dataset) for i in range(warm_up)], timed=False, counts=[warm_up] * world)
        loop.zero_grads()
        self.loss_sum, self.count, self.timed_first = 0.0, 0, True
        first = yield from self._run(loop.sampler.take([1] * world), counts=[1] * world)
        singles = [row[0] for row in gather_floats([first])]
        if share > 1:
            half = batch // 2 - world
            speeds = [1 / max(t, 1e-9) for t in singles]
            more = [max(1, math.floor(half * v / sum(speeds))) for v in speeds]
            done = [1 + k for k in more]
            self._retarget(done[rank])
            seconds = yield from self._run(loop.sampler.take(more), counts=more)
            rates = [(0.0, row[0] / k) for row, k in zip(gather_floats([seconds]), more)]
            timed = (seconds, more[rank])
        else:   # one sample per rank is the whole equal share
            done, rates = [1] * world, [(0.0, t) for t in singles]
            timed = (first, 1)
        split = solve_split(batch, rates, loop.caps, min_per_rank=done).sizes
        self._retarget(split[rank])
        loop.set_split(split)
        loop.time_first_step = False
        loop.first_timing_seconds = time.perf_counter() - start   # the waits for the slowest rank's parts included
        self.split = split
        rest = [b - d for b, d in zip(split, done)]
        seconds = yield from self._run(loop.sampler.take(rest) if sum(rest) else [], counts=rest)
        self.measured = (timed[0] + seconds, timed[1] + rest[rank])

    def _with_handoff(self, indices: list[int]):
        """The rank's share as dealt, with a report at the first micro-batch's backward
        call (balance.handoff; backward() calls _report_forward): its own samples, or a
        giver's kept part of them, then those taken on from a straggler."""
        loop, rank = self.loop, self.loop.rank
        model = loop.rebalancer.rebalancer.model()
        planned = predict_rank_times(loop.sampler.drawn_shares, model, loop.caps)
        self._reporting = _Reporting(len(indices), model[rank][1], planned[rank], max(planned))
        if not indices:
            self._post_report(handoff.report(0, 0.0, 0, None, model[rank][1], 0.0, max(planned)))
        # The report comes after the first micro-batch's forward: cut it short, once the
        # forward can tell a straggler, so that the plan comes early in the step.
        first = math.ceil(loop.handoff_report_part * len(indices)) if loop.forward_share.value() else None
        seconds = yield from self._run(indices, first=first, final="unless it receives")
        mine = self._reporting
        kept = mine.plan.kept[rank] if mine.plan and mine.report.giver else len(indices)
        if self._cut is not None:   # a giver's plan: its kept samples past those done
            self._cut = None
            # A rank that reported itself a giver may, beside a slower giver, be made a
            # receiver by the plan: its own share then does not end the step, and its
            # buckets must wait for the samples it takes on.
            yield from self._run(indices[self.samples:kept], final=not mine.plan.received[rank])
        else:
            self.measured = (seconds, len(indices))
            if indices:
                loop.forward_share.add(mine.first, mine.forward_seconds, len(indices), seconds)
        if mine.reports is None:
            mine.reports, mine.plan = self._read_reports(mine.work, mine.table)
        plan, reports = mine.plan, mine.reports
        self.handed_off = plan
        if plan and plan.received[rank]:
            extra = []
            for giver, first, count in plan.sources([r.remaining for r in reports], rank):
                start = reports[giver].done + first
                extra += loop.sampler.drawn_indices(giver)[start:start + count]
            loop.reducer.disarm()   # armed on the own share's last micro-batch, held: more samples came
            self._retarget(kept + len(extra))
            yield from self._run(extra, final=True)

    def _report_forward(self) -> None:
        """At the backward call of the share's first micro-batch: times its forward,
        sends the report and, for a giver, reads the plan at once. A giver that keeps
        fewer samples than the micro-batch holds drops it (no backward); one that keeps
        more backs it up; either then does only the samples it keeps."""
        mine = self._reporting
        self._settle()
        self._device_done()
        mine.first, mine.forward_seconds = self._awaiting, self.loop.clock() - self._started
        self._post_report(handoff.report(mine.first, mine.forward_seconds, mine.own,
                                         self.loop.forward_share.value(), mine.model_rate, mine.planned_rank,
                                         mine.planned_step))
        if mine.report.giver:
            mine.reports, mine.plan = self._read_reports(mine.work, mine.table)
            if mine.plan:
                kept = mine.plan.kept[self.loop.rank]
                self.normaliser = max(1, kept)   # no gradient yet: the first micro-batch's backward is to come
                self.measured = (mine.report.as_dealt, mine.own)
                self._cut = "kept" if kept >= mine.first else "dropped"

    def _post_report(self, mine: handoff.Report) -> None:
        self._reporting.report = mine
        self._reporting.work, self._reporting.table = launch_gather_floats(mine.row(), self.loop.control_group)

    def _read_reports(self, work, table) -> tuple[list[handoff.Report], handoff.Handoff | None]:
        wait(work, self.loop.reducer.timeout, "BalancedLoop: the handoff reports")
        reports = [handoff.Report.from_row(row) for row in table.tolist()]
        return reports, handoff.plan(reports)

    # --- the user's calls ------------------------------------------------------------

    def backward(self, loss: Tensor, count=None, *, reduction: str = "mean") -> None:
        """Backward of one micro-batch's loss, scaled for the weighted reduction.

        Args:
            loss: a one-element tensor: the mean over `count` items (reduction="mean", what
                a Hugging Face model returns), or their sum (reduction="sum").
            count: how many items the loss is over (tokens that carry loss: for masked
                language modelling the masked tokens, which differ from rank to rank); a
                number or a one-element tensor. Default: the micro-batch's samples, or
                samples x items_per_sample when the loop was given that (then count must
                not be passed).
        """
        if self._awaiting is None:
            raise RuntimeError("step.backward: call it once for each micro-batch the step yields, inside the loop "
                               "over the step")
        if not isinstance(loss, Tensor) or loss.numel() != 1:
            shape = tuple(loss.shape) if isinstance(loss, Tensor) else type(loss).__name__
            raise ValueError(f"step.backward: loss must be a one-element tensor (the micro-batch's mean or summed "
                             f"loss); got {shape}")
        if reduction not in ("mean", "sum"):
            raise ValueError(f"step.backward: reduction = {reduction!r}: expected 'mean' or 'sum'")
        per_sample = self.loop.items_per_sample
        if per_sample is not None and count is not None:
            raise ValueError(f"step.backward: the loop was given items_per_sample={per_sample}, which fixes the "
                             f"count; pass no count")
        count = self._awaiting * (per_sample or 1) if count is None else _checked_count(count)
        if self._padding:
            self._awaiting = None
            if self._last is True:
                self._arm()
            (loss.reshape(()) * 0.0).backward()   # the gathers of a real backward, adding nothing
            return
        if self._reporting is not None and self._reporting.report is None:   # the share's first micro-batch
            self._report_forward()
        self._awaiting = None
        if self._cut == "dropped":
            return   # a giver hands this micro-batch off: its forward is dropped, its samples done elsewhere
        if isinstance(count, numbers.Real) and count == 0:
            return   # no items: nothing to add (and a mean over none is NaN)
        if self._cut is None and self._last is True:
            self._arm()
        elif self._cut is None and self._last == "unless it receives":
            self._arm(may_send=self._receives_nothing)
        total = loss.reshape(()) * count if reduction == "mean" else loss.reshape(())
        divisor = self._streamed_total() if self._streamed() else self.normaliser * (per_sample or 1)
        (total * (self.scale / divisor)).backward()
        self.loss_sum = self.loss_sum + total.detach().float()
        self.count = self.count + count

    def _receives_nothing(self) -> bool:
        """Whether the handoff reports are in (read now if they have arrived) and the plan
        hands this rank no samples: then its own share's last micro-batch ends its step."""
        mine = self._reporting
        if mine.reports is None:
            if not mine.work.is_completed():
                return False
            mine.reports, mine.plan = self._read_reports(mine.work, mine.table)
        return not (mine.plan and mine.plan.received[self.loop.rank])

    def _streamed(self) -> bool:
        return getattr(self.loop.reducer, "streams", False)

    def _streamed_total(self) -> float:
        """What streamed gradients divide every micro-batch's summed loss by: an expected
        total the same on every rank and fixed for the step (the reducer corrects it to
        the step's real total)."""
        if self._stream_total is None:
            expected = self.loop.expected_total(self.step_samples)
            self._stream_total = expected or float(self.step_samples * (self.loop.items_per_sample or 1))
        return self._stream_total

    def _divisor(self) -> float:
        """What the step's gradients were divided by: its samples, times the items a sample."""
        return float(self.normaliser * (self.loop.items_per_sample or 1))

    def _arm(self, may_send=None) -> None:
        """Has the reducer send each bucket during the coming backward, once final (and
        may_send() says so)."""
        loop = self.loop
        expected = loop.expected_total(self.step_samples)
        if loop.reducer.overlap and expected is not None:
            loop.reducer.begin(grad_divisor=self._divisor(), expected_total=expected, may_send=may_send)

    def reduce(self) -> StepResult:
        """The weighted all-reduce of the step's gradients (the gradient of the mean loss
        over all ranks' items, unscaled, in the parameters' .grad or the masters'), with
        the overflow verdict and the global norm; updates the loss scale. While the
        gradients travel, the next step's split is chosen. Every rank calls it."""
        if self.reduced:
            raise RuntimeError(f"BalancedLoop: step {self.number} was reduced already")
        if self._state != "done":
            raise RuntimeError(f"BalancedLoop: step {self.number}.reduce() before all its micro-batches were "
                               f"processed; iterate the step to its end first")
        loop = self.loop
        start = time.perf_counter()
        count = float(self.count)
        measured = self.measured or (self.compute, self.samples)
        gather = [self.compute, float(self.loss_sum), count, self.samples, *loop.previous_times,
                  float(loop.stop_requested), *measured]

        def choose_next_split(everyone):
            loop.choose_next_split(everyone, self.step_samples, self.timed_first)

        divisor = self._streamed_total() if self._streamed() else self._divisor()
        result = loop.reducer.reduce(count=count, grad_divisor=divisor, loss_scale=self.scale, gather=gather,
                                     while_in_flight=choose_next_split,
                                     expected_total=divisor if self._streamed()
                                     else loop.expected_total(self.step_samples))
        loop.last_total = result.total
        skipped = bool(result.found_inf.item())
        if loop.scaler:
            loop.scaler.update(skipped)
        rows = [RankRow(r[0], r[1], r[2], round(r[3]), r[4], r[5]) for r in result.gathered]
        items = sum(r.count for r in rows)
        loop.step += 1
        self.reduced = True
        loop.previous_times = (time.perf_counter() - start, 0.0)
        loop.update_started = time.perf_counter()
        return StepResult(self.number, skipped, result.grad_norm.item(),
                          sum(r.loss_sum for r in rows) / items if items else math.nan, self.scale, self.split,
                          self.regime, rows, self.handed_off, result.grad_norm,
                          None if loop.flat is not None else loop.trained_params)


def _checked_count(count):
    if isinstance(count, Tensor):
        if count.numel() != 1:
            raise ValueError(f"step.backward: count must be a number or a one-element tensor; got shape "
                             f"{tuple(count.shape)}")
        return count.reshape(()).to(torch.float32)
    if isinstance(count, bool) or not isinstance(count, numbers.Real) or not math.isfinite(count) or count < 0:
        raise ValueError(f"step.backward: count = {count!r}: expected a finite, non-negative number of items")
    return count


def no_stretch() -> None:
    """No simulated speed: nothing to wait for."""


@dataclass
class _Reporting:
    """A step's handoff report and what came back of it."""

    own: int                 # the rank's own samples as dealt
    model_rate: float        # seconds per sample the model predicts for it
    planned_rank: float      # its predicted compute seconds for its share
    planned_step: float      # the step's: the slowest rank's
    first: int = 0           # the samples of the first micro-batch, whose forward was timed
    forward_seconds: float = 0.0
    report: handoff.Report | None = None
    work: object = None      # the reports' all-reduce in flight, and its table
    table: Tensor | None = None
    reports: list[handoff.Report] | None = None
    plan: handoff.Handoff | None = None
