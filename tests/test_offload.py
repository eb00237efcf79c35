"""The optimizer state offloaded to host memory (Shard(offload="optimizer"),
ShardedAdamW(offload=True), `hetcomm train --offload optimizer`) on Gloo ranks. On CPU
ranks the host is the device, yet the same copies are made (the reduced gradient range
down into the host's staging, the new weights up from it) and the same CPU adamw_ kernel
steps: an offloaded run is the run without offload bit for bit, with fp32 and bf16
weights, fully sharded or the state alone; the device keeps no state, the host 18 bytes
an element (16 for fp32 weights); the ranges are sized by what the device keeps;
checkpoints resume on another world size; bad settings are refused by name."""

from dataclasses import replace

import pytest
import torch
from distributed import run_ranks, values
from sharded_models import TinyBlocks, block_elements, root_elements
from test_loop import GLOBAL_BATCH, SEED, MaskedTokens, masked_loss
from test_train_full_shard import full_config, joined
from test_train_shard import interrupted, resumed
from test_trainer import losses, tiny_config

from hetcomm.loop import BalancedLoop
from hetcomm.loop.checkpoint import checkpoints
from hetcomm.shard import Shard, ShardedAdamW
from hetcomm.shard.layout import ALIGN, host_bytes_per_element, layout_by_host_memory, state_bytes_per_element
from hetcomm.train.config import from_args, parser, validate
from hetcomm.train.trainer import Trainer

ELEMENTS = root_elements() + 3 * block_elements()
# The same explicit ranges with and without offload: the reduction's sums are then the same.
RANGES = [96, 96, 160, ELEMENTS - 352]
SKIPPED_AT = 2   # a step told found_inf after the real one: nothing may move


def groups(model):
    return [{"params": [p for p in model.parameters() if p.dim() == 2], "weight_decay": 0.1},
            {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0, "lr": 0.02}]


def steps_of(rank, world, dtype, weights, offload, steps=4, overlap=None):
    model = TinyBlocks().to(dtype)
    loop = BalancedLoop(model, MaskedTokens(), global_batch=GLOBAL_BATCH, seed=SEED, wire_dtype=torch.float32,
                        split=[1, 3, 5, 7], shard=Shard(ranges=RANGES, weights=weights,
                                                        offload="optimizer" if offload else None))
    optimizer = ShardedAdamW(groups(model), loop.reducer, lr=0.05, betas=(0.9, 0.95), offload=offload,
                             overlap=overlap)
    losses_seen, unmoved = [], []
    for step in loop.steps(steps):
        for batch in step:
            loss, count = masked_loss(model, batch)
            step.backward(loss, count=count)
        result = step.reduce()
        before = None if loop.sharded_weights is None else loop.sharded_weights.local.clone()
        optimizer.step(grad_scale=result.clip_coefficient(1.0))
        if before is not None:   # the range's weights right after step(): deferred, they have not moved
            unmoved.append(torch.equal(before, loop.sharded_weights.local))
        if step.number == SKIPPED_AT:
            optimizer.step(grad_scale=result.clip_coefficient(1.0), found_inf=torch.ones(1))
        for group in optimizer.param_groups:   # a schedule: the step's own rates must stay the step's
            group["lr"] *= 0.7
        losses_seen.append(result.loss)
    if loop.sharded_weights is not None:
        with loop.sharded_weights.gathered():
            weights_now = [p.detach().clone() for p in model.parameters()]
    else:
        weights_now = [p.detach().clone() for p in model.parameters()]
    state = {name: t.detach().to("cpu", copy=True) for name, t in optimizer.shard_state().items()}
    devices = {name: t.device.type for name, t in optimizer.shard_state().items()}
    return {"losses": losses_seen, "weights": weights_now, "state": state, "range": optimizer.range,
            "state_bytes": optimizer.state_bytes(), "host_bytes": optimizer.host_bytes(), "devices": devices,
            "steps": [c.item() for c in optimizer.steps], "held": loop.memory_held_by_training(),
            "unmoved": unmoved}


@pytest.mark.parametrize("weights", [True, False], ids=["full", "state"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_an_offloaded_step_is_the_device_step_bit_for_bit(tmp_path, dtype, weights):
    """Offloaded, stepped at once (overlap off, as on CPU ranks by default): the device's
    step. Fully sharded with overlap=True, step() leaves the range's weights as they were,
    each unit's part is stepped and copied up at its next gather with the rates of its
    step (the schedule moves them in between), and the run is the same bit for bit."""
    plain = values(run_ranks(4, steps_of, dtype, weights, False, tmp_path=tmp_path / "plain"))
    offloaded = values(run_ranks(4, steps_of, dtype, weights, True, tmp_path=tmp_path / "offloaded"))
    if weights:
        deferred = values(run_ranks(4, steps_of, dtype, weights, True, 4, True, tmp_path=tmp_path / "deferred"))
        for rank, (a, b) in enumerate(zip(offloaded, deferred)):
            assert a["losses"] == b["losses"]
            assert all(torch.equal(x, y) for x, y in zip(a["weights"], b["weights"])), rank
            for name in a["state"]:
                assert torch.equal(a["state"][name], b["state"][name]), (rank, name)
            assert not any(a["unmoved"]) and all(b["unmoved"]) and b["steps"] == [4.0, 4.0]
    for rank, (a, b) in enumerate(zip(plain, offloaded)):
        assert a["range"] == b["range"] and b["range"][1] - b["range"][0] == RANGES[rank]
        assert a["losses"] == b["losses"]
        assert all(torch.equal(x, y) for x, y in zip(a["weights"], b["weights"])), rank
        assert a["state"].keys() == b["state"].keys()
        for name in a["state"]:
            assert torch.equal(a["state"][name], b["state"][name]), (rank, name)
        assert a["steps"] == b["steps"] == [4.0, 4.0]   # the skipped step counted nowhere
        size = RANGES[rank]
        # The device keeps no state; the host the params AdamW steps, two moments and the staging.
        assert b["state_bytes"] == 0 and a["state_bytes"] == (8 if dtype == torch.float32 else 12) * size
        assert b["host_bytes"] == host_bytes_per_element(dtype) * size and a["host_bytes"] == 0
        assert b["host_bytes"] == (16 if dtype == torch.float32 else 18) * size
        assert set(b["devices"].values()) == {"cpu"}
        assert a["held"] - b["held"] == a["state_bytes"]   # the loop counts what the device keeps
    assert plain[0]["losses"][-1] < plain[0]["losses"][0]


def test_offload_sizes_ranges_by_what_the_device_keeps():
    # Per element on the device: the weights' range and the streamed gradients' fp32 sum.
    assert state_bytes_per_element(torch.bfloat16, weights=True, streamed=True, offload=True) == 6
    assert state_bytes_per_element(torch.float32, weights=True, streamed=True, offload=True) == 8
    assert state_bytes_per_element(torch.bfloat16, weights=True, offload=True) == 2   # whole gradients per rank
    assert state_bytes_per_element(torch.bfloat16, offload=True) == 0                # the state alone: nothing
    assert host_bytes_per_element(torch.bfloat16) == host_bytes_per_element(torch.float16) == 18
    assert host_bytes_per_element(torch.float32) == 16
    # The state alone offloaded: by the hosts' memory (a 4-card machine's share against a 2-card one's), or equal.
    total = 100_000
    equal = layout_by_host_memory(None, 4, total, torch.bfloat16, "test").sizes()
    assert sum(equal) == total and max(equal) - min(equal) <= ALIGN
    by_host = layout_by_host_memory([18 * 10_000, 18 * 10_000, 18 * 40_000, 18 * 40_000], 4, total,
                                    torch.bfloat16, "test").sizes()
    assert by_host == [10_000, 10_000, 40_000, 40_000]
    with pytest.raises(ValueError, match=r"host memory for the offloaded optimizer state .* 18 bytes per element"):
        layout_by_host_memory([18 * 1000] * 4, 4, total, torch.bfloat16, "test")


def layouts(rank, world, weights, memory):
    model = TinyBlocks()
    shard = Shard(memory=memory, weights=weights, offload="optimizer")
    loop = BalancedLoop(model, MaskedTokens(), global_batch=GLOBAL_BATCH, seed=SEED, wire_dtype=torch.float32,
                        memory_caps=[4] * world if weights else None, shard=shard)
    return loop.reducer.layout.sizes()


def test_the_loop_sizes_offloaded_ranges_by_device_or_host_memory(tmp_path):
    def near_share(size, capacity):   # rank 0's range: proportional to what each rank can hold, to ALIGN
        return abs(size - ELEMENTS * capacity / (capacity + ELEMENTS)) < ALIGN

    # Fully sharded: memory is the device's, 8 bytes an element (fp32 weight, fp32 sum) and 4 of
    # scratch: rank 0 holds 300 elements (at 16 + 4 without offload, 180, and both only 1454 of them).
    device = [12 * 300, 12 * ELEMENTS]
    sizes = values(run_ranks(2, layouts, True, device, tmp_path=tmp_path / "full"))[0]
    assert sum(sizes) == ELEMENTS and near_share(sizes[0], 300)
    # The state alone without memory: equal ranges (nothing probed, no error on CPU ranks).
    sizes = values(run_ranks(2, layouts, False, None, tmp_path=tmp_path / "equal"))[0]
    assert sum(sizes) == ELEMENTS and abs(sizes[0] - sizes[1]) <= ALIGN
    # ... with memory: each rank's host share, 16 bytes an element for fp32 weights.
    sizes = values(run_ranks(2, layouts, False, [16 * 200, 16 * ELEMENTS], tmp_path=tmp_path / "host"))[0]
    assert sum(sizes) == ELEMENTS and near_share(sizes[0], 200)


def refused_overlaps(rank, world):
    found = []
    for weights, offload, overlap in ((False, True, True), (True, False, True), (True, True, "yes")):
        model = TinyBlocks()
        loop = BalancedLoop(model, MaskedTokens(), global_batch=GLOBAL_BATCH, seed=SEED, wire_dtype=torch.float32,
                            split=[GLOBAL_BATCH], shard=Shard(ranges=[ELEMENTS], weights=weights,
                                                              offload="optimizer" if offload else None))
        try:
            ShardedAdamW(model.parameters(), loop.reducer, offload=offload, overlap=overlap)
        except ValueError as error:
            found.append(str(error))
    return found


def test_bad_offload_settings_are_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match=r"Shard: offload = 'weights': expected None or 'optimizer'"):
        Shard(offload="weights")
    with pytest.raises(ValueError, match=r"ShardedAdamW: offload = 'yes': expected True"):
        ShardedAdamW(TinyBlocks().parameters(), None, offload="yes")
    needs = "ShardedAdamW: overlap=True defers each layer unit's update to its next gather: it needs offload=True " \
            "and fully sharded weights"
    assert [message[:len(needs)] for message in values(run_ranks(1, refused_overlaps, tmp_path=tmp_path))[0]] == [
        needs, needs, "ShardedAdamW: overlap = 'yes': expected True, False or None"]


# --- hetcomm train --offload optimizer ------------------------------------------------

def run_held(rank, world, config):
    trainer = Trainer(config, rank, world, torch.device("cpu"))
    trainer.run()
    sharded = trainer.loop.sharded_weights
    with sharded.gathered():
        weights = [p.detach().clone() for p in trainer.model.parameters()]
    state = {name: t.detach().to("cpu", copy=True) for name, t in trainer.optimizer.shard_state().items()}
    return {"losses": losses(config.out) if rank == 0 else None, "weights": weights, "state": state,
            "range": sharded.range, "state_bytes": trainer.optimizer.state_bytes(),
            "host_bytes": trainer.optimizer.host_bytes(), "description": trainer._weights_description()}


def test_train_full_shard_with_offload_is_the_run_without_it_bit_for_bit(tmp_path):
    config = full_config(tmp_path, split="1,3,5,7", out=str(tmp_path / "plain"))
    plain = values(run_ranks(4, run_held, config, tmp_path=tmp_path / "p"))
    offloaded = values(run_ranks(4, run_held, replace(config, offload="optimizer", out=str(tmp_path / "off")),
                                 tmp_path=tmp_path / "o"))
    assert offloaded[0]["losses"] == plain[0]["losses"] and len(plain[0]["losses"]) == config.steps
    for a, b in zip(plain, offloaded):
        assert a["range"] == b["range"]   # sized by 6 bytes an element instead of 18: the same shares here
        assert all(torch.equal(x, y) for x, y in zip(a["weights"], b["weights"]))
        assert all(torch.equal(a["state"][n], b["state"][n]) for n in ("master", "exp_avg", "exp_avg_sq"))
        size = b["range"][1] - b["range"][0]
        assert b["state_bytes"] == 0 and b["host_bytes"] == 18 * size and a["state_bytes"] == 12 * size
        assert f"state offloaded: {18 * size:,} bytes of host memory" in b["description"]


def test_an_offloaded_run_resumes_bit_for_bit_and_on_three_ranks(tmp_path):
    config = full_config(tmp_path, split="2,3,5,6", offload="optimizer", out=str(tmp_path / "straight"))
    straight = values(run_ranks(4, interrupted, config, tmp_path=tmp_path))
    checkpoint = str(checkpoints(tmp_path / "at-step-3")[0])
    again = values(run_ranks(4, resumed, replace(config, out=str(tmp_path / "again")), checkpoint,
                             tmp_path=tmp_path / "a"))
    assert again[0][2] == 3 and again[0][0] == straight[0][0][3:]
    three = values(run_ranks(3, resumed, replace(full_config(tmp_path, world=3, split="4,5,7"), offload="optimizer",
                                                 out=str(tmp_path / "three")), checkpoint, tmp_path=tmp_path / "t"))
    for name in ("master", "exp_avg", "exp_avg_sq"):
        assert torch.equal(joined([r[1] for r in three], name), joined([r[1] for r in again], name))
    assert len(three[0][0]) == 3 and all(torch.isfinite(torch.tensor(three[0][0])))
    # The ranges' format is the same offloaded or not: a run without offload resumes it too, on 3 ranks.
    kept = values(run_ranks(3, resumed, replace(full_config(tmp_path, world=3, split="4,5,7"),
                                                out=str(tmp_path / "kept")), checkpoint, tmp_path=tmp_path / "k"))
    assert kept[0][0] == three[0][0]


def test_fp32_state_sharding_offloaded_resumes_bit_for_bit(tmp_path):
    """fp32 weights, the state alone sharded: the host's copy of the range's weights is
    what AdamW steps, and a resume must set it from the checkpoint's weights."""
    config = tiny_config(tmp_path, precision="fp32", global_batch=16, equal_steps=0, split="6,10", shard="state",
                         offload="optimizer", out=str(tmp_path / "straight"))
    straight = values(run_ranks(2, interrupted, config, tmp_path=tmp_path))
    checkpoint = str(checkpoints(tmp_path / "at-step-3")[0])
    again = values(run_ranks(2, resumed, replace(config, out=str(tmp_path / "again")), checkpoint,
                             tmp_path=tmp_path / "a"))
    assert again[0][2] == 3 and again[0][0] == straight[0][0][3:]
    assert set(again[0][1]) == {"exp_avg", "exp_avg_sq"}   # the weights are the model's, saved whole


@pytest.mark.parametrize("changes, message", [
    ({"shard": False, "state_memory": None}, r"--offload optimizer offloads the sharded optimizer state; add --shard"),
    ({"offload": "weights"}, r"--offload 'weights': expected one of optimizer"),
])
def test_bad_offload_options_are_refused_by_name(tmp_path, changes, message):
    with pytest.raises(ValueError, match=message):
        validate(replace(full_config(tmp_path), **{"offload": "optimizer", **changes}), 4)


def test_bad_offload_arguments_are_refused_by_name(tmp_path):
    with pytest.raises(SystemExit):   # argparse: one line naming --offload and its choices
        parser().parse_args(["--offload", "gpu"])
    config = from_args(parser().parse_args(["--offload", "optimizer", "--data", str(tmp_path)]))
    with pytest.raises(ValueError, match=r"--offload optimizer .* add --shard"):
        validate(config, 4)
