"""BalancedLoop(shard=Shard(weights=True)) on Gloo ranks: the weights sharded by memory
too, each layer gathered for its forward and its backward only, and the gradients
streamed onto their owners layer by layer (or kept whole per rank). Uneven batches, uneven
micro-batch counts (padded to the same count on every rank) and uneven memory train as
one process with torch's AdamW on the whole global batch; each rank holds exactly its
range and at most the root and two layers gathered; bad settings are one clear error."""

import re

import pytest
import torch
from distributed import run_ranks, values
from sharded_models import TinyBlocks, block_elements, root_elements
from test_loop import GLOBAL_BATCH, SEED, MaskedTokens, masked_loss
from tolerances import REORDERINGS, farthest, order_bound

from hetcomm.balance import WeightedDistributedSampler
from hetcomm.loop import BalancedLoop
from hetcomm.shard import Shard, ShardedAdamW
from hetcomm.simulated import SimulatedSpeed, Slowdown

ELEMENTS = root_elements() + 3 * block_elements()
# Bytes each rank has for what it keeps per element (fp32: its weight, two moments and the
# streamed gradients' fp32 sum, 16 bytes, and 4 of scratch for the whole range, as it is
# smaller than a bucket) with room to spare, 11 : 11 : 11 : 32 as 1080 Tis beside a V100-32GB.
MEMORY = [m * ELEMENTS * 21 // 65 for m in (11, 11, 11, 32)]


def train(rank, world, steps, options, gradients="streamed"):
    model = TinyBlocks()
    loop = BalancedLoop(model, MaskedTokens(), global_batch=GLOBAL_BATCH, seed=SEED, wire_dtype=torch.float32,
                        shard=Shard(memory=[m * sum(MEMORY) // sum(MEMORY[:world]) for m in MEMORY[:world]],
                                    weights=True, gradients=gradients), **options)
    sharded = loop.sharded_weights
    optimizer = ShardedAdamW(model.parameters(), loop.reducer, lr=0.05, betas=(0.9, 0.95))
    losses, norms, splits, empty_between_steps = [], [], [], True
    for step in loop.steps(steps):
        for batch in step:
            loss, count = masked_loss(model, batch)
            step.backward(loss, count=count)
        result = step.reduce()
        if not result.skipped:
            optimizer.step(grad_scale=result.clip_coefficient(1.0))
        losses.append(result.loss)
        norms.append(result.grad_norm)
        splits.append([r.samples for r in result.ranks])
        empty_between_steps &= sharded.gathered_bytes() == 0 and all(
            p.untyped_storage().nbytes() == 0 for p in model.parameters())
        if gradients == "streamed":   # no gradient held between micro-batches either
            empty_between_steps &= loop.flat.grads is None and all(p.grad is None for p in model.parameters())
    peak = sharded.peak_gathered
    with sharded.gathered():
        weights = [p.detach().clone() for p in model.parameters()]
    return {"losses": losses, "norms": norms, "weights": weights, "splits": splits, "peak": peak,
            "range": sharded.range,
            "local_bytes": sharded.local.numel() * sharded.local.element_size(),
            "state_bytes": optimizer.state_bytes(), "empty": empty_between_steps,
            "largest_two": sharded.largest_units(2), "wire_peak": getattr(loop.reducer, "peak_wire_bytes", None),
            "sum_bytes": loop.reducer.accumulator.numel() * 4 if gradients == "streamed" else None}


def one_process(steps, order=None):
    model, data = TinyBlocks(), MaskedTokens()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, betas=(0.9, 0.95), foreach=False)
    sampler = WeightedDistributedSampler(len(data), [GLOBAL_BATCH], 0, seed=SEED)
    batches = (indices for _ in range(steps) for indices in sampler)
    losses, norms = [], []
    for _ in range(steps):
        indices = list(next(batches))
        batch = torch.utils.data.default_collate([data[i] for i in (order(indices) if order else indices)])
        optimizer.zero_grad()
        loss, _ = masked_loss(model, batch)
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item())
        optimizer.step()
        losses.append(loss.item())
    return losses, norms, [p.detach().clone() for p in model.parameters()]


PADDED = {"split": [1, 3, 5, 7], "memory_caps": [1, 2, 2, 3]}   # micro-batches 1, 2, 3, 3: ranks 0-2 padded


@pytest.mark.parametrize("options, gradients", [
    pytest.param(PADDED, "streamed", id="padded-streamed"),
    pytest.param(PADDED, "whole", id="padded-whole"),
    # The first step timed in parts (runs of different counts on each rank), then rebalanced.
    pytest.param({}, "streamed", id="dynamic-streamed"),
])
def test_fully_sharded_weights_train_as_one_process(tmp_path, options, gradients):
    steps = 6
    ranks = values(run_ranks(4, train, steps, options, gradients, tmp_path=tmp_path))
    expected_losses, expected_norms, expected = one_process(steps)
    reordered = [one_process(steps, order) for order in REORDERINGS]
    loss_bound = order_bound([expected_losses], [[losses] for losses, _, _ in reordered])
    # AdamW hardly moves under a gradient scaled as a whole; the norm the reduction measured does.
    norm_bound = order_bound([expected_norms], [[norms] for _, norms, _ in reordered])
    weight_bound = order_bound(expected, [weights for _, _, weights in reordered])
    for rank in ranks:
        assert all(sum(s) == GLOBAL_BATCH for s in rank["splits"])
        assert farthest([rank["losses"]], [expected_losses]) <= loss_bound, (rank["losses"], expected_losses)
        assert farthest([rank["norms"]], [expected_norms]) <= norm_bound, (rank["norms"], expected_norms)
        assert farthest(rank["weights"], expected) <= weight_bound, (farthest(rank["weights"], expected), weight_bound)
        assert rank["empty"]   # between steps no rank holds any gathered weight (nor a streamed gradient)


def train_throttled(rank, world, throttle_step):
    speed = SimulatedSpeed(rank, 0.05, (Slowdown(1, throttle_step, 0.1),))
    return train(rank, world, throttle_step + 3, {"simulated_speed": speed})


def test_a_throttled_rank_is_rebalanced_though_the_gathers_keep_the_ranks_in_step(tmp_path):
    """Every gather waits for the slowest owner, so a rank's wall time holds the others'
    slowness too; balancing times the compute without those waits."""
    ranks = values(run_ranks(2, train_throttled, 6, tmp_path=tmp_path))
    assert ranks[0]["splits"][-1][1] <= GLOBAL_BATCH // 8, ranks[0]["splits"]


def test_each_rank_holds_its_range_and_at_most_two_layers_beside_the_root(tmp_path):
    ranks = values(run_ranks(4, train, 2, PADDED, tmp_path=tmp_path))
    sizes = [r["range"][1] - r["range"][0] for r in ranks]
    assert sum(sizes) == ELEMENTS
    assert sizes[3] > 2.5 * sizes[0]   # ranges follow memory
    for rank, size in zip(ranks, sizes):
        assert rank["local_bytes"] == 4 * size
        assert rank["state_bytes"] == 8 * size   # fp32 weights are their own masters: two moments
        # The root unit (embedding, tied head, final norm) and two blocks: the one computing, the next prefetched.
        assert rank["largest_two"] == 2 * 4 * block_elements()
        assert rank["peak"] == 4 * root_elements() + rank["largest_two"]
        # Streamed gradients: the owner's fp32 sum of its range, and at most two blocks' wires on their way.
        assert rank["sum_bytes"] == 4 * size
        assert rank["wire_peak"] == rank["largest_two"]


def test_the_layout_pays_for_what_each_mode_keeps_per_element():
    from hetcomm.shard.layout import state_bytes_per_element
    assert state_bytes_per_element(torch.bfloat16) == 12                              # masters, two moments
    assert state_bytes_per_element(torch.bfloat16, weights=True) == 14                # and the weights' range
    assert state_bytes_per_element(torch.bfloat16, weights=True, streamed=True) == 18  # and the fp32 sum
    assert state_bytes_per_element(torch.float32, weights=True, streamed=True) == 16   # fp32: no masters


def refusals(rank, world, how):
    model = TinyBlocks()
    shard = {"memory": [10**6] * world, "weights": True}
    options = {}
    if how == "foreign unit":
        shard["units"] = [torch.nn.Linear(2, 2)]
    elif how == "unit twice":
        shard["units"] = [model.blocks[0], model.blocks[0]]
    elif how == "units without weights":
        shard["weights"] = False
        shard["units"] = list(model.blocks)
    elif how == "empty unit":
        shard["units"] = [model.blocks[0], model.blocks[0].norm]
    elif how == "gradients":
        shard["gradients"] = "sharded"
    elif how == "probe":
        options = {"probe_forward": lambda batch: masked_loss(model, batch)[0]}
    try:
        BalancedLoop(model, MaskedTokens(), global_batch=GLOBAL_BATCH, wire_dtype=torch.float32,
                     shard=Shard(**shard), **options)
    except ValueError as error:
        return str(error)
    return "no error"


@pytest.mark.parametrize("how, message", [
    ("foreign unit", r"units\[0\] is not a submodule of the model \(a Linear\)"),
    ("unit twice", r"units\[1\] appears twice"),
    ("units without weights", r"pass weights=True with them"),
    ("empty unit", r"units\[1\] \(LayerNorm\) holds no trained parameter of its own"),
    ("gradients", r"gradients = 'sharded': expected 'streamed' or 'whole'"),
    ("probe", r"pass memory_caps"),
])
def test_bad_full_sharding_is_one_clear_error_on_every_rank(tmp_path, how, message):
    for error in values(run_ranks(2, refusals, how, tmp_path=tmp_path)):
        assert re.search(message, error), error
