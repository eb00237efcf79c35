"""One rank's training run: the model (a GPT, or a Llama-style decoder), its token
windows, AdamW with a warm-up and cosine schedule, the log and the checkpoints, composed
with a hetcomm.loop.BalancedLoop that owns everything of balanced heterogeneous training.
The trainer is one client of that loop, as a user's own training loop is.

Per optimizer step, on every rank:
  1. the loop deals this rank's windows by the current split and yields them as
     micro-batches (several when the share is over the rank's memory cap; with dynamic
     balancing a quarter of the share first, then a report, so that a rank far behind
     can hand the rest to the others within the step);
  2. forward and backward of each, the loss summed over the window's target tokens
     (every window has block_size of them, so the step's weights are known in advance);
  3. reduce: the gradient of the mean loss over all target tokens, with the overflow
     verdict and the global norm (identical on every rank); while the gradients travel,
     the loop picks the next step's split;
  4. unless an overflow: clip by that norm and AdamW (a 16-bit model's on its fp32 masters:
     hetcomm.optim.AdamW, one fused pass that clips and writes the 16-bit weights too);
  5. log (rank 0): every rank's figures travel with the reduction; its reduce and update
     times, known only after it, with the next one, so a line is written one step late.
"""

import math
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from hetcomm.balance import equal_split
from hetcomm.loop import BalancedLoop, StepResult, agree_precision
from hetcomm.loop import checkpoint
from hetcomm.loop.census import describe_by_node
from hetcomm.optim import AdamW
from hetcomm.shard import Shard, ShardedAdamW
from hetcomm.shard import checkpoint as shard_checkpoint
from hetcomm.shard.layout import host_bytes_per_element, state_bytes_per_element
from hetcomm.train.config import (TrainConfig, full_shard, parse_caps, parse_checkpointing, parse_split,
                                  parse_state_memory)
from hetcomm.train.data import TokenWindows, load_windows
from hetcomm.train.data_fingerprint import data_fingerprint, remember_fingerprint
from hetcomm.train.llama import Llama, LlamaConfig
from hetcomm.train.model import GPT, GPTConfig
from hetcomm.train.runlog import RunLog
from hetcomm.simulated import SimulatedSpeed, parse_slowdown, parse_speeds


def learning_rate(config: TrainConfig, step: int) -> float:
    """Linear warm-up, then cosine decay to min_lr at the last step."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
    return config.min_lr + 0.5 * (config.lr - config.min_lr) * (1 + math.cos(math.pi * min(1.0, progress)))


def param_groups(params: list[torch.Tensor], config: TrainConfig) -> list[dict]:
    """Weight decay on matrices only (not on biases, norms)."""
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    return [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def make_optimizer(params: list[torch.Tensor], config: TrainConfig,
                   copies: list[torch.Tensor] | None = None) -> torch.optim.Optimizer:
    """AdamW over the model's parameters, or over the fp32 masters of a 16-bit model
    with their `copies` (the model's weights, in the masters' order), with weight decay
    on matrices only (not on biases, norms). The masters' is hetcomm.optim.AdamW: one
    pass from the gradient, times the clipping coefficient, to the 16-bit weight. An
    fp32 model's is torch's fused kernel on CPU and CUDA (a third of the for-loop's
    time on CPU, one launch on GPUs)."""
    groups = param_groups(params, config)
    decay, no_decay = groups[0]["params"], groups[1]["params"]
    if copies is not None:
        copy_of = dict(zip(map(id, params), copies, strict=True))
        return AdamW(groups, lr=config.lr, betas=(0.9, 0.95), copies=[copy_of[id(p)] for p in decay + no_decay])
    fused = params[0].device.type in ("cpu", "cuda")
    return torch.optim.AdamW(groups, lr=config.lr, betas=(0.9, 0.95), fused=fused)


def run_description(config: TrainConfig, world: int, data_description: str, data_size: int) -> dict:
    """What a checkpoint must match to be resumed by this run. A sharded run's state is
    resharded on load: it resumes on another number of ranks."""
    # A full shard's layout is of its units' order: it resumes a full shard alone.
    ranks = {"sharded": "full" if full_shard(config) else True} if config.shard else {"world_size": world}
    return {**ranks, "global_batch": config.global_batch, "block_size": config.block_size,
            "n_layer": config.n_layer, "n_head": config.n_head, "n_embd": config.n_embd, "seed": config.seed,
            "wire": config.wire, "data": data_description, "windows": data_size, "steps": config.steps,
            **llama_description(config)}


def llama_description(config: TrainConfig) -> dict:
    """A Llama-style run's shape beyond GPT's (nothing for a GPT run: its checkpoints of
    before --arch still resume)."""
    if config.arch != "llama":
        return {}
    shape = model_config(config, 1)
    return {"arch": "llama", "n_kv_head": shape.n_kv_head, "intermediate": shape.intermediate}


def model_config(config: TrainConfig, vocab_size: int) -> GPTConfig | LlamaConfig:
    if config.arch == "llama":
        return LlamaConfig(vocab_size=vocab_size, block_size=config.block_size, n_layer=config.n_layer,
                           n_head=config.n_head, n_kv_head=config.n_kv_head, n_embd=config.n_embd,
                           intermediate=config.intermediate, dropout=config.dropout)
    return GPTConfig(vocab_size=vocab_size, block_size=config.block_size, n_layer=config.n_layer,
                     n_head=config.n_head, n_embd=config.n_embd, dropout=config.dropout)


def build_model(config: TrainConfig, vocab_size: int) -> GPT | Llama:
    shape = model_config(config, vocab_size)
    return Llama(shape) if isinstance(shape, LlamaConfig) else GPT(shape)


def check_resumable(state: dict, config: TrainConfig, vocab_size: int) -> None:
    """Raises CheckpointError unless a verified checkpoint holds what this run resumes:
    the model's tensors by name and shape (checked on a model without storage), the
    optimizer's state, the loop's state, a step within the run."""
    with torch.device("meta"):
        shapes = {name: tuple(t.shape) for name, t in build_model(config, vocab_size).state_dict().items()}
    held = {name: tuple(t.shape) for name, t in state.get("model", {}).items()} \
        if isinstance(state.get("model"), dict) else {}
    for name in sorted(set(shapes) | set(held)):
        if shapes.get(name) != held.get(name):
            raise checkpoint.CheckpointError(f"the checkpoint's model tensor {name} is {held.get(name)}, this run's "
                                             f"{shapes.get(name)}")
    for part in ("optimizer", "loop", "phases"):
        if part not in state:
            raise checkpoint.CheckpointError(f"the checkpoint holds no {part} state")
    if state["step"] > config.steps or state["loop"].get("step") != state["step"]:
        raise checkpoint.CheckpointError(f"the checkpoint's step {state['step']} is not one of this run's "
                                         f"{config.steps} (its loop is at {state['loop'].get('step')!r})")


def check_ranges(state: dict, path: Path) -> None:
    """Raises CheckpointError unless a sharded run's checkpoint has every range of its
    optimizer state beside it, of its model and tiling its parameters (their values
    checked; each rank checks the bytes of the ranges it reads)."""
    saved = state.get("shard")
    if not isinstance(saved, dict) or "bounds" not in saved or "digest" not in saved:
        raise checkpoint.CheckpointError(f"{path}: holds no layout of sharded optimizer state")
    shard_checkpoint.check_step(Path(path).parent, state["step"], saved["bounds"][-1], saved["digest"])


def load_data(config: TrainConfig) -> tuple[TokenWindows, str]:
    return load_windows(config.data, config.block_size, config.vocab_size)


@dataclass
class Phase:
    """Step times of a stretch of the run with one balancing regime."""

    name: str
    step_seconds: list[float] = field(default_factory=list)

    def median(self) -> float:
        ordered = sorted(self.step_seconds)
        return ordered[len(ordered) // 2] if ordered else float("nan")


class LauncherLost(RuntimeError):
    """Ranks whose launcher died (a torchrun agent killed, its node's other processes
    left) stopped the job: their SIGTERM (launch's parent-death signal) stopped every
    rank after one step, with a checkpoint; the job must be started again."""


class Trainer:
    def __init__(self, config: TrainConfig, rank: int, world: int, device: torch.device):
        self.config, self.rank, self.world, self.device = config, rank, world, device
        # Who started this rank (torchrun's agent, the launcher's fork server): once it has
        # died, this rank's stop is the loss of its node, not a preemption (see LauncherLost).
        self.launcher = os.getppid()
        torch.manual_seed(config.seed)
        self.data, data_description = load_data(config)
        self.model = build_model(config, self.data.vocab_size).to(device)
        self.model.checkpointing = parse_checkpointing(config.checkpointing, world)[rank]
        self.precision = agree_precision(device, config.precision)
        # Computing in 16-bit with --weights compute: the model holds 16-bit weights (no
        # per-forward casts, half the weight reads) and the optimizer fp32 masters, which
        # the reducer unpacks the gradient into and one fused cast copies back each step.
        self.masters: list[torch.nn.Parameter] | None = None
        dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(self.precision)
        # Sharded, the fp32 masters live on their ranges' owners (hetcomm.shard.ShardedAdamW).
        initial_masters = None
        if dtype is not None and config.weights == "compute":
            if not config.shard:
                self.masters = [torch.nn.Parameter(p.detach().clone()) for p in self.model.parameters()]
            else:   # the fp32 weights the owners' masters start from (on the host until they are taken)
                initial_masters = {id(p): p.detach().to("cpu", copy=True) for p in self.model.parameters()}
            self.model.to(dtype)
        self.simulated = config.speeds is not None or bool(config.slowdown)
        speeds = parse_speeds(config.speeds, world) if config.speeds else [1.0] * world
        speed = SimulatedSpeed(rank, speeds[rank], tuple(parse_slowdown(s, world) for s in config.slowdown),
                               device.type)
        # What checkpoints record of the data's content (the launcher has it; a Trainer made
        # directly hashes it here). The loop checks that every rank has the same: ranks on
        # several hosts read their own copy of --data.
        self.data_fingerprint = config.data_fingerprint or data_fingerprint(config.data, self.data.tokens,
                                                                            config.out)
        # Every window's block_size targets carry loss: the weights are known before the
        # reduction, and their agreement travels beside the gradients.
        self.loop = BalancedLoop(
            self.model, self.data, global_batch=config.global_batch,
            balance=config.balance, split=parse_split(config.split, world, config.global_batch) if config.split
            else None, equal_steps=config.equal_steps, handoff=config.handoff,
            rebalance_threshold=config.rebalance_threshold,
            memory_caps=parse_caps(config.memory_caps, world) if config.memory_caps else None,
            probe_forward=None if full_shard(config) else self._summed_loss,
            precision=self.precision, wire_dtype=getattr(torch, config.wire),
            loss_scale=config.loss_scale, items_per_sample=config.block_size, master_params=self.masters,
            seed=config.seed, data_fingerprint=self.data_fingerprint["sha256"], simulated_speed=speed,
            timeout=timedelta(seconds=config.timeout), overlap=config.overlap,
            shard=self._shard(world, device) if config.shard else None)
        if config.shard:
            # In the flat order, which full sharding makes the blocks' order.
            masters = None if initial_masters is None else [initial_masters[id(p)] for p in self.loop.flat.params]
            self.optimizer = ShardedAdamW(param_groups(list(self.model.parameters()), config), self.loop.reducer,
                                          lr=config.lr, betas=(0.9, 0.95), initial_masters=masters,
                                          offload=config.offload == "optimizer")
        else:
            self.optimizer = make_optimizer(self.trained_params(), config,
                                            list(self.model.parameters()) if self.masters is not None else None)
        self.reducer = self.loop.reducer
        self.caps = self.loop.caps
        self.speed = speed
        self._pending: dict | None = None   # rank 0: the last step's log line, waiting for its times
        self.description = run_description(config, world, data_description, len(self.data))
        self.phases: list[Phase] = []
        if config.resume:
            self._resume(config.resume)
        self._check_same_start()
        ranks = self._describe_ranks()
        self.log = None
        if rank == 0:
            # A kill during a checkpoint's write leaves its temporary file; a run that does not
            # resume here starts over (the launcher stopped it unless that is what was asked).
            checkpoint.remove_temporaries(config.out)
            if not config.resume:
                for old in checkpoint.checkpoints(config.out):
                    old.unlink()
                shard_checkpoint.remove_unkept(config.out)
            self.log = RunLog(config.out, {"config": config.to_dict(), "run": self.description,
                                           "vocab_size": self.data.vocab_size, "ranks": ranks,
                                           "memory_caps": self.caps, "simulated": self.simulated},
                              resume_step=self.step if config.resume else None)
            remember_fingerprint(self.data_fingerprint, config.out)

    @property
    def step(self) -> int:
        return self.loop.step

    def _shard(self, world: int, device: torch.device) -> Shard:
        """--state-memory, or on GPUs the memory each rank measures (with the state alone
        sharded and offloaded: equal ranges), or on CPUs the host's available memory
        shared by its ranks."""
        full = full_shard(self.config)
        offload = self.config.offload
        if self.config.state_memory is not None:
            return Shard(memory=parse_state_memory(self.config.state_memory, world), weights=full, offload=offload)
        if device.type == "cuda":
            return Shard(offload=offload)
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        host = torch.tensor([available], dtype=torch.float64)
        dist.all_reduce(host, op=dist.ReduceOp.MIN)   # ranks may share a host: each takes a world's share
        return Shard(memory=[int(host.item()) // world] * world, weights=full, offload=offload)

    def _summed_loss(self, batch) -> torch.Tensor:
        inputs, targets = batch
        return self.model(inputs, targets, reduction="sum")[1]

    def trained_params(self) -> list[torch.Tensor]:
        """What the optimizer updates: the fp32 masters of a 16-bit model, or its parameters."""
        return self.masters if self.masters is not None else list(self.model.parameters())

    def memory_held_by_training(self) -> int:
        return self.loop.memory_held_by_training()

    def _model_state(self) -> dict | None:
        """The model's state dict with the fp32 masters' values where there are masters
        (a checkpoint holds the weights at full precision). Fully sharded, every rank
        gathers the model a layer unit at a time for it (collectives; a card holds one
        unit more than in training, never the whole model): rank 0 keeps a host copy,
        the others None."""
        sharded = self.loop.sharded_weights
        state = self.model.state_dict(keep_vars=True)
        if sharded is not None:
            names = {}
            for name, t in state.items():
                names.setdefault(id(t), []).append(name)
            copies = {}
            for members in sharded.unit_by_unit():
                if self.rank == 0:
                    for p in members:
                        copy = p.detach().to("cpu", copy=True)
                        copies.update((name, copy) for name in names.pop(id(p)))
            if self.rank != 0:
                return None
            # Buffers, and any tensor outside the units, are whole on every rank.
            copies.update((name, state[name].detach().to("cpu", copy=True)) for left in names.values()
                          for name in left)
            return {name: copies[name] for name in state}
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
                    weights=self._weights_description(), checkpointing=self.model.checkpointing)
        ranks = [None] * self.world
        dist.all_gather_object(ranks, mine)
        return ranks

    def _weights_description(self) -> str:
        if self.config.shard:
            sixteen = self.loop.flat.dtype != torch.float32
            what = "weights, gradients and state" if full_shard(self.config) else "state"
            where = f"{self.optimizer.state_bytes():,} bytes of state here"
            if self.optimizer.offload:
                where = f"state offloaded: {self.optimizer.host_bytes():,} bytes of host memory"
            return f"{'16-bit' if sixteen else 'fp32'}, {what} sharded ({where})"
        return "16-bit, fp32 masters" if self.masters is not None else "fp32"

    # --- one step -------------------------------------------------------------------

    def train_step(self, step) -> StepResult:
        """One optimizer step of the loop's `step`: the windows' forward and backward
        (the loss summed over their target tokens), the weighted reduction, then unless
        it found an overflow: clipping by the reduced norm and AdamW (a 16-bit model's on its
        fp32 masters, one fused pass that writes the 16-bit weights too)."""
        for group in self.optimizer.param_groups:
            group["lr"] = learning_rate(self.config, step.number)
        for inputs, targets in step:
            with self.loop.autocast():
                _, loss = self.model(inputs, targets, reduction="sum")
            step.backward(loss, reduction="sum")
        result = step.reduce()
        if not result.skipped:
            if self.masters is not None or self.config.shard:
                # Clipped within the fused step, which writes the 16-bit weights too.
                clip = result.clip_coefficient(self.config.grad_clip) if self.config.grad_clip > 0 else 1.0
                self.optimizer.step(grad_scale=clip)
            else:
                if self.config.grad_clip > 0:
                    result.clip_grad_norm_(self.config.grad_clip)
                self.optimizer.step()
        return result

    # --- the run --------------------------------------------------------------------

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
        run_start, first_step = time.perf_counter(), self.step
        step_start = time.perf_counter()
        # Preemption (torchrun and schedulers send SIGTERM): the ranks agree on a step to
        # stop after, checkpoint there and return; the same command resumes.
        previous = signal.signal(signal.SIGTERM, lambda *_: self.loop.request_stop()) \
            if threading.current_thread() is threading.main_thread() else None
        for step in self.loop.steps(last):
            result = self.train_step(step)
            if not self.phases or self.phases[-1].name != result.regime:
                self.phases.append(Phase(result.regime))
            if self.rank == 0:
                self._complete_pending(result)
                self._pending = self._log_line(result)
                if progress:
                    progress.set_postfix(loss=f"{result.loss:.3f}", split="/".join(map(str, result.split)))
                    progress.update()
            # The whole step, up to the next one's start: the reduction, the update, the
            # choice of the split and the log line all delay it.
            now = time.perf_counter()
            step_seconds, step_start = now - step_start, now
            if self.rank == 0:
                tokens = sum(r.count for r in result.ranks)
                self._pending.update(step_s=step_seconds, tokens_per_second=tokens / step_seconds)
            if result.number > 0:  # the first step pays for warm-up (allocator, thread pools), not for the split
                self.phases[-1].step_seconds.append(step_seconds)
            if config.checkpoint_every and self.step % config.checkpoint_every == 0 and self.step < config.steps:
                self.save_checkpoint()
                step_start = time.perf_counter()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        if progress:
            progress.close()
        if self.loop.stop_agreed and self.step < config.steps:
            self.save_checkpoint()
            self._check_launchers_live()
            return None
        if self.step < config.steps:
            self._complete_log()   # save_checkpoint does it otherwise
            return None
        self.save_checkpoint()
        summary = {**self._summary(time.perf_counter() - run_start), "first_step": first_step}
        if self.log:
            self.log.summary(summary)
            self.log.close()
        return summary

    def _log_line(self, result: StepResult) -> dict:
        """The step's log line as far as it is known on this step (rank 0)."""
        compute = [r.compute_s for r in result.ranks]
        samples = [r.samples for r in result.ranks]
        return {
            "step": result.number, "simulated": self.simulated, "phase": result.regime,
            "loss": result.loss, "micro_batch": list(result.split), "samples": samples, "compute_s": compute,
            # A handoff: the samples it moved, and the step's compute as it predicted it with and without.
            "handoff": None if result.handoff is None else {
                "moved": result.handoff.moved, "predicted_s": result.handoff.step_seconds,
                "as_dealt_s": result.handoff.without_seconds},
            "samples_per_second": [b / t if t > 0 and b > 0 else 0.0 for b, t in zip(samples, compute)],
            "loss_scale": result.loss_scale, "skipped": result.skipped, "grad_norm": result.grad_norm,
            "lr": self.optimizer.param_groups[0]["lr"],
        }

    def _complete_pending(self, result: StepResult) -> None:
        """Writes the last step's log line with every rank's reduce and update seconds,
        which travelled with this step's agreement (rank 0)."""
        self._write_pending([r.previous_reduce_s for r in result.ranks], [r.previous_update_s for r in result.ranks])

    def _write_pending(self, reduce: list[float], update: list[float]) -> None:
        if self._pending is not None:
            self._pending.update(wait_s=reduce, update_s=update)
            self.log.step(self._pending)
            self._pending = None

    def _complete_log(self) -> None:
        """Before a checkpoint and when the run stops: the last step's reduce and update
        times have no next step to travel with, so the loop fetches them (every rank)."""
        times = self.loop.last_times()
        if self.rank == 0:
            self._write_pending([reduce for reduce, _ in times], [update for _, update in times])

    def _summary(self, seconds: float) -> dict:
        model = self.loop.rebalancer.rebalancer.model()
        throughputs = [1.0 / c for _, c in model]  # samples per second of compute, as last estimated
        batch = self.config.global_batch
        ideal = batch / sum(throughputs)
        equal = max(b / s for b, s in zip(equal_split(batch, self.world), throughputs))
        phases = {p.name: {"steps": len(p.step_seconds), "median_step_s": p.median()} for p in self.phases}
        shard = None
        if self.config.shard:
            sizes = self.loop.reducer.layout.sizes()
            full = full_shard(self.config)
            offload = self.config.offload == "optimizer"
            per = state_bytes_per_element(self.loop.flat.dtype, weights=full, streamed=full, offload=offload)
            shard = {"elements": sizes, "state_bytes": [n * per for n in sizes],
                     "unsharded_state_bytes": self.loop.flat.total * per,
                     "what": ("weights and gradient sums" if offload else "weights, gradient sums and optimizer state")
                     if full else "optimizer state"}
            if offload:
                host = host_bytes_per_element(self.loop.flat.dtype)
                shard["host_bytes"] = [n * host for n in sizes]
        return {"simulated": self.simulated, "steps": self.step, "seconds": seconds, "shard": shard,
                "probe_s": self.loop.first_timing_seconds, "phases": phases,
                "final_split": list(self.loop.split),
                "estimated_samples_per_second": throughputs,
                "ideal_step_s": ideal, "equal_split_step_s_predicted": equal}

    def _check_launchers_live(self) -> None:
        """After a stop every rank agreed to: raises LauncherLost on every rank if some
        rank's launcher has died. Its agent gone, a torchrun node cannot go on (nor restart
        its workers), and a job whose ranks all returned would keep the other nodes' agents
        waiting for it at their exit barrier (300 s) and then report success."""
        mine = (os.getppid() != self.launcher, os.environ.get("GROUP_RANK"))   # torchrun's node rank
        everyone = [None] * self.world
        dist.all_gather_object(everyone, mine)
        lost = [rank for rank, (orphaned, _) in enumerate(everyone) if orphaned]
        if lost:
            raise LauncherLost(f"{describe_by_node(lost, [node for _, node in everyone])} lost the launcher "
                               f"that started them (a torchrun agent killed?); every rank stopped after step "
                               f"{self.step} with a checkpoint in {self.config.out}; start the job again (the same "
                               f"command on every node resumes from it)")

    # --- checkpoints ----------------------------------------------------------------

    def save_checkpoint(self) -> None:
        """Rank 0 writes the checkpoint; sharded, every rank first writes its range of
        the optimizer state beside it, and the checkpoint itself comes only once every
        range is on disk."""
        self._complete_log()
        loop_state = self.loop.state_dict()
        model_state = self._model_state() if self.rank == 0 or self.loop.sharded_weights is not None else None
        sharded = {}
        if self.config.shard:
            flat, (start, stop) = self.loop.flat, self.loop.reducer.range
            shard_checkpoint.save_range(self.config.out, self.step, self.rank, self.world, start, stop, flat.total,
                                        flat.digest(), self.optimizer.shard_state())
            dist.barrier()
            sharded = {"shard": {"bounds": list(self.loop.reducer.layout.bounds), "digest": flat.digest()}}
        if self.rank == 0:
            checkpoint.save(self.config.out, self.step,
                            {"run": {**self.description, "data_sha256": self.data_fingerprint["sha256"]},
                             "model": model_state,
                             "optimizer": self.optimizer.state_dict(), "loop": loop_state,
                             "phases": [[p.name, p.step_seconds] for p in self.phases], **sharded},
                            keep=self.config.keep)
            if self.config.shard:
                shard_checkpoint.remove_unkept(self.config.out)
        dist.barrier()

    @property
    def checkpoint_path(self) -> Path | None:
        """The newest checkpoint in --out."""
        found = checkpoint.checkpoints(self.config.out)
        return found[0] if found else None

    def _resume(self, path: str) -> None:
        state = checkpoint.load(path, self.description)
        check_resumable(state, self.config, self.data.vocab_size)
        if self.loop.sharded_weights is None:   # fully sharded, the ranges restore the weights (_resume_shard)
            self.model.load_state_dict(state["model"])
        if self.masters is not None:
            names = [name for name, _ in self.model.named_parameters()]
            with torch.no_grad():
                for name, master in zip(names, self.masters):
                    master.copy_(state["model"][name])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.config.shard:
            self._resume_shard(Path(path).parent, state)
        self.loop.load_state_dict(state["loop"], data_changed=self.config.data_changed)
        self.phases = [Phase(name, list(seconds)) for name, seconds in state["phases"]]

    def _check_same_start(self) -> None:
        """Raises CheckpointError on every rank, before anything is written, unless every
        rank starts at the same step. Each rank resumes from the newest checkpoint in its
        own --out: on machines that do not share that directory, a node that found none
        started over while the others resumed; the ranks trained apart (other weights, one
        reduced gradient) until their step counts parted, then failed with a timeout that
        named neither the cause nor the node."""
        everyone = [None] * self.world
        dist.all_gather_object(everyone, (self.step, os.environ.get("GROUP_RANK")))   # torchrun's node rank
        starts = sorted({step for step, _ in everyone})
        if len(starts) > 1:
            nodes = [node for _, node in everyone]
            words = [describe_by_node([r for r, (s, _) in enumerate(everyone) if s == step], nodes) + f" at step {step}"
                     for step in starts]
            raise checkpoint.CheckpointError(
                f"the ranks start at different steps ({'; '.join(words)}): each resumes from the newest checkpoint in "
                f"its own --out {self.config.out}; every node must see the same --out (a shared filesystem), or be "
                f"given --resume with a copy of the same checkpoint")

    def _resume_shard(self, directory: Path, state: dict) -> None:
        """This rank's range of the optimizer state, read from the ranges the checkpoint's
        ranks wrote, whatever their number and sizes. A rank that cannot read it stops
        every rank with its reason, before any collective of the run."""
        flat, (start, stop) = self.loop.flat, self.loop.reducer.range
        problem = ""
        try:
            saved = state.get("shard") or {}
            if saved.get("digest") != flat.digest():
                raise checkpoint.CheckpointError(f"the checkpoint's sharded state is of parameter layout "
                                                 f"{saved.get('digest')!r}, this run's model {flat.digest()!r}")
            tensors = shard_checkpoint.load_range(directory, state["step"], start, stop, flat.total, flat.digest())
        except checkpoint.CheckpointError as error:
            problem = f"rank {self.rank}: {error}"
        problems = [""] * self.world
        dist.all_gather_object(problems, problem)
        if any(problems):
            raise checkpoint.CheckpointError("; ".join(p for p in problems if p))
        self.optimizer.load_shard_state(tensors)
