"""A PyTorch Lightning script balanced by hetcomm: a small byte-level language model
(embedding, GRU, head) on Python's standard-library sources, on ranks of different speeds.

    python examples/lightning_byte_lm.py                       # 4 simulated CPU workers
    python examples/lightning_byte_lm.py --balance equal       # the same global batch, equal shares
    torchrun --nproc-per-node 4 examples/lightning_byte_lm.py  # one GPU per rank

What a Lightning script changes for hetcomm is marked "hetcomm:": the strategy and
use_distributed_sampler=False. The global batch is the loader's batch_size x ranks x
accumulate_grad_batches, as without hetcomm. Needs lightning: pip install 'hetcomm[lightning]'.
"""

import argparse
import os
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import BYTE_VOCAB, CausalLMSamples, cluster_arguments, simulated_speed  # noqa: E402

from hetcomm.loop.launch import launch, under_torchrun  # noqa: E402
from hetcomm.simulated import stretch_as_it_goes  # noqa: E402

try:
    import lightning as L
    from hetcomm.integrations.lightning import BalancedStrategy   # hetcomm: the import
except ImportError as missing:
    raise SystemExit(f"this example needs lightning: pip install 'hetcomm[lightning]' ({missing})") from None


class ByteLM(L.LightningModule):
    def __init__(self, width: int, lr: float):
        super().__init__()
        self.embed, self.rnn = nn.Embedding(BYTE_VOCAB, width), nn.GRU(width, width, batch_first=True)
        self.head, self.lr = nn.Linear(width, BYTE_VOCAB), lr

    def training_step(self, batch, batch_idx):
        hidden, _ = self.rnn(self.embed(batch["input_ids"][:, :-1]))
        logits = self.head(hidden)
        # The mean over the micro-batch's predicted tokens; hetcomm weights it by their count.
        return nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"][:, 1:].flatten(), ignore_index=-100)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


class SimulatedCluster(L.Callback):
    """A CPU rank computing at its simulated speed (hetcomm.simulated), each batch's
    compute stretched as it goes; the times the balancer measures, and the step time."""

    def __init__(self, speed):
        self.speed, self.phase, self.settle, self.starts = speed, None, lambda: None, []

    def on_fit_start(self, trainer, module):
        if self.speed is not None:
            stretch_as_it_goes(module, list(module.parameters()), lambda: self.settle())

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.starts.append(time.perf_counter())
        if self.speed is not None:
            self.phase = self.speed.compute(trainer.global_step)
            self.settle = self.phase.__enter__()

    def on_before_optimizer_step(self, trainer, module, optimizer):
        if self.phase is not None:
            self.phase.__exit__(None, None, None)
            self.phase, self.settle = None, lambda: None


def main(rank: int, world: int, device: torch.device, args) -> None:
    if not under_torchrun():   # started by hetcomm's launcher: tell Lightning where the group is
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), NODE_RANK="0",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
    if args.global_batch % world:
        raise SystemExit(f"--global-batch {args.global_batch}: expected a multiple of the {world} ranks (the "
                         f"loader's batch_size is the global batch over the ranks)")
    torch.manual_seed(args.seed)
    module, data = ByteLM(args.width, args.lr), CausalLMSamples(args.seq)
    loader = torch.utils.data.DataLoader(data, batch_size=args.global_batch // world, shuffle=True)
    cluster = SimulatedCluster(simulated_speed(rank, world, device, args))
    trainer = L.Trainer(accelerator=device.type if device.type == "cpu" else "gpu", devices=world,
                        strategy=BalancedStrategy(balance=args.balance, seed=args.seed),   # hetcomm: the strategy
                        use_distributed_sampler=False,                                     # hetcomm: its sampler
                        max_steps=args.steps, callbacks=[cluster], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, loader)
    if rank == 0:
        steady = cluster.starts[3:]
        per_step = (steady[-1] - steady[0]) / max(1, len(steady) - 1)
        print(f"{args.steps} steps, {per_step:.3f} s/step after the first 3, split "
              f"{list(trainer.strategy.batches.split)} of {args.global_batch}")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-3)
    cluster_arguments(p)
    return p


if __name__ == "__main__":
    arguments = parser().parse_args()
    launch(main, arguments, nproc=arguments.nproc)
