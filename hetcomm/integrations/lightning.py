"""Balancing for PyTorch Lightning: a DDP strategy.

    from hetcomm.integrations.lightning import BalancedStrategy
    trainer = L.Trainer(strategy=BalancedStrategy(), use_distributed_sampler=False, ...)
    trainer.fit(module, train_loader)      # train_loader: DataLoader(dataset, batch_size=b, shuffle=True)

The global batch is the loader's batch_size x ranks x accumulate_grad_batches; each
rank's share of it follows its measured speed, cut into accumulate_grad_batches
micro-batches on every rank (the strategy rebuilds the train loader around hetcomm's
batch sampler: one permutation per epoch, nothing dropped or repeated). The module's
training_step returns its usual mean loss over the micro-batch; the strategy makes the
gradient the exact mean over the global batch's items (count_items: labels other than
-100 in a dict batch, else samples) through hetcomm's DDP hook, which it registers on CPU
(Gloo) too, where Lightning's own hook support stops. Checkpoints carry the data
position, splits and estimates under checkpoint["hetcomm"], sealed with a digest of them
and of the run's settings: a damaged, edited or foreign one is refused before any
training step. Needs lightning >= 2.4
(pip install 'hetcomm[lightning]')."""

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler
from torch.utils.data.distributed import DistributedSampler

from hetcomm.integrations import require
from hetcomm.integrations.batches import BalancedBatches, loader_steps_ahead
from hetcomm.integrations.hook import BalancedHookState, balanced_hook
from hetcomm.integrations.items import count_items as items_in
from hetcomm.integrations.saved_state import ADVICE, load_into, restored, saved
from hetcomm.integrations.settings import check_bfloat16_backend, check_choices, check_count_items, check_wire_dtype

require("lightning", "lightning", minimum="2.4")
from lightning.pytorch.strategies import DDPStrategy  # noqa: E402
from lightning.pytorch.trainer.states import RunningStage  # noqa: E402

CHECKPOINT_KEY = "hetcomm"


class BalancedStrategy(DDPStrategy):
    """DDPStrategy whose ranks take shares of each global batch by speed.

    Args (besides DDPStrategy's, except the comm hook, which is hetcomm's):
        balance: "dynamic" (split from the second step's timing, rebalanced while training),
            "static" (that split throughout) or "equal" (the exact weighting alone).
        split: a fixed split of the global batch, one count per rank.
        wire_dtype: the gradients' dtype on the wire (float16, float32; bfloat16 on NCCL).
        max_micro_batch: the largest micro-batch each rank holds (one for all, or one per
            rank); None: no cap.
        count_items: micro-batch -> the items its training_step's loss averages over.
        seed: the data order's seed (the same on every rank).

    Each is checked at construction (TypeError, ValueError naming it); what depends on
    the ranks and the loader (a split's length and sum, the caps against the global
    batch) when the train loader is built, before any step.
    """

    def __init__(self, *, balance: str = "dynamic", split=None, wire_dtype: torch.dtype = torch.float16,
                 max_micro_batch=None, count_items=None, seed: int = 0, **ddp_kwargs):
        for taken in ("ddp_comm_hook", "ddp_comm_state", "ddp_comm_wrapper"):
            if taken in ddp_kwargs:
                raise ValueError(f"BalancedStrategy: {taken} is hetcomm's own hook; leave it out")
        self.settings = {"balance": balance, "split": split, "max_micro_batch": max_micro_batch, "seed": seed}
        check_choices(**self.settings, who="BalancedStrategy")
        check_count_items(count_items, "BalancedStrategy")
        check_wire_dtype(wire_dtype, "BalancedStrategy")
        check_bfloat16_backend(wire_dtype, ddp_kwargs.get("process_group_backend"), "BalancedStrategy")
        super().__init__(**ddp_kwargs)
        self.wire_dtype = wire_dtype
        self.items_of = count_items or items_in
        self.batches: BalancedBatches | None = None
        self.hook_state: BalancedHookState | None = None
        self.restored: dict | None = None      # the checkpoint's balancing state, verified
        self.restored_from: str | None = None
        self.micro_items = 0.0     # the running micro-batch's items

    # --- data ----------------------------------------------------------------------------

    def process_dataloader(self, dataloader):
        """The train loader rebuilt around hetcomm's batch sampler (other loaders as they are)."""
        dataloader = super().process_dataloader(dataloader)
        trainer = self.lightning_module.trainer
        if trainer.state.stage != RunningStage.TRAINING:
            return dataloader
        if not self.lightning_module.automatic_optimization:
            raise ValueError("BalancedStrategy: automatic_optimization = False: the strategy weights the losses that "
                             "Lightning's automatic optimisation hands to backward; manual optimisation is not "
                             "supported")
        if trainer._accelerator_connector.use_distributed_sampler:
            raise ValueError("BalancedStrategy: pass use_distributed_sampler=False to the Trainer: hetcomm deals each "
                             "rank its own share of every batch")
        _check_loader(dataloader)
        accumulation = trainer.accumulate_grad_batches
        self.batches = BalancedBatches(
            len(dataloader.dataset), dataloader.batch_size * self.world_size * accumulation, accumulation=accumulation,
            drop_last=dataloader.drop_last, who="BalancedStrategy",
            steps_ahead=loader_steps_ahead(dataloader.num_workers, dataloader.prefetch_factor, accumulation),
            **self.settings)
        if self.restored is not None:
            load_into(self.batches, self.restored, self.restored_from, "BalancedStrategy")
        if self.hook_state is not None:
            self.hook_state.batches = self.batches
        extra = {"prefetch_factor": dataloader.prefetch_factor, "persistent_workers": dataloader.persistent_workers} \
            if dataloader.num_workers else {}
        return DataLoader(dataloader.dataset, batch_sampler=self.batches, collate_fn=dataloader.collate_fn,
                          num_workers=dataloader.num_workers, pin_memory=dataloader.pin_memory,
                          worker_init_fn=dataloader.worker_init_fn, **extra)

    # --- each step -----------------------------------------------------------------------

    def _register_ddp_hooks(self) -> None:
        """hetcomm's hook, on any device (Lightning registers hooks on CUDA only)."""
        check_wire_dtype(self.wire_dtype, "BalancedStrategy", self.model.process_group)
        self.hook_state = BalancedHookState(self.batches, self.model.process_group, self.wire_dtype, per_item=True)
        self.model.register_comm_hook(self.hook_state, balanced_hook)

    def on_train_batch_start(self, batch, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        if batch_idx % self.lightning_module.trainer.accumulate_grad_batches == 0:
            self.batches.step_started()

    def batch_to_device(self, batch, device=None, dataloader_idx: int = 0):
        """A training micro-batch's items are counted here, on the loader's host tensors
        (on the device, reading the count would wait for the GPU at every micro-batch)."""
        if self.lightning_module.trainer.training:
            self.micro_items = float(self.items_of(batch))
        return super().batch_to_device(batch, device, dataloader_idx)

    def backward(self, closure_loss, optimizer, *args, **kwargs):
        """The micro-batch's mean loss (divided by accumulate_grad_batches, as Lightning
        does) weighted by its items; the hook divides by all ranks' items."""
        accumulation = self.lightning_module.trainer.accumulate_grad_batches
        factor = accumulation * self.hook_state.scale_for(self.micro_items)
        return super().backward(closure_loss * factor, optimizer, *args, **kwargs)

    def optimizer_step(self, optimizer, closure, model=None, **kwargs):
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        self.batches.step_finished()
        return output

    # --- checkpoints ---------------------------------------------------------------------

    def save_checkpoint(self, checkpoint, filepath, storage_options=None) -> None:
        if self.batches is not None:
            checkpoint[CHECKPOINT_KEY] = saved(self.batches)
        super().save_checkpoint(checkpoint, filepath, storage_options)

    def load_checkpoint(self, checkpoint_path, weights_only=None):
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        if CHECKPOINT_KEY not in checkpoint:
            raise ValueError(f"BalancedStrategy: the checkpoint {checkpoint_path} holds no hetcomm state: it was not "
                             f"saved with BalancedStrategy, so where its data stood is unknown; {ADVICE}")
        self.restored_from = f"{checkpoint_path} (its {CHECKPOINT_KEY!r} entry)"
        self.restored = restored(checkpoint[CHECKPOINT_KEY], self.restored_from, "BalancedStrategy",
                                 steps=checkpoint.get("global_step"))
        return checkpoint


def _check_loader(dataloader) -> None:
    """ValueError naming what cannot be rebuilt around hetcomm's batch sampler."""
    if not isinstance(dataloader, DataLoader):
        raise ValueError(f"BalancedStrategy: the train dataloader is a {type(dataloader).__name__}; expected a "
                         f"torch DataLoader")
    if isinstance(dataloader.dataset, IterableDataset) or not hasattr(dataloader.dataset, "__len__"):
        raise ValueError(f"BalancedStrategy: the train dataset is an IterableDataset "
                         f"({type(dataloader.dataset).__name__}); balancing deals indices of a map-style dataset")
    batch_sampler = dataloader.batch_sampler
    sampler = getattr(batch_sampler, "sampler", None)
    shuffled = (type(sampler) is RandomSampler and not sampler.replacement
                and sampler.num_samples == len(dataloader.dataset)) \
        or (type(sampler) is DistributedSampler and sampler.shuffle)
    if type(batch_sampler) is not BatchSampler or not shuffled:
        named = type(batch_sampler if type(batch_sampler) is not BatchSampler else sampler).__name__
        raise ValueError(f"BalancedStrategy: the train loader's sampler is a {named} (or draws with replacement, or "
                         f"not in random order), which hetcomm cannot replace by one shuffled permutation per epoch; "
                         f"build the loader with batch_size=... and shuffle=True")


__all__ = ["BalancedStrategy", "CHECKPOINT_KEY"]
