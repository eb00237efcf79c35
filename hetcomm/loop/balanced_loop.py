"""BalancedLoop: the per-run state of balanced heterogeneous training (see the package)."""

import math
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import nullcontext
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import default_collate

from hetcomm.amp import AUTOCAST_DTYPES, PRECISIONS, DynamicLossScaler
from hetcomm.balance import (DistributedRebalancer, Rebalancer, WeightedDistributedSampler, equal_split,
                             probe_memory, solve_split)
from hetcomm.balance.handoff import ForwardShare
from hetcomm.balance.profile import TimedSteps
from hetcomm.balance.rebalancer import THRESHOLD, TRAINING_SETTINGS
from hetcomm.comm import WeightedReducer
from hetcomm.comm.collectives import control_device, gather_floats
from hetcomm.loop.agreement import agree_precision, check_same_parameters, check_same_values
from hetcomm.loop.batches import load_batch, micro_batches
from hetcomm.loop.step import GATHERED, LoopStep, no_stretch
from hetcomm.shard import FlatParameters, ShardedReducer
from hetcomm.simulated import stretch_as_it_goes
from hetcomm.shard.layout import bytes_needed
from hetcomm.shard.spec import Shard, agree_layout, probe_state_memory
from hetcomm.shard.streamed import StreamedReducer
from hetcomm.shard.units import plan_units
from hetcomm.shard.weights import ShardedWeights

BALANCE = ("dynamic", "static", "equal")


class BalancedLoop(TimedSteps):
    """Balanced data-parallel training of `model` on `dataset`, one optimizer step at a
    time (steps()), across the ranks of the default process group.

    Every rank builds one with the same arguments (but its own `simulated_speed`); the
    model must hold the same weights on every rank (checked). Each step deals
    `global_batch` samples of one permutation of the dataset per epoch (nothing dropped
    or repeated; an epoch's leftover forms a smaller last step) by the current split.
    A rank's compute is timed by BalancedLoop.clock, which the integrations'
    BalancedBatches shares (hetcomm.balance.profile.TimedSteps): the host's clock, read
    after the device's compute stream is done.

    Args:
        model: any nn.Module; its parameters that require grad are reduced.
        dataset: a map-style dataset (len and [i]; `__getitems__` is used when present).
        global_batch: samples per optimizer step over all ranks; at most len(dataset).
        collate_fn: list of samples -> batch, as for a DataLoader (default: default_collate).
        balance: "dynamic" (time the first step, rebalance while training, hand a
            straggler's samples off within a step), "static" (one split from the first
            step's timing) or "equal".
        split: a fixed split, one count per rank (no balancing).
        equal_steps: steps run at the equal split first (a baseline), whose times give
            the first split; 0 times the ranks on parts of the first step instead.
        handoff: with "dynamic", let a rank far behind within a step hand its remaining
            samples to the others in that step.
        handoff_report_part: the most of its share a rank's first micro-batch holds in
            a step with the handoff. That micro-batch's forward is what tells a straggler:
            a smaller part reports it sooner, but costs one more micro-batch (its fixed
            costs) on every step where the caps do not cut the share finer already. 1 (the
            default): the first micro-batch as the caps cut it. On the simulated CPU
            cluster (docs/benchmarks.md), 0.25 shortened BERT's throttled step from ~1.65 s
            to ~1.2 s, but made GPT's steady steps 4.6% slower (8-sample shares).
        rebalance_threshold: adopt a new split only for this much less predicted step time.
        memory_caps: the largest micro-batch per rank (None: no cap); more becomes
            gradient accumulation. Default: probed on GPUs with `probe_forward`.
        probe_forward: batch -> scalar loss, run at growing micro-batch sizes on GPUs to
            find each rank's cap (out-of-memory errors mark it).
        precision: "auto" (per device generation, hetcomm.amp), "fp32", "fp16" or "bf16":
            what loop.autocast() computes in, and whether a loss scale is needed.
        wire_dtype, bucket_cap_mb, timeout: the WeightedReducer's.
        overlap: send the gradients' buckets during the backward of the step's last
            micro-batch, as each is final, packed by an expected total of items (exact
            with items_per_sample, else the previous step's), so that only the last
            buckets' all-reduce follows the backward. A step whose last micro-batch a rank
            cannot tell (a handoff step before the reports are in, the first step) sends
            them all after it.
        loss_scale: the initial dynamic loss scale, used when the wire or any rank's
            compute is fp16.
        items_per_sample: when every sample carries the same number of loss items (a
            GPT window's block_size tokens), the step's weights are known in advance and
            their agreement travels beside the gradients; step.backward then takes no count.
        master_params: fp32 masters of a model computing in 16-bit (see WeightedReducer):
            the reduced gradient goes into their .grad.
        seed: the data order's seed (the same on every rank).
        data_fingerprint: a string that changes when the dataset's content does (e.g.
            hetcomm.loop.fingerprint_files(paths) of the files it reads); without one, the
            dataset's own fingerprint() if it has that method. Every rank must have the
            same; state_dict records it, and load_state_dict refuses a state taken on
            other data (regenerated or edited under the same name, with the same length)
            unless data_changed=True.
        shard: a hetcomm.shard.Shard: keep the optimizer state (fp32 masters, AdamW's
            moments) only on the owner of each range of the parameters, ranges sized by
            each rank's memory; the trained parameters (one dtype: a 16-bit model's own
            weights, no master_params) and their gradients become views of flat buffers.
            Step with hetcomm.shard.ShardedAdamW(groups, loop.reducer, ...), passing
            step.clip_coefficient(max_norm) as its grad_scale. Shard(weights=True) shards
            the weights too (loop.sharded_weights): every rank then runs as many
            micro-batches in a step (a short share is padded with a micro-batch whose loss
            counts zero), so that the layers' gathers meet; the handoff is off, and the
            memory caps must be given (a probe would run different sizes on each rank).
            By default the gradients are streamed onto their owners layer by layer and
            never held whole (hetcomm.shard.streamed; Shard.gradients).
            Shard(offload="optimizer") keeps the state in host memory: step with
            ShardedAdamW(..., offload=True).
        simulated_speed: on a simulated CPU cluster, an object whose compute(step) context
            stretches this rank's compute (hetcomm.simulated.SimulatedSpeed); the loop has
            the stretch paid after each leaf module's forward and each gradient.
    """

    def __init__(self, model: nn.Module, dataset, *, global_batch: int, collate_fn: Callable | None = None,
                 balance: str = "dynamic", split: Sequence[int] | None = None, equal_steps: int = 0,
                 handoff: bool = True, handoff_report_part: float = 1.0, rebalance_threshold: float = THRESHOLD,
                 memory_caps: Sequence[int | None] | None = None, probe_forward: Callable | None = None,
                 precision: str = "auto", wire_dtype: torch.dtype = torch.float16, bucket_cap_mb: float = 25.0,
                 loss_scale: float = 2.0**12, items_per_sample: int | None = None,
                 master_params: Sequence[torch.Tensor] | None = None, seed: int = 0,
                 data_fingerprint: str | None = None, simulated_speed=None, timeout: timedelta | None = None,
                 overlap: bool = True, shard: Shard | None = None):
        if not dist.is_initialized():
            raise RuntimeError("BalancedLoop: torch.distributed is not initialised; call dist.init_process_group "
                               "first (torchrun sets up its environment)")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        _check_arguments(dataset, global_batch, self.world, balance, equal_steps, rebalance_threshold,
                         loss_scale, items_per_sample, precision, collate_fn, probe_forward)
        if not (isinstance(handoff_report_part, (int, float)) and 0 < handoff_report_part <= 1):
            raise ValueError(f"BalancedLoop: handoff_report_part = {handoff_report_part!r}: expected a part of a "
                             f"share in (0, 1]")
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise ValueError("BalancedLoop: the model has no parameter that requires grad")
        self.model, self.dataset = model, dataset
        self.device = params[0].device
        self.collate_fn = collate_fn or default_collate
        self.global_batch = global_batch
        self.balance, self.equal_steps, self.items_per_sample = balance, equal_steps, items_per_sample
        self.data_fingerprint = _fingerprint_of(dataset, data_fingerprint)
        check_same_values({"global_batch": global_batch, "len(dataset)": len(dataset), "seed": seed,
                           "data_fingerprint": self.data_fingerprint}, "BalancedLoop")
        check_same_parameters(model)
        self.precision = precision if precision != "auto" else agree_precision(self.device, "auto")
        if precision != "auto":
            agree_precision(self.device, precision)
        self.masters = list(master_params) if master_params is not None else None
        self.speed = simulated_speed
        self.settle_now: Callable[[], None] = no_stretch   # the running compute phase's settle (LoopStep._run)
        if simulated_speed is not None:
            # Before the reducer's own gradient hooks, which run after these: a bucket leaves once
            # the stretch of its gradients is paid, as on a slower device.
            stretch_as_it_goes(model, params, lambda: self.settle_now())
        self.flat: FlatParameters | None = None
        self.sharded_weights: ShardedWeights | None = None
        self.shard = shard
        if shard is not None:
            self.reducer = self._sharded_reducer(shard, params, probe_forward, wire_dtype, bucket_cap_mb, timeout,
                                                 overlap)
        else:
            self.reducer = WeightedReducer(params, wire_dtype=wire_dtype, bucket_cap_mb=bucket_cap_mb,
                                           master_params=self.masters, timeout=timeout, gather_size=len(GATHERED),
                                           overlap=bool(overlap))
        self.last_total: float | None = None   # the last step's items over all ranks
        # One loss scale for all ranks: needed if the wire or any rank computes in fp16.
        scaled = torch.tensor([float(wire_dtype == torch.float16 or self.precision == "fp16")],
                              device=control_device(None))   # NCCL reduces CUDA tensors only
        dist.all_reduce(scaled, op=dist.ReduceOp.MAX)
        self.scaler = DynamicLossScaler(scale=loss_scale, growth_interval=200) if scaled.item() else None
        self.fixed_split = _check_fixed_split(split, self.world, global_batch)
        self.caps = self._agree_caps(memory_caps, probe_forward)
        start = self.fixed_split or equal_split(global_batch, self.world)
        self.sampler = WeightedDistributedSampler(len(dataset), start, self.rank, seed=seed)
        # The first step is timed in parts when it is a full one and no equal phase times it.
        self.time_first_step = not self.fixed_split and balance != "equal" and equal_steps == 0 \
            and len(dataset) >= global_batch
        # The split that timing deals rests on times the rebalancer leaves out: it is reviewed
        # once the rebalancer's own estimates are in.
        self.rebalancer = DistributedRebalancer(Rebalancer(global_batch, start, memory_caps=self.caps,
                                                           threshold=rebalance_threshold,
                                                           review_first=self.time_first_step and balance == "dynamic",
                                                           **TRAINING_SETTINGS))
        self.split = start
        # A handoff cuts ranks' runs of micro-batches differently; fully sharded weights need equal counts.
        self.handoff_enabled = handoff and balance == "dynamic" and not self.fixed_split \
            and self.sharded_weights is None
        self.handoff_report_part = handoff_report_part
        # The handoff's reports travel while the ranks compute: on a CPU group, so that an
        # NCCL collective does not sit on the GPU waiting for the straggler's report.
        self.control_group = None
        if self.handoff_enabled and dist.get_backend() != "gloo":
            self.control_group = dist.new_group(backend="gloo")
        self.forward_share = ForwardShare()
        self.step = 0                         # optimizer steps done
        self.first_timing_seconds = 0.0     # how long the first step's timed parts took (waits included)
        self.previous_times = (0.0, 0.0)      # this rank's reduce and update seconds of the last step
        self.update_started: float | None = None
        self.stop_requested = False           # this rank was asked to stop (a signal handler may set it)
        self.stop_agreed = False              # some rank was: every rank stops after the same step

    def _sharded_reducer(self, shard, params, probe_forward, wire_dtype, bucket_cap_mb, timeout, overlap):
        """The trained parameters flattened, the ranks' ranges agreed (the memory probed
        on GPUs after one micro-batch's forward and backward) and their reducer."""
        if not isinstance(shard, Shard):
            raise TypeError(f"BalancedLoop: shard must be a hetcomm.shard.Shard; got {type(shard).__name__}")
        if self.masters is not None:
            raise ValueError("BalancedLoop: shard keeps the fp32 masters itself, on their owners; pass no "
                             "master_params (a 16-bit model's weights are what is sharded)")
        plan = None
        if shard.weights:
            if self.device.type == "cuda" and shard.memory is None and shard.ranges is None:
                raise ValueError("BalancedLoop: Shard(weights=True) needs memory= or ranges= (the planner's "
                                 "`hetcomm plan --shard full` gives them); a probe would hold the whole model")
            plan = plan_units(self.model, params, shard.units, "BalancedLoop")
            params = plan.flat_order()
        self.flat = FlatParameters(params, "BalancedLoop", whole_grads=not shard.streamed)
        bucket_elements = max(1, int(bucket_cap_mb * 2**20) // self.flat.dtype.itemsize)

        def probe() -> int:
            step = None
            if probe_forward is not None:
                def step():
                    with torch.random.fork_rng(devices=[self.device]), self.autocast():
                        loss = probe_forward(self.load([i % len(self.dataset) for i in range(shard.micro_batch)]))
                    loss.backward()
            memory = probe_state_memory(self.device, step)
            self.flat.zero_grads()
            return memory

        layout = agree_layout(shard, self.flat, bucket_elements, "BalancedLoop", probe)
        if plan is not None:
            self.sharded_weights = ShardedWeights(self.flat, plan, layout, timeout)
        if shard.streamed:
            return StreamedReducer(self.flat, layout, self.sharded_weights, wire_dtype=wire_dtype,
                                   bucket_cap_mb=bucket_cap_mb, timeout=timeout, gather_size=len(GATHERED))
        return ShardedReducer(self.flat, layout, wire_dtype=wire_dtype, bucket_cap_mb=bucket_cap_mb,
                              timeout=timeout, gather_size=len(GATHERED), overlap=bool(overlap))

    def zero_grads(self) -> None:
        """Zeros the trained gradients before a step (keeping a sharded loop's flat views)."""
        if isinstance(self.reducer, StreamedReducer):
            self.reducer.zero_grads()   # what is on its way lands first
        elif self.flat is not None:
            self.flat.zero_grads()
        else:
            self.model.zero_grad(set_to_none=True)

    # --- the user's side -------------------------------------------------------------

    def steps(self, total: int) -> Iterator[LoopStep]:
        """The steps from the current one (0, or where a checkpoint left off) up to
        `total`; iterate each step for its micro-batches, then call its reduce(). Ends
        early, on every rank after the same step, once a rank has called request_stop()."""
        if isinstance(total, bool) or not isinstance(total, int) or total < 0:
            raise ValueError(f"BalancedLoop.steps: total = {total!r}: expected a non-negative number of steps")
        check_same_values({"total": total}, "BalancedLoop.steps")
        while self.step < total and not self.stop_agreed:
            step = LoopStep(self)
            yield step
            if not step.reduced:
                raise RuntimeError(f"BalancedLoop: step {step.number} ended without step.reduce(); call it once "
                                   f"after the step's micro-batches")

    def request_stop(self) -> None:
        """Asks every rank to stop after the step under way (or the next one): the
        request travels with that step's reduction, so every rank's steps() ends after
        the same step and stop_agreed is set. Safe to call from a signal handler (a
        preempted job's SIGTERM): it only sets a flag."""
        self.stop_requested = True

    def autocast(self):
        """The autocast context of this rank's precision (nothing for fp32)."""
        dtype = AUTOCAST_DTYPES[self.precision]
        return torch.autocast(self.device.type, dtype=dtype) if dtype is not None else nullcontext()

    @property
    def trained_params(self) -> list[torch.Tensor]:
        """What the optimizer updates: the fp32 masters when given, else the parameters."""
        return self.masters if self.masters is not None else self.reducer.params

    def last_times(self) -> list[tuple[float, float]]:
        """Every rank's reduce and update seconds of the last step, which travel with the
        next step's agreement; at the end of a run (or before a checkpoint) this fetches
        them with one small all-reduce (every rank calls it)."""
        self._close_update()
        times = gather_floats(self.previous_times)
        self.previous_times = (0.0, 0.0)
        return [(reduce, update) for reduce, update in times]

    # --- checkpoints -----------------------------------------------------------------

    def state_dict(self) -> dict:
        """The loop's state for a checkpoint (every rank calls it: each rank's random
        streams and handoff forward shares are gathered; save rank 0's copy)."""
        cuda = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None
        mine = [None] * self.world
        dist.all_gather_object(mine, (torch.get_rng_state(), cuda, list(self.forward_share.recent)))
        return {"step": self.step, "data_fingerprint": self.data_fingerprint,
                "sampler": self.sampler.state_dict(), "last_total": self.last_total,
                "rebalancer": self.rebalancer.rebalancer.state_dict(), "split": list(self.split),
                "scaler": self.scaler.state_dict() if self.scaler else None,
                "rng": [m[0] for m in mine], "cuda_rng": [m[1] for m in mine], "forward_shares": [m[2] for m in mine]}

    def load_state_dict(self, state: dict, *, data_changed: bool = False) -> None:
        """Continues exactly where state_dict() was taken (same ranks, data and batch).
        A state taken on data of another fingerprint is refused unless `data_changed`
        (the data was changed on purpose); one without a fingerprint is not compared.

        On another number of ranks (a card removed or added) the data continues where it
        was, with the step, the loss scale and the data order; the new cluster is timed
        afresh (its first step in parts, or the equal steps), as the old split and speed
        estimates were of other ranks, and ranks past the old world keep their own
        random streams."""
        taken_on = state.get("data_fingerprint")
        if taken_on is not None and self.data_fingerprint is not None and taken_on != self.data_fingerprint \
                and not data_changed:
            raise ValueError(f"BalancedLoop.load_state_dict: the state was taken on data of fingerprint {taken_on!r}; "
                             f"this loop's dataset has {self.data_fingerprint!r}: its content changed. Pass "
                             f"data_changed=True to continue on it anyway")
        same_world = len(state["rng"]) == self.world
        sampler = dict(state["sampler"])
        if not same_world:
            sampler["sizes"] = list(self.fixed_split or equal_split(self.global_batch, self.world))
        self.sampler.load_state_dict(sampler)
        self.step = int(state["step"])
        self.last_total = state.get("last_total")
        if self.scaler and state["scaler"]:
            self.scaler.load_state_dict(state["scaler"])
        if self.rank < len(state["rng"]):
            torch.set_rng_state(state["rng"][self.rank])
            if self.device.type == "cuda" and state.get("cuda_rng") and state["cuda_rng"][self.rank] is not None:
                torch.cuda.set_rng_state(state["cuda_rng"][self.rank], self.device)
        if not same_world:
            self.split = tuple(sampler["sizes"])
            self.equal_steps = self.step + self.equal_steps if self.equal_steps else 0
            self.time_first_step = not self.fixed_split and self.balance != "equal" and self.equal_steps == 0
            return
        self.rebalancer.rebalancer.load_state_dict(state["rebalancer"])
        self.split = tuple(int(b) for b in state["split"])
        # A checkpoint of an older version holds check shares, which meant something else: learn them anew.
        self.forward_share.recent = [float(r) for r in state.get("forward_shares", [[]] * self.world)[self.rank]]
        self.time_first_step = False

    # --- what the steps use ----------------------------------------------------------

    def load(self, indices: list[int]):
        """The collated batch of these samples, on this rank's device."""
        return load_batch(self.dataset, self.collate_fn, indices, self.device)

    def compute_context(self, step: int):
        if self.speed is None:
            return nullcontext()
        # A speed object of the user's may take no `waited`: only sharded weights wait within the compute.
        return self.speed.compute(step, waited=self.waited) if self.sharded_weights is not None \
            else self.speed.compute(step)

    def waited(self) -> float:
        """Seconds this rank has spent blocked on the other ranks within its compute so
        far: sharded weights' gathers and streamed gradients (0 without them)."""
        return self.sharded_weights.waited if self.sharded_weights is not None else 0.0

    def expected_total(self, step_samples: int) -> float | None:
        """The step's items over all ranks as the buckets are packed by: exact with
        items_per_sample, else the last step's (None at the first)."""
        if self.items_per_sample is not None:
            return float(step_samples * self.items_per_sample)
        return self.last_total

    def cap(self) -> int | None:
        return self.caps[self.rank] if self.caps else None

    def runs_of(self, indices: list[int], counts: list[int] | None) -> list[list[int] | None]:
        """With sharded weights, this rank's micro-batches of `indices`, `counts` being
        every rank's count in the same run: every rank gets as many micro-batches as the
        rank that needs the most (its count over its cap), cut as evenly as they go; a
        rank with fewer samples than that gets None for each missing one (a padding
        micro-batch, whose loss counts zero)."""
        if counts is None or len(counts) != self.world or counts[self.rank] != len(indices):
            raise RuntimeError(f"BalancedLoop: a run of {len(indices)} samples without every rank's count "
                               f"({counts}); sharded weights need them to align the micro-batches")
        runs = max(len(micro_batches(list(range(c)), self.caps[r] if self.caps else None))
                   for r, c in enumerate(counts))
        if len(indices) < runs:
            return [[i] for i in indices] + [None] * (runs - len(indices))
        base, extra = divmod(len(indices), runs)
        cuts = [0]
        for k in range(runs):
            cuts.append(cuts[-1] + base + (k < extra))
        return [indices[a:b] for a, b in zip(cuts, cuts[1:])]

    def set_split(self, sizes: tuple[int, ...]) -> None:
        self.split = tuple(sizes)
        self.rebalancer.rebalancer.adopt(self.split)
        self.sampler.set_split(self.split)

    def _close_update(self) -> None:
        """The update (the user's optimizer step and whatever else came after reduce())
        ends when the next step starts."""
        if self.update_started is not None:
            self.previous_times = (self.previous_times[0], time.perf_counter() - self.update_started)
            self.update_started = None

    def _regime(self, step: int) -> str:
        if self.fixed_split:
            return "fixed split"
        if self.balance == "equal" or step < self.equal_steps or (step == 0 and not self.time_first_step):
            return "equal split"
        return "balanced" if self.balance == "dynamic" else "static split"

    def choose_next_split(self, everyone: list[list[float]], step_samples: int, timed_first: bool) -> None:
        """The split of the next step, from every rank's gathered row (the same on every
        rank). After a timed first step, the split its second and third parts' throughputs
        ask for (LoopStep._first_step_in_parts); the rebalancer leaves that step's times
        out: they add mostly one-time costs (allocator growth, thread pools, autotuning;
        10% on CPU), which would inflate the noise estimate that holds the next change back."""
        self.stop_agreed = self.stop_agreed or any(row[GATHERED.index("stop")] > 0 for row in everyone)
        done = [round(row[GATHERED.index("samples")]) for row in everyone]
        if sum(done) != step_samples:
            raise ValueError(f"BalancedLoop: the ranks did {done} samples, {sum(done)} in all, of a step of "
                             f"{step_samples}; a handoff was planned differently on different ranks")
        times = [row[GATHERED.index("measured_s")] for row in everyone]
        measured = [round(row[GATHERED.index("measured_samples")]) for row in everyone]
        decision = None if timed_first else self.rebalancer.step(times[self.rank], times, measured)
        following = self.step + 1
        if self.fixed_split:
            sizes = self.fixed_split
        elif self.balance == "equal" or following < self.equal_steps:
            sizes = equal_split(self.global_batch, self.world)
        elif following == self.equal_steps:
            # The end of the equal phase: the first profile's best split, adopted outright.
            sizes = solve_split(self.global_batch, self.rebalancer.rebalancer.model(), self.caps).sizes
        elif timed_first:
            rates = [(0.0, seconds / samples) for seconds, samples in zip(times, measured)]
            sizes = solve_split(self.global_batch, rates, self.caps).sizes
        elif self.balance == "static":
            sizes = self.split
        else:
            sizes = self.split if decision is None else decision.sizes
        self.set_split(sizes)

    def _agree_caps(self, memory_caps, probe_forward) -> list[int | None] | None:
        """Each rank's largest micro-batch: as given, or probed on GPUs by running the
        forward and backward at growing sizes (an out-of-memory error becomes the cap;
        CPUs have none), gathered so that every rank holds every cap. None when no rank
        has one. A rank that cannot hold one sample stops every rank with the same error."""
        if memory_caps is not None:
            caps = list(memory_caps)
            if len(caps) != self.world or any(c is not None and (isinstance(c, bool) or not isinstance(c, int)
                                                                 or c < 1) for c in caps):
                raise ValueError(f"BalancedLoop: memory_caps = {caps!r}: expected one positive integer or None "
                                 f"per rank ({self.world})")
            return caps if any(c is not None for c in caps) else None
        if probe_forward is None:
            return None
        if self.sharded_weights is not None:
            raise ValueError("BalancedLoop: with Shard(weights=True) pass memory_caps (the planner's micro-batches): "
                             "probing runs a different number of forwards on each rank, and their gathers would "
                             "not meet")
        cap = self._probe_cap(probe_forward)
        caps: list[int | None] = [None] * self.world
        dist.all_gather_object(caps, cap)
        for rank, found in enumerate(caps):
            if found == 0:
                raise ValueError(f"rank {rank} cannot hold one sample in its device's memory; use a smaller model "
                                 f"or samples, or leave that device out")
        return caps if any(c is not None for c in caps) else None

    def _probe_cap(self, probe_forward: Callable) -> int | None:
        def step(size: int) -> None:
            batch = self.load([i % len(self.dataset) for i in range(size)])
            with self.autocast():
                loss = probe_forward(batch)
            loss.backward()

        # What training holds and the probe's step does not yet must be held while probing,
        # or the caps leave no room for it: the optimizer's state (AdamW's two fp32 moments),
        # the masters' fp32 gradients and the reducer's wire buffers.
        held = torch.empty(self.memory_held_by_training() if self.device.type == "cuda" else 0, dtype=torch.uint8,
                           device=self.device)
        # Probing must leave no trace: no gradients, the random streams where they were.
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            cap = probe_memory(step, self.device, self.global_batch).cap
        del held
        self.zero_grads()
        return cap

    def memory_held_by_training(self) -> int:
        """Bytes that training allocates on the device beyond the model and its gradients,
        none of them before the first step: AdamW's two fp32 moments per trained element,
        the masters' fp32 gradients, the reducer's wire buffers."""
        if self.flat is not None:   # the state of this rank's range, and a wire of its own if the dtypes differ
            start, stop = self.reducer.range
            wire = 0 if self.reducer.in_place else self.flat.total * self.reducer.wire_dtype.itemsize
            bucket = max((b.numel for b in self.reducer.buckets), default=0)
            streamed = isinstance(self.reducer, StreamedReducer)
            return bytes_needed(stop - start, self.flat.dtype, bucket, self.sharded_weights is not None,
                                streamed, self.shard.offloaded) + wire
        elements = sum(p.numel() for p in self.trained_params)
        return elements * (8 + (4 if self.masters is not None else 0) + self.reducer.wire_dtype.itemsize)


def _fingerprint_of(dataset, given: str | None) -> str | None:
    """`given`, else the dataset's fingerprint() if it has one; a string or None."""
    if given is None and callable(getattr(dataset, "fingerprint", None)):
        given = dataset.fingerprint()
        if not isinstance(given, str):
            raise TypeError(f"BalancedLoop: dataset.fingerprint() returned {type(given).__name__}; expected a str")
    elif given is not None and not isinstance(given, str):
        raise TypeError(f"BalancedLoop: data_fingerprint = {given!r}: expected a str or None")
    return given


def _check_arguments(dataset, global_batch, world, balance, equal_steps, threshold, loss_scale, items_per_sample,
                     precision, collate_fn, probe_forward) -> None:
    """ValueError naming the argument, before any collective."""
    if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        raise ValueError(f"BalancedLoop: dataset must be a map-style dataset (len and [i]); got "
                         f"{type(dataset).__name__}")
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < world:
        raise ValueError(f"BalancedLoop: global_batch = {global_batch!r}: expected an integer of at least the "
                         f"{world} ranks (every rank needs one sample to be timed)")
    if len(dataset) < global_batch:
        raise ValueError(f"BalancedLoop: the dataset holds {len(dataset)} samples, fewer than global_batch = "
                         f"{global_batch}; use a smaller global batch or more data")
    if balance not in BALANCE:
        raise ValueError(f"BalancedLoop: balance = {balance!r}: expected one of {', '.join(BALANCE)}")
    if isinstance(equal_steps, bool) or not isinstance(equal_steps, int) or equal_steps < 0:
        raise ValueError(f"BalancedLoop: equal_steps = {equal_steps!r}: expected a non-negative integer")
    if not (isinstance(threshold, (int, float)) and math.isfinite(threshold) and threshold >= 0):
        raise ValueError(f"BalancedLoop: rebalance_threshold = {threshold!r}: expected a finite, non-negative "
                         f"fraction")
    if not (isinstance(loss_scale, (int, float)) and math.isfinite(loss_scale) and loss_scale > 0):
        raise ValueError(f"BalancedLoop: loss_scale = {loss_scale!r}: expected a finite positive number")
    if items_per_sample is not None and (isinstance(items_per_sample, bool) or not isinstance(items_per_sample, int)
                                         or items_per_sample < 1):
        raise ValueError(f"BalancedLoop: items_per_sample = {items_per_sample!r}: expected a positive integer "
                         f"or None")
    if precision not in ("auto", *PRECISIONS):
        raise ValueError(f"BalancedLoop: precision = {precision!r}: expected auto or one of {', '.join(PRECISIONS)}")
    for name, value in (("collate_fn", collate_fn), ("probe_forward", probe_forward)):
        if value is not None and not callable(value):
            raise ValueError(f"BalancedLoop: {name} must be callable; got {type(value).__name__}")


def _check_fixed_split(split, world: int, global_batch: int) -> tuple[int, ...] | None:
    if split is None:
        return None
    split = tuple(split)
    if len(split) != world or any(isinstance(b, bool) or not isinstance(b, int) or b < 0 for b in split) \
            or sum(split) != global_batch:
        raise ValueError(f"BalancedLoop: split = {list(split)!r}: expected {world} non-negative integers adding up "
                         f"to global_batch = {global_batch}")
    return split
