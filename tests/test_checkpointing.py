"""Activation checkpointing per card: each GPT block keeps only its input and recomputes
its forward in the backward. On some ranks and not others, with the weights fully
sharded (a recompute must gather nothing, or the ranks' collectives part) or not, a run
is the run without checkpointing bit for bit; and the bytes autograd keeps shrink to the
blocks' inputs."""

from dataclasses import replace

import pytest
import torch
from distributed import run_ranks, values
from test_train_full_shard import full_config, run_full
from test_loop import SEED
from tolerances import REORDERINGS, farthest, order_bound

from hetcomm.balance import WeightedDistributedSampler
from hetcomm.loop import BalancedLoop
from hetcomm.shard import Shard, ShardedAdamW
from hetcomm.train.config import validate
from hetcomm.train.data import TokenWindows
from hetcomm.train.model import GPT, GPTConfig

BLOCK = 16
GLOBAL_BATCH = 32
CONFIG = GPTConfig(vocab_size=64, block_size=BLOCK, n_layer=3, n_head=2, n_embd=32, dropout=0.0)


def windows():
    tokens = torch.randint(0, 64, (GLOBAL_BATCH * 4 * BLOCK + 1,), generator=torch.Generator().manual_seed(3))
    return TokenWindows(tokens.numpy(), BLOCK)


def train(rank, world, checkpointing, shard, loss_chunk_tokens=None):
    torch.manual_seed(SEED)
    model = GPT(CONFIG)
    model.checkpointing = checkpointing[rank]
    model.loss_chunk_tokens = loss_chunk_tokens
    options = {}
    if shard is not None:
        options["shard"] = Shard(memory=[10**7] * world, weights=shard == "full")
    loop = BalancedLoop(model, windows(), global_batch=GLOBAL_BATCH, split=[4, 6, 10, 12][:world],
                        memory_caps=[2, 3, 3, 4][:world], wire_dtype=torch.float32, items_per_sample=BLOCK,
                        seed=SEED, **options)
    if shard is None:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    else:
        optimizer = ShardedAdamW(model.parameters(), loop.reducer, lr=1e-2)
    losses = []
    for step in loop.steps(3):
        for inputs, targets in step:
            step.backward(model(inputs, targets, reduction="sum")[1], reduction="sum")
        result = step.reduce()
        optimizer.step()
        losses.append(result.loss)
    if loop.sharded_weights is not None:
        with loop.sharded_weights.gathered():
            return losses, [p.detach().clone() for p in model.parameters()]
    return losses, [p.detach().clone() for p in model.parameters()]


# --shard (state) checkpoints as the unsharded model does: its weights are whole on every rank.
@pytest.mark.parametrize("shard", [None, "full"])
def test_checkpointing_on_some_ranks_changes_nothing(tmp_path, shard):
    plain = values(run_ranks(4, train, [False] * 4, shard, tmp_path=tmp_path / "plain"))
    mixed = values(run_ranks(4, train, [True, False, True, False], shard, tmp_path=tmp_path / "mixed"))
    for (losses, weights), (expected_losses, expected) in zip(mixed, plain):
        assert losses == expected_losses
        assert all(torch.equal(a, b) for a, b in zip(weights, expected))


def one_process(order=None):
    """The same 3 steps on the whole global batch in one process, with torch's AdamW."""
    torch.manual_seed(SEED)
    model, data = GPT(CONFIG), windows()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    sampler = iter(WeightedDistributedSampler(len(data), [GLOBAL_BATCH], 0, seed=SEED))
    losses = []
    for _ in range(3):
        indices = list(next(sampler))
        inputs, targets = torch.utils.data.default_collate([data[i] for i in (order(indices) if order else indices)])
        optimizer.zero_grad()
        loss = model(inputs, targets)[1]
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()]


def test_a_chunked_loss_on_fully_sharded_ranks_trains_as_one_process(tmp_path):
    """Checkpointing on rank 0 and 2 computes their loss in chunks of 5 tokens (the head,
    tied to the sharded root's embedding, recomputed chunk by chunk in the backward): the
    run lands on the one-process run within what reordering its sums moves it."""
    ranks = values(run_ranks(4, train, [True, False, True, False], "full", 5, tmp_path=tmp_path))
    expected_losses, expected = one_process()
    reordered = [one_process(order) for order in REORDERINGS]
    loss_bound = order_bound([expected_losses], [[losses] for losses, _ in reordered])
    weight_bound = order_bound(expected, [weights for _, weights in reordered])
    for losses, weights in ranks:
        assert farthest([losses], [expected_losses]) <= loss_bound
        assert farthest(weights, expected) <= weight_bound


def saved_bytes(checkpointing: bool) -> int:
    torch.manual_seed(SEED)
    model = GPT(CONFIG)
    model.checkpointing = checkpointing
    kept = []

    def pack(tensor):
        kept.append(tensor.untyped_storage().nbytes())
        return tensor

    inputs = windows()[0][0][None].repeat(4, 1)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(inputs, inputs, reduction="sum")
    return sum(kept)


def test_a_checkpointed_block_keeps_its_input_alone():
    without, within = saved_bytes(False), saved_bytes(True)
    # Each block's input, 4 windows x 16 tokens x 32 fp32: what a checkpointed block keeps.
    block_input = 4 * BLOCK * CONFIG.n_embd * 4
    assert within < without / 2
    assert without - within > CONFIG.n_layer * 4 * block_input   # a block kept many times its input


def test_hetcomm_train_checkpoints_the_ranks_it_is_told_to(tmp_path):
    """--checkpointing on,off,on,off with --shard full: the run without it, bit for bit."""
    config = full_config(tmp_path, split="1,3,5,7", memory_caps="1,2,2,3")
    plain = values(run_ranks(4, run_full, replace(config, out=str(tmp_path / "plain")), tmp_path=tmp_path / "p"))
    mixed = values(run_ranks(4, run_full, replace(config, checkpointing="on,off,on,off", out=str(tmp_path / "m")),
                             tmp_path=tmp_path / "m"))
    assert mixed[0][0] == plain[0][0]
    assert all(torch.equal(a, b) for a, b in zip(mixed[0][1], plain[0][1]))


@pytest.mark.parametrize("text, message", [
    ("sometimes", r"--checkpointing 'sometimes': expected comma-separated values such as on,on,off,off"),
    ("on,off", r"--checkpointing 'on,off': 2 values for 4 ranks; give one per rank"),
])
def test_a_bad_checkpointing_is_refused_by_name(tmp_path, text, message):
    with pytest.raises(ValueError, match=message):
        validate(replace(full_config(tmp_path), checkpointing=text), 4)
