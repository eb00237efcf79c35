"""One rank's training loop: it composes the model, the data, the balancer, the weighted
reducer and the loss scaler, and owns nothing of their insides.

Per optimizer step, on every rank:
  1. draw this rank's windows from the sampler by the current split (b_i of B);
  2. forward/backward per micro-batch (several when b_i is over the rank's memory cap),
     the loss being the mean over the rank's target tokens times the loss scale; when
     rebalancing, a quarter of the share first, then a report, so that a rank far behind
     can hand the rest of its share to the others within the step (balance.handoff);
  3. (simulated clusters) wait so that the compute takes 1/speed of the time it needed;
  4. reduce: the gradient of the mean loss over all N target tokens, sum_i (n_i/N) g_i,
     with found_inf and the global norm (identical on every rank); while the gradients
     travel, the rebalancer picks the split of the next step (the same on every rank);
  5. unless found_inf: clip by that norm, AdamW step (a 16-bit model's on its fp32
     masters, then one fused cast back into the 16-bit weights); update the one global
     loss scale;
  6. log (rank 0).

Every rank's compute time, loss and token count travel in the reducer's agreement on
the weights (no collective of their own); its reduce and update times, known only
after the reduction, travel in the next step's, so rank 0 writes a step's log line one
step late (and completes the last one with a small all-reduce of its own).
"""

import math
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from hetcomm import ops
from hetcomm.amp import AUTOCAST_DTYPES, DynamicLossScaler, compute_precision
from hetcomm.balance import (DistributedRebalancer, Rebalancer, WeightedDistributedSampler, equal_split,
                             predict_rank_times, probe_memory, solve_split)
from hetcomm.balance import handoff
from hetcomm.balance.rebalancer import TRAINING_SETTINGS
from hetcomm.comm import WeightedReducer
from hetcomm.comm.collectives import gather_floats, launch_gather_floats, wait
from hetcomm.train.checkpoint import load_checked, save_atomic
from hetcomm.train.config import TrainConfig, parse_caps, parse_split
from hetcomm.train.data import TokenWindows, default_corpus, load_tokens
from hetcomm.train.model import GPT, GPTConfig
from hetcomm.train.runlog import RunLog
from hetcomm.train.simulate import SimulatedSpeed, parse_slowdown, parse_speeds


def learning_rate(config: TrainConfig, step: int) -> float:
    """Linear warm-up, then cosine decay to min_lr at the last step."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
    return config.min_lr + 0.5 * (config.lr - config.min_lr) * (1 + math.cos(math.pi * min(1.0, progress)))


def make_optimizer(params: list[torch.Tensor], config: TrainConfig) -> torch.optim.AdamW:
    """AdamW over the model's parameters or their fp32 masters, with weight decay on
    matrices only (not on biases, norms); the fused kernel on CPU and CUDA (a third of
    the for-loop's time on CPU, one launch on GPUs)."""
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    fused = params[0].device.type in ("cpu", "cuda")
    return torch.optim.AdamW([{"params": decay, "weight_decay": config.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}], lr=config.lr, betas=(0.9, 0.95),
                             fused=fused)


def micro_batches(indices: list[int], cap: int | None) -> list[list[int]]:
    if cap is None or len(indices) <= cap:
        return [indices] if indices else []
    return [indices[i:i + cap] for i in range(0, len(indices), cap)]


def run_description(config: TrainConfig, world: int, data_description: str, data_size: int) -> dict:
    """What a checkpoint must match to be resumed by this run."""
    return {"world_size": world, "global_batch": config.global_batch, "block_size": config.block_size,
            "n_layer": config.n_layer, "n_head": config.n_head, "n_embd": config.n_embd, "seed": config.seed,
            "wire": config.wire, "data": data_description, "windows": data_size, "steps": config.steps}


def load_data(config: TrainConfig) -> tuple[TokenWindows, str]:
    tokens, description = load_tokens(config.data) if config.data else default_corpus()
    return TokenWindows(tokens, config.block_size), description


# What each rank sends along with every step's agreement on the weights, in this order:
# this step's compute seconds, summed loss and target tokens, and the previous step's
# reduce seconds (the gradient reduction and the update, including the wait for slower
# ranks) and update seconds (clipping, the optimizer step, the loss scale).
GATHERED = ("compute", "loss_sum", "tokens", "previous_reduce", "previous_update")


@dataclass
class FirstPart:
    """The part of the first step that timed the ranks (see Trainer._probe_split)."""

    done: tuple[int, ...]   # windows each rank has done (every rank's, the same on every rank)
    loss_sum: float
    compute: float          # this rank's seconds, as train_step measures compute


@dataclass
class Phase:
    """Step times of a stretch of the run with one balancing regime."""

    name: str
    step_seconds: list[float] = field(default_factory=list)

    def median(self) -> float:
        ordered = sorted(self.step_seconds)
        return ordered[len(ordered) // 2] if ordered else float("nan")


class Trainer:
    def __init__(self, config: TrainConfig, rank: int, world: int, device: torch.device):
        self.config, self.rank, self.world, self.device = config, rank, world, device
        torch.manual_seed(config.seed)
        self.data, data_description = load_data(config)
        self.model = GPT(GPTConfig(vocab_size=self.data.vocab_size, block_size=config.block_size,
                                   n_layer=config.n_layer, n_head=config.n_head, n_embd=config.n_embd,
                                   dropout=config.dropout)).to(device)
        self.precision = self._agree_precision()
        self.autocast = AUTOCAST_DTYPES[self.precision]
        # Computing in 16-bit with --weights compute: the model holds 16-bit weights (no
        # per-forward casts, half the weight reads) and the optimizer fp32 masters, which
        # the reducer unpacks the gradient into and one fused cast copies back each step.
        self.masters: list[torch.nn.Parameter] | None = None
        if self.autocast is not None and config.weights == "compute":
            self.masters = [torch.nn.Parameter(p.detach().clone()) for p in self.model.parameters()]
            self.model.to(self.autocast)
        self.optimizer = make_optimizer(self.trained_params(), config)
        wire = getattr(torch, config.wire)
        self.reducer = WeightedReducer(self.model.parameters(), wire_dtype=wire, master_params=self.masters,
                                       gather_size=len(GATHERED))
        self._previous_times = (0.0, 0.0)   # this rank's reduce and update seconds of the last step
        self._pending: dict | None = None   # rank 0: the last step's log line, waiting for those times
        # One loss scale for all ranks: needed if the wire or any rank computes in fp16.
        scaled = torch.tensor([float(wire == torch.float16 or self.autocast == torch.float16)])
        dist.all_reduce(scaled, op=dist.ReduceOp.MAX)
        self.scaler = DynamicLossScaler(scale=config.loss_scale, growth_interval=200) if scaled.item() else None
        self.caps = parse_caps(config.memory_caps, world) if config.memory_caps else self._probe_caps()
        self.simulated = config.speeds is not None or bool(config.slowdown)
        speeds = parse_speeds(config.speeds, world) if config.speeds else [1.0] * world
        self.speed = SimulatedSpeed(rank, speeds[rank], tuple(parse_slowdown(s, world) for s in config.slowdown),
                                    device.type)
        self.fixed_split = parse_split(config.split, world, config.global_batch) if config.split else None
        start_split = self.fixed_split or equal_split(config.global_batch, world)
        self.sampler = WeightedDistributedSampler(len(self.data), start_split, rank, seed=config.seed)
        self.probe_seconds = 0.0
        self._first_part: FirstPart | None = None
        self.step = 0
        # The first step is timed in parts when it is a full one (a corpus of one global
        # batch or less starts from the equal split).
        probing = not self.fixed_split and config.balance != "equal" and config.equal_steps == 0 \
            and not config.resume and len(self.data) >= config.global_batch
        self.probed = probing
        if probing:
            start_split = self._probe_split()
            self.sampler.set_split(start_split)
        self.rebalancer = DistributedRebalancer(Rebalancer(config.global_batch, start_split, memory_caps=self.caps,
                                                           threshold=config.rebalance_threshold,
                                                           **TRAINING_SETTINGS))
        self.split = start_split
        # The handoff's reports travel while the ranks compute: on a CPU group, so that an
        # NCCL collective does not sit on the GPU waiting for the straggler's report.
        self.handoff_enabled = config.handoff and config.balance == "dynamic" and not self.fixed_split
        self.control_group = None
        if self.handoff_enabled and dist.get_backend() != "gloo":
            self.control_group = dist.new_group(backend="gloo")
        self.handed_off: handoff.Handoff | None = None   # the last step's handoff, if it made one
        self.check_share = handoff.CheckShare()
        self.description = run_description(config, world, data_description, len(self.data))
        first_phase = "fixed split" if self.fixed_split else "equal split" if not probing else \
            "balanced" if config.balance == "dynamic" else "static split"
        self.phases = [Phase(first_phase)]
        if config.resume:
            self._resume(config.resume)
        ranks = self._describe_ranks()
        self.log = RunLog(config.out, {"config": config.to_dict(), "run": self.description,
                                       "vocab_size": self.data.vocab_size, "ranks": ranks,
                                       "memory_caps": self.caps, "probe_s": self.probe_seconds,
                                       "simulated": self.simulated}, resume=bool(config.resume)) if rank == 0 else None

    def _probe_split(self) -> tuple[int, ...]:
        """The first split when there is no equal-split phase (--equal-steps 0), timed on
        the first step's own samples, after one untimed run that pays for allocation:

          1. every rank runs forward and backward of one window at its (simulated) speed;
          2. about half the global batch is then dealt by the speeds those times suggest,
             so that the ranks compute side by side for about the same time, each timing
             many windows (on shared CPU cores a rank left computing alone runs faster
             than it will in training);
          3. the step's split follows the second part's throughputs within the memory
             caps, each rank keeping at least the windows it has done, and train_step
             deals and computes the rest of the step.

        FastSpeed's one profile, but no pass that trains nothing: a faster rank waits for
        the slowest rank's first window, and for the second part only as long as the
        first windows misjudged the speeds. The rebalancer refines the split from the
        first step on."""
        start = time.perf_counter()
        config, block = self.config, self.config.block_size
        share = config.global_batch // self.world
        warm = max(1, share // 8)
        self._compute([i % len(self.data) for i in range(warm)], scale=1.0, tokens=warm * block)
        self.model.zero_grad(set_to_none=True)
        scale = self.scaler.scale if self.scaler else 1.0
        loss_sum, first = self._timed_compute(self.sampler.take([1] * self.world), scale, tokens=block)
        singles = [row[0] for row in gather_floats([first])]
        if share > 1:
            # About half the global batch in all, dealt by the single windows' speeds.
            half = config.global_batch // 2 - self.world
            speeds = [1 / max(t, 1e-9) for t in singles]
            more = [max(1, math.floor(half * v / sum(speeds))) for v in speeds]
            done = [1 + k for k in more]
            self._retarget_gradients(1, done[self.rank])
            loss, seconds = self._timed_compute(self.sampler.take(more), scale, tokens=done[self.rank] * block)
            loss_sum, compute = loss_sum + loss, first + seconds
            rates = [(0.0, row[0] / k) for row, k in zip(gather_floats([seconds]), more)]
        else:   # one window per rank is the whole equal share
            done, compute = [1] * self.world, first
            rates = [(0.0, t) for t in singles]
        split = solve_split(config.global_batch, rates, self.caps, min_per_rank=done).sizes
        # The parts' gradients are of the mean loss over the rank's done windows; the step's
        # are of the mean over all its split[rank] windows, which the rest of the step adds to.
        self._retarget_gradients(done[self.rank], split[self.rank])
        self._first_part = FirstPart(tuple(done), loss_sum, compute)
        self.probe_seconds = time.perf_counter() - start   # the waits for the slowest rank's parts included
        return split

    def _probe_caps(self) -> list[int | None] | None:
        """Each rank's largest micro-batch, found by running the real step at growing
        sizes on its device (an out-of-memory error becomes the cap; CPUs have none),
        gathered so that every rank holds every cap. None when no rank has one. A rank
        that cannot hold one window stops every rank with the same error."""
        def step(size: int) -> None:
            windows = [i % len(self.data) for i in range(size)]
            inputs, targets = (t.to(self.device) for t in self.data.batch(windows))
            with torch.autocast(self.device.type, dtype=self.autocast, enabled=self.autocast is not None):
                _, loss = self.model(inputs, targets, reduction="sum")
            loss.backward()

        # What training holds and the probe's step does not yet must be held while probing,
        # or the caps leave no room for it and the first optimizer step runs out of memory.
        held = torch.empty(self.memory_held_by_training() if self.device.type == "cuda" else 0,
                           dtype=torch.uint8, device=self.device)
        # Probing must leave no trace: no gradients, the random streams where they were.
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            cap = probe_memory(step, self.device, self.config.global_batch).cap
        del held
        self.model.zero_grad(set_to_none=True)
        caps: list[int | None] = [None] * self.world
        dist.all_gather_object(caps, cap)
        for rank, found in enumerate(caps):
            if found == 0:
                raise ValueError(f"rank {rank} cannot hold one window of {self.config.block_size} tokens in its "
                                 f"device's memory; use a smaller --block-size or model, or leave that device out")
        return caps if any(c is not None for c in caps) else None

    def _agree_precision(self) -> str:
        """This rank's compute precision (--precision, or the policy for its device); a
        precision one rank's device cannot run stops every rank with that rank's message."""
        try:
            mine, problem = compute_precision(self.device, self.config.precision), None
        except ValueError as error:
            mine, problem = None, str(error)
        problems: list[str | None] = [None] * self.world
        dist.all_gather_object(problems, problem)
        for rank, found in enumerate(problems):
            if found is not None:
                raise ValueError(f"rank {rank}: {found}")
        return mine

    def trained_params(self) -> list[torch.Tensor]:
        """What the optimizer updates: the fp32 masters of a 16-bit model, or its parameters."""
        return self.masters if self.masters is not None else list(self.model.parameters())

    def memory_held_by_training(self) -> int:
        """Bytes that training allocates on the device beyond the model and its gradients,
        none of them before the first step: AdamW's two fp32 moments per trained element,
        the masters' fp32 gradients, the reducer's wire buffers (the masters themselves
        exist already)."""
        elements = sum(p.numel() for p in self.trained_params())
        return elements * (8 + (4 if self.masters is not None else 0) + self.reducer.wire_dtype.itemsize)

    def _model_state(self) -> dict:
        """The model's state dict with the fp32 masters' values where there are masters
        (a checkpoint holds the weights at full precision)."""
        state = self.model.state_dict(keep_vars=True)
        by_param = {id(p): m for p, m in zip(self.model.parameters(), self.masters or [])}
        return {name: by_param.get(id(t), t).detach() for name, t in state.items()}

    def _describe_ranks(self) -> list[dict]:
        """Every rank's device and host, for the log: what the planner calibrates against."""
        if self.device.type == "cuda":
            mine = {"device": torch.cuda.get_device_name(self.device),
                    "capability": list(torch.cuda.get_device_capability(self.device))}
        else:
            mine = {"device": "cpu", "capability": None}
        mine.update(host=socket.gethostname(), speed=self.speed.speed, precision=self.precision,
                    weights="16-bit, fp32 masters" if self.masters is not None else "fp32")
        ranks = [None] * self.world
        dist.all_gather_object(ranks, mine)
        return ranks

    # --- one step -------------------------------------------------------------------

    def _draw(self) -> list[int]:
        """This rank's windows for the next step (the sampler moves on to the next epoch
        by itself)."""
        for indices in self.sampler:
            return indices
        for indices in self.sampler:
            return indices
        raise RuntimeError("the sampler produced no step")

    def _compute(self, indices: list[int], scale: float, tokens: int) -> float:
        """Forward and backward over windows, adding to the gradients; returns the summed
        loss. The loss is divided by `tokens`, the rank's target tokens in the step, so
        that the reducer's weight n_i / N makes the global mean."""
        loss_sum = torch.zeros((), device=self.device)
        cap = self.caps[self.rank] if self.caps else None
        for micro in micro_batches(indices, cap):
            inputs, targets = (t.to(self.device) for t in self.data.batch(micro))
            with torch.autocast(self.device.type, dtype=self.autocast, enabled=self.autocast is not None):
                _, loss = self.model(inputs, targets, reduction="sum")
            (loss * (scale / tokens)).backward()
            loss_sum += loss.detach()
        return loss_sum.item()

    def _retarget_gradients(self, samples: int, now: int) -> None:
        """Gradients accumulated as of the mean loss over `samples` windows, made those of
        the mean over `now` windows (the rest of which are still to be added)."""
        if samples != now and now > 0:
            torch._foreach_mul_([p.grad for p in self.model.parameters() if p.grad is not None], samples / now)

    def _timed_compute(self, indices: list[int], scale: float, tokens: int) -> tuple[float, float]:
        """_compute at the rank's (simulated) speed; returns the summed loss and the seconds."""
        start = time.perf_counter()
        with self.speed.compute(self.step):
            loss_sum = self._compute(indices, scale, tokens)
        return loss_sum, time.perf_counter() - start

    def _compute_with_handoff(self, indices: list[int], scale: float) -> tuple[float, float, int]:
        """The rank's share, timed in two parts with a report in between (balance.handoff);
        returns the summed loss, the compute seconds (no waits) and the samples done, its
        own ones kept plus those taken on from a straggler."""
        own = len(indices)
        check = handoff.check_size(own, self.caps[self.rank] if self.caps else None)
        loss_sum, compute = self._timed_compute(indices[:check], scale, own * self.config.block_size)
        model = self.rebalancer.rebalancer.model()
        planned = max(predict_rank_times(self.sampler.drawn_shares, model, self.caps))
        mine = handoff.report(check, compute, own - check, self.check_share.value(), model[self.rank][1], planned)
        work, table = launch_gather_floats(mine.row(), self.control_group)
        reports = plan = None
        if mine.giver:
            reports, plan = self._read_reports(work, table)
        kept = plan.kept[self.rank] if plan else own - check
        self._retarget_gradients(own, check + kept)
        more, seconds = self._timed_compute(indices[check:check + kept], scale, (check + kept) * self.config.block_size)
        if kept == own - check:
            self.check_share.add(check, compute, own, compute + seconds)
        loss_sum, compute = loss_sum + more, compute + seconds
        if not mine.giver:
            reports, plan = self._read_reports(work, table)
        done = check + kept
        self.handed_off = plan
        if plan and plan.received[self.rank]:
            extra = []
            for giver, first, count in plan.sources([r.remaining for r in reports], self.rank):
                start = reports[giver].done + first
                extra += self.sampler.drawn_indices(giver)[start:start + count]
            self._retarget_gradients(done, done + len(extra))
            done += len(extra)
            more, seconds = self._timed_compute(extra, scale, done * self.config.block_size)
            loss_sum, compute = loss_sum + more, compute + seconds
        return loss_sum, compute, done

    def _read_reports(self, work, table) -> tuple[list[handoff.Report], handoff.Handoff | None]:
        wait(work, self.reducer.timeout, "the trainer: the handoff reports")
        reports = [handoff.Report.from_row(row) for row in table.tolist()]
        return reports, handoff.plan(reports)

    def train_step(self) -> torch.Tensor:
        """One optimizer step; returns every rank's GATHERED row, [world, len(GATHERED)]
        float64. The next step's split is chosen by the time it returns."""
        config = self.config
        for group in self.optimizer.param_groups:
            group["lr"] = learning_rate(config, self.step)
        scale = self.scaler.scale if self.scaler else 1.0
        first, self._first_part = self._first_part, None
        self.handed_off = None
        if first is not None:   # the rest of the step whose first part timed the ranks; its gradients stay
            rest = [b - d for b, d in zip(self.split, first.done)]
            indices = self.sampler.take(rest) if sum(rest) else []   # the parts may have been the whole step
            samples = first.done[self.rank] + len(indices)
            more, seconds = self._timed_compute(indices, scale, samples * config.block_size)
            loss_sum, compute = first.loss_sum + more, first.compute + seconds
            step_samples = config.global_batch
        else:
            indices = self._draw()
            self.model.zero_grad(set_to_none=True)
            # Not in an equal phase: that is the baseline, and the first profile.
            if self.handoff_enabled and self.step >= config.equal_steps:
                loss_sum, compute, samples = self._compute_with_handoff(indices, scale)
            else:
                loss_sum, compute = self._timed_compute(indices, scale, len(indices) * config.block_size)
                samples = len(indices)
            step_samples = sum(self.sampler.drawn_shares)   # an epoch's last step may be smaller
        tokens = samples * config.block_size

        start = time.perf_counter()
        # Every window's block_size targets carry loss, so N is the step's token count on
        # every rank: passing the weight n_i / N, rather than n_i for the ranks to add up
        # first, lets the agreement on the weights travel beside the buckets (which checks
        # that the weights add up to 1: a handoff planned differently on two ranks stops).
        # While the gradients travel, the next step's split is chosen from the gathered times.
        result = self.reducer.reduce(tokens / (step_samples * config.block_size), loss_scale=scale,
                                     gather=[compute, loss_sum, tokens, *self._previous_times],
                                     while_in_flight=self._choose_next_split)
        found_inf = bool(result.found_inf.item())
        update_start = time.perf_counter()
        if not found_inf:
            if config.grad_clip > 0:
                coefficient = (config.grad_clip / (result.grad_norm + 1e-6)).clamp(max=1.0).reshape(())
                grads = [p.grad for p in self.trained_params() if p.grad is not None]
                torch._foreach_mul_(grads, coefficient)
            self.optimizer.step()
            if self.masters is not None:
                ops.cast_(self.masters, list(self.model.parameters()))
        if self.scaler:
            self.scaler.update(found_inf)
        reduce = time.perf_counter() - start
        self._last_reduce = (found_inf, result.grad_norm.item(), scale)
        self._previous_times = (reduce, time.perf_counter() - update_start)
        return torch.tensor(result.gathered, dtype=torch.float64)

    # --- the run --------------------------------------------------------------------

    def _choose_next_split(self, everyone: list[list[float]]) -> None:
        """The balancing regime decides the split of the next step from every rank's
        GATHERED row (with the step's weights; the same on every rank). When
        a timed part of the first step gave its split, the step's own times are left out:
        they add mostly one-time costs (allocator growth, thread pools, autotuning; 10%
        on CPU), which would inflate the noise estimate that holds the next change back."""
        skip = self.step == 0 and self.probed
        times = [row[0] for row in everyone]
        decision = None if skip else self.rebalancer.step(times[self.rank], times, self._samples_done(everyone))
        config = self.config
        if self.fixed_split:
            sizes = self.fixed_split
        elif config.balance == "equal" or self.step + 1 < config.equal_steps:
            sizes = equal_split(config.global_batch, self.world)
        elif self.step + 1 == config.equal_steps:
            # The end of the equal phase: the first profile's best split, adopted outright.
            sizes = solve_split(config.global_batch, self.rebalancer.rebalancer.model(), self.caps).sizes
            self.phases.append(Phase("balanced" if config.balance == "dynamic" else "static split"))
        elif config.balance == "static":
            sizes = self.split
        else:
            sizes = self.split if decision is None else decision.sizes
        self.rebalancer.rebalancer.adopt(sizes)
        self.split = sizes
        self.sampler.set_split(sizes)

    def run(self, until: int | None = None) -> dict | None:
        """Trains to the configured number of steps (or only to step `until`, for tests
        and callers that checkpoint in between); returns the summary at the end."""
        config = self.config
        last = config.steps if until is None else min(until, config.steps)
        progress = None
        if self.rank == 0 and config.progress:
            from tqdm import tqdm

            # One bar in one process: a thread lock. tqdm's default multiprocessing lock is a
            # semaphore that a worker leaving through os._exit never releases (a "leaked
            # semaphore" warning at the end of every run).
            tqdm.set_lock(threading.RLock())
            label = "hetcomm train (simulated cluster)" if self.simulated else "hetcomm train"
            # disable=None: a bar on a terminal, nothing in a log file.
            progress = tqdm(total=config.steps, initial=self.step, desc=label, unit="step", dynamic_ncols=True,
                            disable=None)
        run_start = time.perf_counter()
        while self.step < last:
            step_start = time.perf_counter()
            split, phase = self.split, self.phases[-1]
            everyone = self.train_step()
            if self.rank == 0:
                self._complete_pending(everyone[:, 3].tolist(), everyone[:, 4].tolist())
                self._pending = self._log_line(everyone, split, phase.name)
                if progress:
                    progress.set_postfix(loss=f"{everyone[:, 1].sum() / everyone[:, 2].sum():.3f}",
                                         split="/".join(map(str, split)))
                    progress.update()
            # The whole step, up to the next one's start: the reduction, the update, the
            # choice of the split and the log line all delay it.
            step_seconds = time.perf_counter() - step_start
            if self.rank == 0:
                self._pending.update(step_s=step_seconds,
                                     tokens_per_second=everyone[:, 2].sum().item() / step_seconds)
            if self.step > 0:  # the first step pays for warm-up (allocator, thread pools), not for the split
                phase.step_seconds.append(step_seconds)
            self.step += 1
            if config.checkpoint_every and self.step % config.checkpoint_every == 0 and self.step < config.steps:
                self.save_checkpoint()
        if progress:
            progress.close()
        if self.step < config.steps:
            self._complete_log()   # save_checkpoint does it otherwise
            return None
        self.save_checkpoint()
        summary = self._summary(time.perf_counter() - run_start)
        if self.log:
            self.log.summary(summary)
            self.log.close()
        return summary

    def _samples_done(self, everyone: list[list[float]]) -> list[int]:
        """The windows each rank did in the step (a handoff moves some off the split),
        from the target tokens in every rank's GATHERED row."""
        return [round(row[2]) // self.config.block_size for row in everyone]

    def _log_line(self, everyone: torch.Tensor, split: tuple[int, ...], phase: str) -> dict:
        """The step's log line as far as it is known on this step (rank 0)."""
        found_inf, grad_norm, scale = self._last_reduce
        compute = everyone[:, 0].tolist()
        samples = self._samples_done(everyone.tolist())
        return {
            "step": self.step, "simulated": self.simulated, "phase": phase,
            "loss": everyone[:, 1].sum().item() / everyone[:, 2].sum().item(),
            "micro_batch": list(split), "samples": samples, "compute_s": compute,
            # A handoff: the samples it moved, and the step's compute as it predicted it with and without.
            "handoff": None if self.handed_off is None else {
                "moved": self.handed_off.moved, "predicted_s": self.handed_off.step_seconds,
                "as_dealt_s": self.handed_off.without_seconds},
            "samples_per_second": [b / t if t > 0 and b > 0 else 0.0 for b, t in zip(samples, compute)],
            "loss_scale": scale, "skipped": found_inf, "grad_norm": grad_norm,
            "lr": self.optimizer.param_groups[0]["lr"],
        }

    def _complete_pending(self, reduce: list[float], update: list[float]) -> None:
        """Writes the last step's log line with every rank's reduce and update seconds (rank 0)."""
        if self._pending is not None:
            self._pending.update(wait_s=reduce, update_s=update)
            self.log.step(self._pending)
            self._pending = None

    def _complete_log(self) -> None:
        """Before a checkpoint and when the run stops: the last step's reduce and update
        times have no next step to travel with, so one all-reduce fetches them (every rank)."""
        times = gather_floats(self._previous_times)
        self._previous_times = (0.0, 0.0)
        if self.rank == 0:
            self._complete_pending([reduce for reduce, _ in times], [update for _, update in times])

    def _summary(self, seconds: float) -> dict:
        model = self.rebalancer.rebalancer.model()
        throughputs = [1.0 / c for _, c in model]  # samples per second of compute, as last estimated
        batch = self.config.global_batch
        ideal = batch / sum(throughputs)
        equal = max(b / s for b, s in zip(equal_split(batch, self.world), throughputs))
        phases = {p.name: {"steps": len(p.step_seconds), "median_step_s": p.median()} for p in self.phases}
        return {"simulated": self.simulated, "steps": self.step, "seconds": seconds, "probe_s": self.probe_seconds,
                "phases": phases,
                "final_split": list(self.split),
                "estimated_samples_per_second": throughputs,
                "ideal_step_s": ideal, "equal_split_step_s_predicted": equal}

    # --- checkpoints ----------------------------------------------------------------

    def save_checkpoint(self) -> None:
        self._complete_log()
        # What each rank holds of its own: its random stream, and its handoff checks' shares.
        mine = [None] * self.world
        dist.all_gather_object(mine, (torch.get_rng_state(), list(self.check_share.recent)))
        rng, check_shares = [m[0] for m in mine], [m[1] for m in mine]
        if self.rank == 0:
            save_atomic({"run": self.description, "step": self.step, "model": self._model_state(),
                         "optimizer": self.optimizer.state_dict(),
                         "scaler": self.scaler.state_dict() if self.scaler else None,
                         "sampler": self.sampler.state_dict(), "rebalancer": self.rebalancer.rebalancer.state_dict(),
                         "split": list(self.split), "rng": rng, "check_shares": check_shares,
                         "phases": [[p.name, p.step_seconds] for p in self.phases]},
                        self.checkpoint_path)
        dist.barrier()

    @property
    def checkpoint_path(self) -> Path:
        return Path(self.config.out) / "checkpoint.pt"

    def _resume(self, path: str) -> None:
        state = load_checked(path, self.description)
        self.model.load_state_dict(state["model"])
        if self.masters is not None:
            names = [name for name, _ in self.model.named_parameters()]
            with torch.no_grad():
                for name, master in zip(names, self.masters):
                    master.copy_(state["model"][name])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scaler and state["scaler"]:
            self.scaler.load_state_dict(state["scaler"])
        self.sampler.load_state_dict(state["sampler"])
        self.rebalancer.rebalancer.load_state_dict(state["rebalancer"])
        self.split = tuple(state["split"])
        self.step = int(state["step"])
        self.phases = [Phase(name, list(seconds)) for name, seconds in state["phases"]]
        torch.set_rng_state(state["rng"][self.rank])
        # Checkpoints from before the handoff have none: the shares are measured again.
        self.check_share.recent = [float(r) for r in state.get("check_shares", [[]] * self.world)[self.rank]]
