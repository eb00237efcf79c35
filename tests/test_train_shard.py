"""hetcomm train --shard on Gloo ranks (CPU, bf16 weights as 16-bit GPUs hold them):
it trains as the unsharded run with fp32 masters does, each rank keeping only its
range of the masters and moments; it resumes bit for bit, and on fewer ranks with the
same masters and moments, resharded."""

import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from distributed import run_ranks, values
from test_trainer import losses, tiny_config
from tolerances import farthest, order_bound

from hetcomm.loop.checkpoint import CheckpointError, checkpoints
from hetcomm.train import launch
from hetcomm.train.trainer import Trainer

PARTS = (11, 11, 11, 32)


def sharded_config(tmp_path, world=4, **changes):
    """bf16 weights, memory for state in 11/11/11/32 parts (scaled to the model)."""
    config = tiny_config(tmp_path, precision="bf16", wire="float16", global_batch=16, equal_steps=0,
                         shard=True, **changes)
    elements = 60_000   # more than the tiny GPT has: every part holds its range
    memory = ",".join(str(elements * 16 * part // sum(PARTS[:world])) for part in PARTS[:world])
    return replace(config, state_memory=memory)


def run_and_keep_state(rank, world, config):
    trainer = Trainer(config, rank, world, torch.device("cpu"))
    trainer.run()
    weights = [p.detach().clone() for p in trainer.model.parameters()]
    if not config.shard:
        return (losses(config.out) if rank == 0 else None), None, None, None, weights
    kept = {name: t.clone() for name, t in trainer.optimizer.shard_state().items()}
    return (losses(config.out) if rank == 0 else None), trainer.loop.reducer.range, kept, \
        trainer.optimizer.state_bytes(), weights


def test_sharded_training_follows_the_unsharded_run(tmp_path):
    sharded = values(run_ranks(4, run_and_keep_state, sharded_config(tmp_path, split="1,3,5,7",
                                                                       out=str(tmp_path / "s")), tmp_path=tmp_path))
    plain = values(run_ranks(4, run_and_keep_state, replace(sharded_config(tmp_path, split="1,3,5,7"), shard=False,
                                                            state_memory=None, out=str(tmp_path / "p")),
                             tmp_path=tmp_path / "p"))
    # Within order_bound of the unsharded run: how far that run lands when only the order of
    # its sums changes, the fp16 wire's sum included (the reduce-scatter adds the ranks'
    # fp16 values in another order than the all-reduce does): the same shares dealt to the
    # ranks in reverse. bf16 weights make it coarse: an fp32 master moved by a rounding can
    # round to the neighbouring bf16 weight.
    twin = values(run_ranks(4, run_and_keep_state, replace(sharded_config(tmp_path, split="7,5,3,1"), shard=False,
                                                           state_memory=None, out=str(tmp_path / "t")),
                            tmp_path=tmp_path / "t"))
    bound = order_bound([plain[0][0]], [[twin[0][0]]])
    assert farthest([sharded[0][0]], [plain[0][0]]) <= bound, (sharded[0][0], plain[0][0], bound)
    assert sharded[0][0][-1] < sharded[0][0][0]
    ranges = [r[1] for r in sharded]
    total = ranges[-1][1]
    assert [a for a, _ in ranges[1:]] == [b for _, b in ranges[:-1]]
    for (_, (start, stop), kept, state_bytes, _) in sharded:
        assert set(kept) == {"master", "exp_avg", "exp_avg_sq"}
        assert all(t.numel() == stop - start and t.dtype == torch.float32 for t in kept.values())
        assert state_bytes == (stop - start) * 12
    assert sum(r[3] for r in sharded) == total * 12
    assert ranges[3][1] - ranges[3][0] > 2.5 * (ranges[0][1] - ranges[0][0])
    # Every rank holds the same 16-bit weights: the masters' of each range, rounded.
    for out in sharded[1:]:
        assert all(torch.equal(a, b) for a, b in zip(out[4], sharded[0][4]))


def interrupted(rank, world, config):
    trainer = Trainer(config, rank, world, torch.device("cpu"))
    trainer.run(until=3)
    trainer.save_checkpoint()
    if rank == 0:
        shutil.copytree(config.out, Path(config.out).with_name("at-step-3"))
    dist.barrier()
    trainer.run()
    state = {name: t.clone() for name, t in trainer.optimizer.shard_state().items()}
    return (losses(config.out) if rank == 0 else None), state


def resumed(rank, world, config, checkpoint):
    trainer = Trainer(replace(config, resume=checkpoint), rank, world, torch.device("cpu"))
    loaded = {name: t.clone() for name, t in trainer.optimizer.shard_state().items()}
    step = trainer.step
    trainer.run()
    return (losses(config.out) if rank == 0 else None), loaded, step


def joined(states, name):
    return torch.cat([s[name] for s in states])


def test_a_sharded_run_resumes_bit_for_bit_and_on_fewer_ranks(tmp_path):
    config = sharded_config(tmp_path, split="2,3,5,6", out=str(tmp_path / "straight"))
    straight = values(run_ranks(4, interrupted, config, tmp_path=tmp_path))
    saved = tmp_path / "at-step-3"
    checkpoint = str(checkpoints(saved)[0])
    again = values(run_ranks(4, resumed, replace(config, out=str(tmp_path / "again")), checkpoint,
                             tmp_path=tmp_path / "a"))
    assert again[0][2] == 3 and again[0][0] == straight[0][0][3:]
    # A card removed: 3 ranks, another memory split, the same masters and moments resharded.
    three = values(run_ranks(3, resumed, replace(sharded_config(tmp_path, world=3, split="4,5,7"),
                                                 out=str(tmp_path / "three")), checkpoint,
                             tmp_path=tmp_path / "t"))
    for name in ("master", "exp_avg", "exp_avg_sq"):
        assert torch.equal(joined([r[1] for r in three], name), joined([r[1] for r in again], name))
    assert len(three[0][0]) == 3 and all(torch.isfinite(torch.tensor(three[0][0])))
    # A damaged range stops every rank, each naming the file, before any step.
    damaged = saved / "checkpoint-00000003.range-2-of-4.pt"
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0x40
    damaged.write_bytes(bytes(data))
    refused = run_ranks(3, resumed, replace(sharded_config(tmp_path, world=3, split="4,5,7"),
                                            out=str(tmp_path / "refused")), checkpoint, tmp_path=tmp_path / "r")
    for outcome in refused:
        assert outcome.get("type") == "CheckpointError" and "range-2-of-4.pt" in outcome["message"], outcome


def checkpointed(rank, world, config):
    trainer = Trainer(config, rank, world, torch.device("cpu"))
    trainer.run(until=4)   # checkpoints at steps 2 and 4 of 6: an unfinished run
    trainer.save_checkpoint()


def test_a_resume_passes_over_a_checkpoint_whose_ranges_are_incomplete(tmp_path, capsys):
    config = sharded_config(tmp_path, world=2, split="7,9", checkpoint_every=2, out=str(tmp_path / "run"))
    values(run_ranks(2, checkpointed, config, tmp_path=tmp_path))
    run = Path(config.out)
    (run / "checkpoint-00000004.range-1-of-2.pt").unlink()   # a rank's range of the newest step lost
    choosing = replace(config, resume=None)
    launch._check_resume(choosing, 2)
    assert Path(choosing.resume).name == "checkpoint-00000002.pt"
    assert "the ranges of ranks [1] of 2 are missing" in capsys.readouterr().err
    with pytest.raises(CheckpointError, match=r"ranges of ranks \[1\] of 2 are missing"):
        launch._check_resume(replace(config, resume=str(run / "checkpoint-00000004.pt")), 2)
