"""A small model of blocks, as full sharding cuts models: an embedding, a ModuleList of
residual blocks (each a layer unit), a final norm and a head tied to the embedding and
used functionally in the model's own forward (so it belongs to the root unit)."""

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, WIDTH, BLOCKS = 16, 12, 3


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.down = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(self.norm(x))))


class TinyBlocks(nn.Module):
    def __init__(self, blocks: int = BLOCKS):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(blocks))
        self.norm = nn.LayerNorm(WIDTH)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return F.linear(self.norm(x), self.embed.weight)


def block_elements() -> int:
    return 2 * WIDTH + (WIDTH * 2 * WIDTH + 2 * WIDTH) + (2 * WIDTH * WIDTH + WIDTH)


def root_elements() -> int:
    return VOCAB * WIDTH + 2 * WIDTH
