"""The recipe for a plain `accelerate` training loop: hetcomm's batch sampler for the
loader, hetcomm's DDP hook on the prepared model, the loss weighted by its items.
A causal GPT-2 on Python's standard-library sources as bytes.

    python examples/accelerate_loop.py                  # 4 simulated CPU workers, a tiny GPT-2
    accelerate launch --num_processes 4 examples/accelerate_loop.py --size gpt2 --seq 256

Needs transformers and accelerate: pip install 'hetcomm[hf]'.
"""

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import CausalLMSamples, cluster_arguments, require_transformers, simulated_speed  # noqa: E402
from hf_gpt2 import build_model  # noqa: E402

from hetcomm.integrations import BalancedBatches, BalancedHookState, balanced_hook, count_items  # noqa: E402
from hetcomm.loop.launch import launch  # noqa: E402
from hetcomm.simulated import stretch_as_it_goes  # noqa: E402


def train(rank: int, world: int, device: torch.device, args, split=None):
    """Trains on this rank; returns every step's loss on this rank, the model and the batches."""
    require_transformers()
    if "LOCAL_RANK" not in os.environ:   # started by hetcomm's launcher, not accelerate's: the group exists
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                          MASTER_PORT="0", OMP_NUM_THREADS=str(torch.get_num_threads()))
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=device.type == "cpu")
    torch.manual_seed(args.seed)   # the same initial weights on every rank
    model = build_model(args.size, args.seq, args.dropout)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    data = CausalLMSamples(args.seq)
    # hetcomm: each rank's share of every global batch, by speed (not prepared by accelerate:
    # the batches are this rank's already).
    batches = BalancedBatches(len(data), args.global_batch, split=split, balance=args.balance, seed=args.seed)
    loader = torch.utils.data.DataLoader(data, batch_sampler=batches)
    model, optimizer = accelerator.prepare(model, optimizer)
    # hetcomm: its hook weights each rank's gradient by its items over all ranks' items.
    hook = BalancedHookState(batches, wire_dtype=torch.float32 if device.type == "cpu" else torch.float16,
                             per_item=True)
    model.register_comm_hook(hook, balanced_hook)
    speed = simulated_speed(rank, world, device, args)
    settle = [lambda: None]
    if speed is not None:
        stretch_as_it_goes(model, list(model.parameters()), lambda: settle[0]())
    losses = []
    while len(losses) < args.steps:
        for batch in loader:
            batches.step_started()                                   # hetcomm
            with speed.compute(len(losses)) if speed else _nothing() as settle[0]:
                batch = {k: v.to(accelerator.device) for k, v in batch.items()}
                items = count_items(batch, shifted=True)             # the tokens it predicts
                loss = model(**batch).loss                           # the mean over its tokens
                accelerator.backward(loss * hook.scale_for(items))   # hetcomm: weighted by them
            optimizer.step()
            optimizer.zero_grad()
            batches.step_finished()                                  # hetcomm
            losses.append(loss.item())
            if len(losses) == args.steps:
                break
    return losses, accelerator.unwrap_model(model), batches


class _nothing:
    def __enter__(self):
        return lambda: None

    def __exit__(self, *exc):
        return False


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", choices=("tiny", "gpt2"), default="tiny")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--dropout", type=float, default=0.0)
    cluster_arguments(p)
    return p


def main(rank: int, world: int, device: torch.device, args) -> None:
    losses, _, batches = train(rank, world, device, args)
    if rank == 0:
        print(f"{len(losses)} steps, split {list(batches.split)} of {args.global_batch}, rank 0's last loss "
              f"{losses[-1]:.3f}")


if __name__ == "__main__":
    arguments = parser().parse_args()
    launch(main, arguments, nproc=arguments.nproc)
