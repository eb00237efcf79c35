"""examples/hf_bert_mlm.py's BERT masked LM trained by a Hugging Face `Trainer` script:
the stock `transformers.Trainer`, or hetcomm's `BalancedTrainer` in its place, which
gives each rank a share of every global batch by its measured speed.

    python examples/hf_trainer_bert_mlm.py                     # 4 simulated CPU workers, a tiny BERT
    python examples/hf_trainer_bert_mlm.py --trainer stock     # the same with the stock Trainer
    python examples/hf_trainer_bert_mlm.py --size small --seq 128 --global-batch 128 --steps 20
    torchrun --nproc-per-node 4 examples/hf_trainer_bert_mlm.py --size base --seq 128 --global-batch 64

What a Trainer script changes for hetcomm is marked "hetcomm:": the import, and the
class in build_trainer. The global batch stays per_device_train_batch_size x ranks x
gradient_accumulation_steps, as with the stock Trainer; how it is shared out is what
differs. The rest of this file is the simulated cluster (CPU workers of unequal
simulated speeds, as the other examples run) and the figures it prints at the end:
seconds per step after the first few, the final split of the global batch, the final
loss. Needs transformers >= 5 and accelerate: pip install 'hetcomm[hf]'.
"""

import argparse
import contextlib
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import MaskedLMSamples, cluster_arguments, require_transformers, simulated_speed  # noqa: E402
from hf_bert_mlm import SIZES, build_model  # noqa: E402

from hetcomm.loop.launch import launch, under_torchrun  # noqa: E402
from hetcomm.simulated import SimulatedSpeed, stretch_as_it_goes  # noqa: E402

require_transformers()
from transformers import PrinterCallback, Trainer, TrainerCallback, TrainingArguments  # noqa: E402

try:   # hetcomm: the import
    from hetcomm.integrations.transformers import BalancedTrainer  # noqa: E402
except ImportError as error:   # accelerate missing, or transformers older than 5
    raise SystemExit(str(error)) from None

# Steps left out of the seconds per step: the first builds the loader and (balanced) times
# the ranks on an equal split; the next ones run on the split that timing gave.
WARMUP_STEPS = 3


class SimulatedDevice(TrainerCallback):
    """A CPU rank computing at its simulated speed (hetcomm.simulated): each optimizer
    step's forwards and backwards are stretched to 1/speed of the time they need, the
    stretch paid as the compute goes (after every leaf module's forward and every
    gradient). The same for the stock and the balanced Trainer: the step's compute runs
    from on_step_begin to on_pre_optimizer_step (after the last backward); the loader,
    the optimizer and logging run at the machine's speed."""

    def __init__(self, speed: SimulatedSpeed, model: torch.nn.Module):
        self.speed = speed
        self.phase = contextlib.ExitStack()
        self.settle = None   # the running step's settle(), None between steps
        stretch_as_it_goes(model, [p for p in model.parameters() if p.requires_grad], self._settle)

    def _settle(self) -> None:
        if self.settle is not None:
            self.settle()

    def on_step_begin(self, args, state, control, **kwargs):
        self.settle = self.phase.enter_context(self.speed.compute(state.global_step))

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.settle = None
        self.phase.close()   # waits out what the step's compute still owes


class StepClock(TrainerCallback):
    """When each optimizer step ended, its split, and the loss Trainer logged for it (the
    mean over the global batch; logging_steps=1); rank 0 writes a JSON line a step to
    `path`."""

    def __init__(self, path: str | None = None):
        self.ends: list[float] = []
        self.splits: list[list[int]] = []
        self.losses: list[float] = []
        self.file = open(path, "w") if path else None
        self.trainer = None   # set by build_trainer, for the split

    def on_step_end(self, args, state, control, **kwargs):
        # Called before BalancedTrainer's own on_step_end, which moves its split on.
        self.ends.append(time.perf_counter())
        self.splits.append(split_of(self.trainer))

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses.append(float(logs["loss"]))
            if self.file is not None and state.is_world_process_zero:
                step_s = self.ends[-1] - self.ends[-2] if len(self.ends) > 1 else None
                self.file.write(json.dumps({"step": state.global_step - 1, "loss": self.losses[-1],
                                            "split": self.splits[-1], "step_s": step_s}) + "\n")
                self.file.flush()


def split_of(trainer) -> list[int]:
    """The samples each rank takes of a global batch: hetcomm's current split, or the
    stock Trainer's equal one."""
    if isinstance(trainer, BalancedTrainer):
        return list(trainer.batches.split)
    a = trainer.args
    return [a.per_device_train_batch_size * a.gradient_accumulation_steps] * a.world_size


def training_arguments(args, world: int, device: torch.device, output_dir: str) -> TrainingArguments:
    """The same for both Trainers: per_device_train_batch_size x ranks x
    gradient_accumulation_steps = --global-batch."""
    per_device, leftover = divmod(args.global_batch, world * args.grad_accum)
    if leftover or not per_device:
        raise ValueError(f"--global-batch {args.global_batch} must be a multiple of the ranks ({world}) times "
                         f"--grad-accum ({args.grad_accum}): a Trainer's global batch is "
                         f"per_device_train_batch_size x ranks x gradient_accumulation_steps")
    return TrainingArguments(
        output_dir=output_dir, per_device_train_batch_size=per_device, gradient_accumulation_steps=args.grad_accum,
        max_steps=args.steps, learning_rate=args.lr, weight_decay=0.01, lr_scheduler_type="constant_with_warmup",
        warmup_steps=args.warmup, max_grad_norm=1.0, seed=args.seed, logging_strategy="steps", logging_steps=1,
        save_strategy="steps" if args.out else "no", save_steps=args.steps, use_cpu=device.type == "cpu",
        ddp_find_unused_parameters=False, report_to=[], disable_tqdm=True,
        dataloader_drop_last=True)   # BalancedTrainer refuses an epoch's last step with fewer samples than ranks


def build_trainer(rank: int, world: int, device: torch.device, args, output_dir: str, callbacks=()) -> Trainer:
    """The Trainer script proper: the model, the data, the arguments, the Trainer."""
    torch.manual_seed(args.seed)   # the same initial weights on every rank
    model = build_model(args.size, args.seq, args.dropout)
    # BertForMaskedLM takes **kwargs, so Trainer would pass it num_items_in_batch and take
    # its loss for a sum over it, but the loss is its batch's mean whatever it is passed:
    # with average_tokens_across_devices (the default) the stock Trainer would multiply it
    # by the number of ranks. Saying so makes the stock Trainer average the ranks' means.
    model.accepts_loss_kwargs = False
    data = MaskedLMSamples(args.seq, seed=args.seed)
    training = training_arguments(args, world, device, output_dir)
    speed = simulated_speed(rank, world, device, args)
    clock = StepClock(args.log_json if rank == 0 else None)
    callbacks = [clock, *callbacks] + ([SimulatedDevice(speed, model)] if speed is not None else [])

    if args.trainer == "stock":
        trainer = Trainer(model=model, args=training, train_dataset=data, callbacks=callbacks)
    else:
        # hetcomm: the class (balance= and wire_dtype= are optional: "dynamic" and float16
        # by default; float32 on CPU, where Gloo gains nothing from a 16-bit wire).
        trainer = BalancedTrainer(model=model, args=training, train_dataset=data, callbacks=callbacks,
                                  balance=args.balance,
                                  wire_dtype=torch.float32 if device.type == "cpu" else torch.float16)

    clock.trainer = trainer
    if not args.log:
        trainer.remove_callback(PrinterCallback)
    return trainer


def train(rank: int, world: int, device: torch.device, args, callbacks=()) -> tuple[dict, Trainer]:
    """Trains on this rank; returns what main prints (seconds per step after the first
    WARMUP_STEPS, every step's loss and split) and the trainer."""
    if not under_torchrun():
        as_torchrun(rank, world)
    with tempfile.TemporaryDirectory() as scratch:   # Trainer wants an output_dir even when it saves nothing
        trainer = build_trainer(rank, world, device, args, args.out or scratch, callbacks)
        trainer.train()
    clock = next(c for c in trainer.callback_handler.callbacks if isinstance(c, StepClock))
    skip = min(WARMUP_STEPS, len(clock.ends) - 2) if len(clock.ends) > 1 else 0
    ends = clock.ends[max(skip, 0):]
    seconds = (ends[-1] - ends[0]) / (len(ends) - 1) if len(ends) > 1 else float("nan")
    summary = {"trainer": args.trainer, "seconds_per_step": seconds, "timed_steps": len(ends) - 1,
               "losses": clock.losses, "splits": clock.splits, "split": split_of(trainer)}
    return summary, trainer


def as_torchrun(rank: int, world: int) -> None:
    """The environment torchrun would give this rank, which accelerate reads (hetcomm's
    launcher has started the ranks and their process group already)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29500"),
                      OMP_NUM_THREADS="1")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trainer", choices=("balanced", "stock"), default="balanced",
                   help="balanced: hetcomm's BalancedTrainer; stock: transformers.Trainer (equal shares)")
    p.add_argument("--size", choices=sorted(SIZES), default="tiny")
    p.add_argument("--seq", type=int, default=64, help="tokens per sample, [CLS] and [SEP] included")
    p.add_argument("--grad-accum", type=int, default=1, help="gradient_accumulation_steps")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--out", help="Trainer's output_dir; a checkpoint is saved there at the end (default: none)")
    p.add_argument("--no-log", dest="log", action="store_false", help="without Trainer's line per step")
    cluster_arguments(p)
    p.set_defaults(steps=12)
    return p


def main(rank: int, world: int, device: torch.device, args) -> None:
    if rank == 0 and args.log:
        logging.basicConfig(format="%(message)s")
        logging.getLogger("hetcomm").setLevel(logging.INFO)   # BalancedTrainer's rebalancing decisions
    summary, _ = train(rank, world, device, args)
    if rank == 0:
        loss = summary["losses"][-1] if summary["losses"] else float("nan")
        print(f"{summary['trainer']} Trainer, {world} ranks: {summary['seconds_per_step']:.3f} s/step over steps "
              f"{args.steps - summary['timed_steps'] + 1}-{args.steps}, final split "
              f"{'/'.join(map(str, summary['split']))} of {args.global_batch}, final loss {loss:.4f}", flush=True)


if __name__ == "__main__":
    arguments = parser().parse_args()
    launch(main, arguments, nproc=arguments.nproc)
