"""hetcomm train --shard full on Gloo ranks (CPU, bf16 weights as 16-bit GPUs hold them):
each rank keeps only its range of the weights, the gradients' sum and the optimizer
state, each GPT block gathered while it computes; it trains as the unsharded run with
fp32 masters does, and resumes bit for bit, and on fewer ranks resharded."""

from dataclasses import replace

import pytest
import torch
from distributed import run_ranks, values
from test_train_shard import PARTS, interrupted, joined, resumed
from test_trainer import losses, tiny_config
from tolerances import farthest, order_bound

from hetcomm.loop.checkpoint import checkpoints
from hetcomm.train.config import validate
from hetcomm.train.trainer import Trainer


def full_config(tmp_path, world=4, **changes):
    """bf16 weights, memory for 18 B an element in 11/11/11/32 parts (scaled to the model)."""
    config = tiny_config(tmp_path, precision="bf16", wire="float16", global_batch=16, equal_steps=0,
                         shard="full", **changes)
    elements = 60_000   # more than the tiny GPT has: every part holds its range
    memory = ",".join(str(elements * 24 * part // sum(PARTS[:world])) for part in PARTS[:world])
    return replace(config, state_memory=memory)


def run_full(rank, world, config):
    trainer = Trainer(config, rank, world, torch.device("cpu"))
    trainer.run()
    sharded = trainer.loop.sharded_weights
    if sharded is None:
        return (losses(config.out) if rank == 0 else None), [p.detach().clone() for p in trainer.model.parameters()]
    held = {"local": sharded.local.numel() * sharded.local.element_size(), "gathered": sharded.gathered_bytes(),
            "sum": trainer.loop.reducer.accumulator.numel() * 4, "state": trainer.optimizer.state_bytes(),
            "range": sharded.range, "grads": [p.grad for p in trainer.model.parameters()],
            "peak": sharded.peak_gathered, "root": sharded.units[0].nbytes, "two": sharded.largest_units(2)}
    with sharded.gathered():
        weights = [p.detach().clone() for p in trainer.model.parameters()]
    return (losses(config.out) if rank == 0 else None), weights, held


def test_full_sharding_follows_the_unsharded_run_and_holds_its_ranges(tmp_path):
    full = values(run_ranks(4, run_full, full_config(tmp_path, split="1,3,5,7", out=str(tmp_path / "f")),
                            tmp_path=tmp_path))
    plain = values(run_ranks(4, run_full, replace(full_config(tmp_path, split="1,3,5,7"), shard=False,
                                                  state_memory=None, out=str(tmp_path / "p")),
                             tmp_path=tmp_path / "p"))
    # Within order_bound of the unsharded run: how far that run lands when only the order of
    # its sums changes (the shares dealt to the ranks in reverse), as for --shard.
    twin = values(run_ranks(4, run_full, replace(full_config(tmp_path, split="7,5,3,1"), shard=False,
                                                 state_memory=None, out=str(tmp_path / "t")),
                            tmp_path=tmp_path / "t"))
    bound = order_bound([plain[0][0]], [[twin[0][0]]])
    assert farthest([full[0][0]], [plain[0][0]]) <= bound, (full[0][0], plain[0][0], bound)
    assert full[0][0][-1] < full[0][0][0]
    for _, weights, held in full:
        assert all(torch.equal(a, b) for a, b in zip(weights, full[0][1]))   # every rank gathers the same model
        size = held["range"][1] - held["range"][0]
        assert held["local"] == 2 * size and held["sum"] == 4 * size and held["state"] == 12 * size
        assert held["gathered"] == 0 and all(g is None for g in held["grads"])   # nothing whole between steps
        assert held["peak"] == held["root"] + held["two"]   # embeddings and head, two blocks
    sizes = [h["range"][1] - h["range"][0] for _, _, h in full]
    assert sizes[3] > 2.5 * sizes[0]


def test_a_fully_sharded_run_resumes_bit_for_bit_and_on_fewer_ranks(tmp_path):
    config = full_config(tmp_path, split="2,3,5,6", out=str(tmp_path / "straight"))
    straight = values(run_ranks(4, interrupted, config, tmp_path=tmp_path))
    checkpoint = str(checkpoints(tmp_path / "at-step-3")[0])
    again = values(run_ranks(4, resumed, replace(config, out=str(tmp_path / "again")), checkpoint,
                             tmp_path=tmp_path / "a"))
    assert again[0][2] == 3 and again[0][0] == straight[0][0][3:]
    three = values(run_ranks(3, resumed, replace(full_config(tmp_path, world=3, split="4,5,7"),
                                                 out=str(tmp_path / "three")), checkpoint, tmp_path=tmp_path / "t"))
    for name in ("master", "exp_avg", "exp_avg_sq"):
        assert torch.equal(joined([r[1] for r in three], name), joined([r[1] for r in again], name))
    assert len(three[0][0]) == 3 and all(torch.isfinite(torch.tensor(three[0][0])))
    # A checkpoint of --shard (state) is of another layout: refused by name, before any step.
    state_run = replace(config, shard="state", out=str(tmp_path / "state"))
    refused = run_ranks(4, resumed, state_run, checkpoint, tmp_path=tmp_path / "s")
    for outcome in refused:
        assert outcome.get("type") == "CheckpointError", outcome


def model_state_unit_by_unit(rank, world, config):
    trainer = Trainer(config, rank, world, torch.device("cpu"))
    trainer.run()
    sharded = trainer.loop.sharded_weights
    sharded.peak_gathered = 0
    state = trainer._model_state()
    peak = sharded.peak_gathered
    with sharded.gathered():
        expected = {name: t.detach().clone() for name, t in trainer.model.state_dict().items()}
    return state, expected, peak, max(u.nbytes for u in sharded.units), sharded.units[0].nbytes + \
        sharded.largest_units(1)


def test_a_checkpoint_reads_the_model_out_one_unit_at_a_time(tmp_path):
    """The checkpoint's model entry is the whole model on rank 0 (none elsewhere), read
    out holding at most one layer unit at a time: a model no card holds whole saves."""
    config = full_config(tmp_path, world=2, n_layer=3, steps=2, split="6,10", out=str(tmp_path / "f"))
    ranks = values(run_ranks(2, model_state_unit_by_unit, config, tmp_path=tmp_path))
    state, expected, peak, largest, root_and_block = ranks[0]
    assert list(state) == list(expected)
    assert all(torch.equal(state[name], expected[name]) and state[name].device.type == "cpu" for name in state)
    assert state["wte.weight"] is state["head.weight"]   # tied: one tensor, saved once
    for _, _, peak, largest, root_and_block in ranks:
        assert peak == largest < root_and_block
    assert ranks[1][0] is None


@pytest.mark.parametrize("changes, message", [
    ({"shard": "half"}, r"--shard 'half': expected one of state, full"),
    ({"device": "cuda", "memory_caps": None}, r"--shard full on GPUs needs --state-memory and --memory-caps"),
])
def test_bad_full_shard_options_are_refused_by_name(tmp_path, changes, message):
    with pytest.raises(ValueError, match=message):
        validate(replace(full_config(tmp_path), **changes), 4)
