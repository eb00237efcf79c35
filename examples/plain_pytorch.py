"""Your own model and data, balanced across ranks of different speeds: the whole of
hetcomm.loop in a plain PyTorch loop. Run: python examples/plain_pytorch.py (4 simulated
CPU workers), or torchrun --nproc-per-node 4 examples/plain_pytorch.py on GPUs."""

import torch
from torch import nn

from hetcomm.loop import BalancedLoop
from hetcomm.loop.launch import launch
from hetcomm.simulated import SimulatedSpeed


class Sequences(torch.utils.data.Dataset):
    """Sample i: 64 random tokens; a token is to be predicted where it is even."""

    def __init__(self, size=2048):
        self.tokens = torch.randint(0, 64, (size, 64), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, i):
        return {"tokens": self.tokens[i], "targets": (self.tokens[i] * 7) % 64, "mask": self.tokens[i] % 2 == 0}


class Tagger(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Embedding(64, 256), nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 64))

    def forward(self, tokens):
        return self.net(tokens)


def main(rank, world, device):
    torch.manual_seed(0)   # the same initial weights on every rank
    model = Tagger().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-4)
    speed = SimulatedSpeed(rank, 0.5 / (rank + 1)) if device.type == "cpu" else None   # unequal CPU "cards"
    loop = BalancedLoop(model, Sequences(), global_batch=64, simulated_speed=speed)
    for step in loop.steps(40):
        for batch in step:   # this rank's share of the global batch, as micro-batches
            with loop.autocast():
                logits = model(batch["tokens"])[batch["mask"]]
                loss = nn.functional.cross_entropy(logits, batch["targets"][batch["mask"]])
            step.backward(loss, count=batch["mask"].sum())   # a mean over this many tokens
        result = step.reduce()   # the gradient of the mean over all ranks' tokens
        if not result.skipped:
            result.clip_grad_norm_(1.0)
            optimizer.step()
        if rank == 0 and step.number % 10 == 9:
            print(f"step {step.number + 1}: loss {result.loss:.3f}, split {result.split}", flush=True)


if __name__ == "__main__":
    launch(main)
