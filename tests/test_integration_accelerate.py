"""The plain-accelerate recipe (examples/accelerate_loop.py) on 4 Gloo ranks split 1/3/5/7
trains the weights one process trains on the union batches' mean over all their tokens
(both stepping with SGD instead of the recipe's AdamW: Adam's normalisation turns the
rounding of near-zero gradients into whole steps)."""

import sys
from pathlib import Path

import pytest
import torch
from distributed import run_ranks, values
from tolerances import REORDERINGS, farthest, order_bound

pytest.importorskip("transformers", reason="the recipe needs pip install 'hetcomm[hf]'")
pytest.importorskip("accelerate", reason="the recipe needs pip install 'hetcomm[hf]'")

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))

import accelerate_loop  # noqa: E402
from common import CausalLMSamples  # noqa: E402
from hf_gpt2 import build_model  # noqa: E402

SPLIT = [1, 3, 5, 7]


def arguments(*extra):
    return accelerate_loop.parser().parse_args(["--seq", "16", "--steps", "3", "--global-batch", "16", *extra])


def sgd(params, lr, weight_decay):
    return torch.optim.SGD(params, lr=0.5)


def in_recipe(rank, world, args):
    torch.optim.AdamW = sgd   # this rank's process only
    _, model, batches = accelerate_loop.train(rank, world, torch.device("cpu"), args, split=SPLIT)
    return [p.detach().clone() for p in model.parameters()], batches.split


def one_process(args, reorder=None):
    """SGD on one process, each step on the permutation's next 16 samples (in
    reorder(indices), if given) as one batch."""
    torch.manual_seed(args.seed)
    model, data = build_model(args.size, args.seq, args.dropout), CausalLMSamples(args.seq)
    optimizer = sgd(model.parameters(), args.lr, 0.1)
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(args.seed)).tolist()
    for step in range(args.steps):
        indices = order[16 * step: 16 * step + 16]
        batch = torch.utils.data.default_collate([data[i] for i in (reorder(indices) if reorder else indices)])
        optimizer.zero_grad()
        model(**batch).loss.backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def test_the_recipe_on_an_uneven_split_equals_one_process(tmp_path):
    args = arguments()
    ranks = values(run_ranks(4, in_recipe, args, tmp_path=tmp_path))
    reference = one_process(args)
    assert all(split == tuple(SPLIT) for _, split in ranks)
    # Within order_bound: what the one-process run moves by when only the order of its sums
    # changes (tests/tolerances.py).
    bound = order_bound(reference, [one_process(args, reorder) for reorder in REORDERINGS])
    assert farthest(ranks[0][0], reference) <= bound, (farthest(ranks[0][0], reference), bound)

