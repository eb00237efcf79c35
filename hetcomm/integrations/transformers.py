"""Balancing for Hugging Face `Trainer` scripts: replace `Trainer` by `BalancedTrainer`.

    from hetcomm.integrations.transformers import BalancedTrainer
    trainer = BalancedTrainer(model=model, args=args, train_dataset=train, data_collator=collate)
    trainer.train()                       # under torchrun or accelerate launch, as before

The global batch stays what the arguments make it (per_device_train_batch_size x ranks x
gradient_accumulation_steps); each rank's share of it follows its measured speed, cut
into gradient_accumulation_steps micro-batches on every rank. Every micro-batch's loss is
rescaled to its term of the mean over the global batch's items, whichever way Trainer
normalised it (by num_items_in_batch, checked on the first step by running the loss with
two values of it, or as a mean over the micro-batch), so DDP's average is the exact
gradient. The gradients travel through hetcomm's DDP hook (fp16 wire by default);
Trainer's fp16/bf16, clipping, schedulers, logging and checkpoints work as before, and a
checkpoint carries the data position, split and speed estimates (hetcomm_state.json,
sealed with a digest of them and of the run's settings: a damaged, edited or foreign one
is refused when training starts). Needs transformers >= 5 and accelerate (pip install 'hetcomm[hf]')."""

import os
from pathlib import Path
from functools import partial

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset

from hetcomm.comm.collectives import gather_floats
from hetcomm.integrations import require
from hetcomm.files.verified import CheckpointError
from hetcomm.files.verified_json import read_json, write_json
from hetcomm.integrations.batches import BalancedBatches, loader_steps_ahead
from hetcomm.integrations.hook import BalancedHookState, balanced_hook
from hetcomm.integrations.items import count_items as items_in, total_items
from hetcomm.integrations.saved_state import ADVICE, load_into, restored, saved
from hetcomm.integrations.settings import check_choices, check_count_items, check_settings, check_wire_dtype

transformers = require("transformers", "hf", minimum="5.0")
require("accelerate", "hf")
from transformers import Trainer, TrainerCallback  # noqa: E402
from transformers.trainer import TRAINER_STATE_NAME  # noqa: E402
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint, seed_worker  # noqa: E402

STATE_FILE = "hetcomm_state.json"
# How far the loss over num_items_in_batch = D and 2D may stray from 2:1 (it uses D)
# or 1:1 (it ignores D); 16-bit autocast moves a loss by ~1e-3.
PROBE_TOLERANCE = 1e-2


class BalancedTrainer(Trainer):
    """A transformers.Trainer whose ranks take shares of each global batch by speed.

    Args (besides Trainer's):
        balance: "dynamic" (split from the second step's timing, rebalanced while training),
            "static" (that split throughout) or "equal" (the exact weighting alone).
        split: a fixed split of the global batch, one count per rank.
        wire_dtype: the gradients' dtype on the wire (float16, float32; bfloat16 on NCCL).
        max_micro_batch: the largest micro-batch each rank holds (one for all, or one per
            rank); None: no cap. A share is at most gradient_accumulation_steps times it.
        count_items: micro-batch -> the items its loss averages over; default: labels
            other than -100 (shifted for a causal LM), else samples.

    Each is checked at construction (TypeError, ValueError naming it), with the
    Trainer settings balancing cannot honour.
    """

    def __init__(self, *args, balance: str = "dynamic", split=None, wire_dtype: torch.dtype = torch.float16,
                 max_micro_batch=None, count_items=None, **kwargs):
        self.balance_settings = {"balance": balance, "split": split, "max_micro_batch": max_micro_batch}
        check_choices(**self.balance_settings, who="BalancedTrainer")
        check_count_items(count_items, "BalancedTrainer")
        check_wire_dtype(wire_dtype, "BalancedTrainer")
        super().__init__(*args, **kwargs)
        _check_trainer(self)
        check_wire_dtype(wire_dtype, "BalancedTrainer")   # again: now against the process group Trainer made
        a, dataset = self.args, self.train_dataset
        check_settings(None if dataset is None else len(dataset), _global_batch(a), a.world_size,
                       accumulation=a.gradient_accumulation_steps, drop_last=a.dataloader_drop_last,
                       seed=_data_seed(a), who="BalancedTrainer", **self.balance_settings)
        self.wire_dtype = wire_dtype
        self.items_of = count_items or (lambda batch: items_in(batch, self._loss_shifts_labels))
        self.batches: BalancedBatches | None = None
        self.resume_path: str | None = None
        self.resumed_state: dict | None = None   # the checkpoint's balancing state, verified
        self.step_items: float | None = None     # this step's items over all ranks
        self.micro_items: list[int] = []         # this rank's micro-batches' items not yet trained on
        self.num_items: float | None = None      # Trainer's num_items_in_batch of the step
        self.loss_uses_num_items: bool | None = None  # found on the first step that passes num_items_in_batch
        self.add_callback(_Balancing(self))

    # --- data ----------------------------------------------------------------------------

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        self.resume_path = get_last_checkpoint(self.args.output_dir) if resume_from_checkpoint is True \
            else resume_from_checkpoint or None
        self.resumed_state = _read_state(self.resume_path) if self.resume_path is not None else None
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def get_train_dataloader(self) -> DataLoader:
        """This rank's micro-batches of each global batch, by the current split; not
        handed to accelerate's re-sharding (the batches are this rank's already)."""
        args, dataset = self.args, self.train_dataset
        collator = self._get_collator_with_removed_columns(self.data_collator, description="Training")
        if _is_hf_dataset(dataset):
            dataset, collator = self._remove_unused_columns(dataset, description="Training"), self.data_collator
        accumulation = args.gradient_accumulation_steps
        workers = args.dataloader_num_workers
        self.batches = BalancedBatches(
            len(dataset), _global_batch(args),
            accumulation=accumulation, seed=_data_seed(args),
            drop_last=args.dataloader_drop_last, who="BalancedTrainer",
            steps_ahead=loader_steps_ahead(workers, args.dataloader_prefetch_factor, accumulation),
            **self.balance_settings)
        if self.resumed_state is not None:
            # Trainer before 5.2x skips the epoch's done micro-batches with accelerate's
            # skip_first_batches; later ones ask get_resumed_dataloader, which skips nothing.
            load_into(self.batches, self.resumed_state, _state_path(self.resume_path), "BalancedTrainer",
                      skipped_by_loader=not hasattr(Trainer, "get_resumed_dataloader"))
        extra = {"prefetch_factor": args.dataloader_prefetch_factor,
                 "persistent_workers": args.dataloader_persistent_workers} if workers else {}
        return DataLoader(dataset, batch_sampler=self.batches, collate_fn=collator, num_workers=workers,
                          pin_memory=args.dataloader_pin_memory,
                          worker_init_fn=partial(seed_worker, num_workers=workers, rank=args.process_index), **extra)

    def get_resumed_dataloader(self, dataloader: DataLoader, num_batches: int) -> DataLoader:
        """The batches continue from the checkpoint's position already: nothing to skip."""
        epoch_batches = self.batches.done_in_epoch()
        if epoch_batches != num_batches:
            raise ValueError(f"BalancedTrainer: {_state_path(self.resume_path)}: the balancing state is "
                             f"{epoch_batches} micro-batches into its epoch, Trainer's state {num_batches}: they "
                             f"belong to different runs; {ADVICE}")
        return dataloader

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """The step's micro-batches, with the step timed from here and its items counted
        over all ranks (one small all-reduce), which every micro-batch's loss is scaled by."""
        self.batches.step_started()
        samples, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
        if len(samples) != self.args.gradient_accumulation_steps:
            raise RuntimeError(f"BalancedTrainer: the step drew {len(samples)} micro-batches, expected "
                               f"gradient_accumulation_steps = {self.args.gradient_accumulation_steps}")
        # Counted here, once, on the loader's host tensors: compute_loss takes them in order.
        self.micro_items = [self.items_of(batch) for batch in samples]
        self.step_items = total_items(sum(self.micro_items))
        # Trainer's count, on the device: read once a step, not at every micro-batch.
        self.num_items = float(num_items) if num_items is not None else None
        if self.step_items <= 0:
            raise ValueError("BalancedTrainer: the step's micro-batches hold no item to average the loss over on any "
                             "rank (every label is -100?)")
        return samples, num_items

    # --- the loss ------------------------------------------------------------------------

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """Trainer's loss, scaled to this micro-batch's term of the mean over the global
        batch times the number of ranks (DDP divides by it)."""
        if not model.training or self.step_items is None:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if not self.micro_items:
            raise RuntimeError("BalancedTrainer: compute_loss was called in training more often than the step has "
                               "micro-batches")
        items = self.micro_items.pop(0)
        passed = num_items_in_batch is not None and (self.model_accepts_loss_kwargs
                                                     or self.compute_loss_func is not None)
        if passed and self.loss_uses_num_items is None:
            self.loss_uses_num_items = self._probe_num_items(model, inputs, num_items_in_batch)
        result = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        loss = result[0] if return_outputs else result
        world = self.accelerator.num_processes
        # What Trainer multiplied and divided the loss by: the ranks when it averages tokens
        # across devices, gradient_accumulation_steps (after this returns) when it takes
        # the loss for a micro-batch mean.
        multiplied = world if passed and self.args.average_tokens_across_devices else 1
        scaled_for_ga = getattr(self, "loss_is_scaled_for_ga", None)   # a setting since transformers 5.2x
        if scaled_for_ga is None:
            scaled_for_ga = (self.model_accepts_loss_kwargs and num_items_in_batch is not None) \
                or self.compute_loss_func is not None
        divided = 1 if scaled_for_ga else self.current_gradient_accumulation_steps
        # The loss's own divisor: num_items_in_batch when it uses it, else its items.
        divisor = self.num_items if passed and self.loss_uses_num_items else items
        loss = loss * (divided * divisor * world / (multiplied * self.step_items))
        return (loss, result[1]) if return_outputs else loss

    def _probe_num_items(self, model, inputs, num_items) -> bool:
        """Whether the loss divides by num_items_in_batch: computed with it and with twice
        it on the same micro-batch and random state (the model may accept it and ignore
        it). Every rank probes and must find the same."""
        inner = self.accelerator.unwrap_model(model)
        losses = []
        for value in (num_items, 2 * num_items):
            with torch.no_grad(), torch.random.fork_rng(devices=_cuda(inner)):
                losses.append(float(super().compute_loss(inner, dict(inputs), num_items_in_batch=value).detach()))
        first, second = losses
        uses = first != 0 and abs(2 * second / first - 1) <= PROBE_TOLERANCE
        ignores = first == second or (first != 0 and abs(second / first - 1) <= PROBE_TOLERANCE)
        verdict = 1.0 if uses else 0.0 if ignores else -1.0
        found = [row[0] for row in gather_floats([verdict])] if dist.is_initialized() else [verdict]
        if any(v < 0 for v in found) or len(set(found)) > 1:
            raise ValueError(f"BalancedTrainer: the loss with num_items_in_batch = {num_items} and twice it was "
                             f"{first:.6g} and {second:.6g} (verdicts by rank: {found}): it neither divides by "
                             f"num_items_in_batch nor ignores it; pass count_items=... and a loss that does one")
        return bool(found[0])

    # --- checkpoints ---------------------------------------------------------------------

    def _save_checkpoint(self, model, trial) -> None:
        super()._save_checkpoint(model, trial)
        folder = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        if self.args.should_save and self.batches is not None:
            write_json(_state_path(folder), saved(self.batches))


class _Balancing(TrainerCallback):
    """Registers the hook once the model is wrapped in DDP; ends each step's timing."""

    def __init__(self, trainer: BalancedTrainer):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        wrapped = self.trainer.model_wrapped
        if isinstance(wrapped, torch.nn.parallel.DistributedDataParallel) and not getattr(wrapped, "_hetcomm", False):
            wrapped.register_comm_hook(BalancedHookState(self.trainer.batches, wrapped.process_group,
                                                         self.trainer.wire_dtype), balanced_hook)
            wrapped._hetcomm = True

    def on_step_end(self, args, state, control, **kwargs):
        self.trainer.batches.step_finished()
        self.trainer.step_items = None


def _check_trainer(trainer: Trainer) -> None:
    """ValueError naming the setting BalancedTrainer cannot honour, before any step."""
    args = trainer.args
    if args.accelerator_config.split_batches:
        raise ValueError("BalancedTrainer: accelerator_config.split_batches=True splits one loader's batches evenly "
                         "across ranks; hetcomm deals each rank its own share. Leave split_batches off")
    dataset = trainer.train_dataset
    if dataset is not None and (isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__")):
        raise ValueError(f"BalancedTrainer: train_dataset is an IterableDataset ({type(dataset).__name__}); "
                         f"balancing deals indices of a map-style dataset (len and [i])")
    if getattr(args, "train_sampling_strategy", "random") != "random" or getattr(args, "group_by_length", False):
        raise ValueError(f"BalancedTrainer: train_sampling_strategy = "
                         f"{getattr(args, 'train_sampling_strategy', 'group_by_length')!r}: that sampler cannot be "
                         f"replaced by hetcomm's; use 'random'")
    for method in ("_get_train_sampler", "get_train_dataloader"):
        if getattr(type(trainer), method) is not getattr(BalancedTrainer, method):
            raise ValueError(f"BalancedTrainer: {type(trainer).__name__} overrides {method}; hetcomm builds the "
                             f"train loader's sampler itself and cannot replace yours")
    if args.auto_find_batch_size:
        raise ValueError("BalancedTrainer: auto_find_batch_size=True would change the global batch; set "
                         "max_micro_batch=... instead")
    if trainer.is_deepspeed_enabled or trainer.is_fsdp_enabled:
        raise ValueError("BalancedTrainer: DeepSpeed and FSDP are not supported: hetcomm balances DDP ranks")
    if args.n_gpu > 1:
        raise ValueError(f"BalancedTrainer: n_gpu = {args.n_gpu} (DataParallel over one process's GPUs); run one "
                         f"process per GPU (torchrun)")


def _global_batch(args) -> int:
    return args.per_device_train_batch_size * args.world_size * args.gradient_accumulation_steps


def _data_seed(args) -> int:
    return args.data_seed if args.data_seed is not None else args.seed


def _state_path(checkpoint: str) -> Path:
    return Path(checkpoint) / STATE_FILE


def _read_state(checkpoint: str) -> dict:
    """The checkpoint's balancing state, whole and of the step Trainer's own state is
    at (CheckpointError, a ValueError, naming the file otherwise)."""
    path = _state_path(checkpoint)
    if not path.exists():
        raise ValueError(f"BalancedTrainer: resume_from_checkpoint = {checkpoint!r} holds no {STATE_FILE}: it was "
                         f"not saved by a BalancedTrainer, so where its data stood is unknown; {ADVICE}")
    return restored(_json_of(path), str(path), "BalancedTrainer", steps=_trainer_steps(checkpoint))


def _trainer_steps(checkpoint: str) -> int | None:
    """The step of Trainer's own state in the checkpoint (None where it has none: Trainer
    refuses that itself)."""
    path = Path(checkpoint) / TRAINER_STATE_NAME
    found = _json_of(path) if path.exists() else None
    return found.get("global_step") if isinstance(found, dict) else None


def _json_of(path: Path):
    try:
        return read_json(path)
    except CheckpointError as error:
        raise CheckpointError(f"BalancedTrainer: {error}; {ADVICE}") from None


def _is_hf_dataset(dataset) -> bool:
    try:
        import datasets
    except ImportError:
        return False
    return isinstance(dataset, datasets.Dataset)


def _cuda(model) -> list:
    device = next(model.parameters()).device
    return [device] if device.type == "cuda" else []


__all__ = ["BalancedTrainer", "STATE_FILE"]
