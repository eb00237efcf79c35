"""A tiny model, its data and its exact gradient, shared by the distributed tests."""

import torch
from torch import nn

COUNTS = [3, 7, 1, 13]
LOSS_SCALE = 1024.0


class TinyNet(nn.Module):
    """Embedding + MLP; `side` is used only when asked, `never` not at all."""

    def __init__(self, extra_layer: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(16, 8)
        self.fc1 = nn.Linear(8, 32)
        self.fc2 = nn.Linear(32, 4)
        self.side = nn.Linear(8, 4)
        self.never = nn.Linear(4, 4)
        if extra_layer:
            self.extra = nn.Linear(4, 4)

    def forward(self, tokens, use_side):
        h = self.embed(tokens).mean(1)
        out = self.fc2(torch.tanh(self.fc1(h)))
        return out + self.side(h) if use_side else out


def dataset(total: int):
    generator = torch.Generator().manual_seed(1)
    return torch.randint(0, 16, (total, 5), generator=generator), torch.randn(total, 4, generator=generator)


def local_backward(model, rank, counts, scale=1.0, use_side=True, zero=True):
    """Mean loss over this rank's slice of the global batch, times scale, backward
    (accumulating into the gradients when zero=False)."""
    tokens, targets = dataset(sum(counts))
    start = sum(counts[:rank])
    mine = slice(start, start + counts[rank])
    if zero:
        model.zero_grad(set_to_none=True)
    loss = ((model(tokens[mine], use_side) - targets[mine]) ** 2).mean()
    (loss * scale).backward()


def reference_gradient(counts, side_ranks=None):
    """One process, float64, the mean loss over all samples; `side` is used for the
    samples of `side_ranks` (all ranks by default)."""
    model = TinyNet().double()
    tokens, targets = dataset(sum(counts))
    side_ranks = range(len(counts)) if side_ranks is None else side_ranks
    losses = []
    for rank, n in enumerate(counts):
        start = sum(counts[:rank])
        mine = slice(start, start + n)
        losses.append((model(tokens[mine], rank in side_ranks) - targets[mine].double()) ** 2)
    torch.cat(losses).mean().backward()
    return {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


def error_of(fn):
    """(exception type name, message) of what fn raises, or None: ranks report errors as data."""
    try:
        fn()
    except Exception as error:
        return type(error).__name__, str(error)
    return None


def relative_error(got, want):
    return ((got.double() - want).norm() / want.norm()).item()
