"""BalancedLoop(shard=...) on Gloo ranks: uneven batches and uneven memory train as one
process with torch's AdamW on the whole global batch (param groups, an LR schedule,
accumulation, rebalancing and the handoff included); bad sharding settings are one
clear error on every rank before any step."""

import pytest
import torch
from distributed import run_ranks, values
from test_loop import GLOBAL_BATCH, SEED, MaskedTokens, TinyTagger, masked_loss
from tolerances import REORDERINGS, farthest, order_bound

from hetcomm.balance import WeightedDistributedSampler
from hetcomm.loop import BalancedLoop
from hetcomm.shard import Shard, ShardedAdamW
from hetcomm.simulated import SimulatedSpeed, Slowdown

MEMORY = (11, 11, 11, 32)
ELEMENTS = 12 * 16 + 12 * 12 + 12 + 12 * 16 + 16   # TinyTagger's


def groups(model):
    return [{"params": [p for p in model.parameters() if p.dim() == 2], "weight_decay": 0.1},
            {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0, "lr": 0.02}]


def schedule(optimizer):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))


def train_sharded(rank, world, steps, options):
    model = TinyTagger()
    memory = [m * ELEMENTS * 13 // sum(MEMORY[:world]) * 12 for m in MEMORY[:world]]
    loop = BalancedLoop(model, MaskedTokens(), global_batch=GLOBAL_BATCH, seed=SEED, wire_dtype=torch.float32,
                        shard=Shard(memory=memory), **options)
    optimizer = ShardedAdamW(groups(model), loop.reducer, lr=0.05, betas=(0.9, 0.95))
    scheduler = schedule(optimizer)
    losses, splits = [], []
    for step in loop.steps(steps):
        for batch in step:
            loss, count = masked_loss(model, batch)
            step.backward(loss, count=count)
        result = step.reduce()
        if not result.skipped:
            optimizer.step(grad_scale=result.clip_coefficient(1.0))
        scheduler.step()
        losses.append(result.loss)
        splits.append([r.samples for r in result.ranks])
    return losses, [p.detach().clone() for p in model.parameters()], splits, optimizer.state_bytes()


def one_process(steps, order=None):
    """torch's AdamW on each step's whole global batch (its samples in order(indices), if
    given), clipped to norm 1."""
    model, data = TinyTagger(), MaskedTokens()
    optimizer = torch.optim.AdamW(groups(model), lr=0.05, betas=(0.9, 0.95), foreach=False)
    scheduler = schedule(optimizer)
    sampler = WeightedDistributedSampler(len(data), [GLOBAL_BATCH], 0, seed=SEED)
    batches = (indices for _ in range(steps) for indices in sampler)
    losses = []
    for _ in range(steps):
        indices = list(next(batches))
        batch = torch.utils.data.default_collate([data[i] for i in (order(indices) if order else indices)])
        optimizer.zero_grad()
        loss, _ = masked_loss(model, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()]


def assert_trains_as_one_process(ranks, steps):
    """Within order_bound of the one-process run: what it moves by when only the order of
    its sums changes (tests/tolerances.py)."""
    expected_losses, expected = one_process(steps)
    reordered = [one_process(steps, order) for order in REORDERINGS]
    loss_bound = order_bound([expected_losses], [[losses] for losses, _ in reordered])
    weight_bound = order_bound(expected, [weights for _, weights in reordered])
    for losses, weights, splits, _ in ranks:
        assert all(sum(s) == GLOBAL_BATCH for s in splits)
        assert farthest([losses], [expected_losses]) <= loss_bound, (losses, expected_losses, loss_bound)
        assert farthest(weights, expected) <= weight_bound, (farthest(weights, expected), weight_bound)


def test_uneven_batches_and_memory_train_as_one_process(tmp_path):
    ranks = values(run_ranks(4, train_sharded, 6, {"split": [1, 3, 5, 7], "memory_caps": [1, 2, 2, 3]},
                             tmp_path=tmp_path))
    assert_trains_as_one_process(ranks, 6)
    state = [r[3] for r in ranks]
    assert sum(state) == ELEMENTS * 8   # fp32 weights: the two moments of each element, once
    assert state[3] > 2.5 * state[0]


def train_throttled(rank, world, throttle_step):
    speed = SimulatedSpeed(rank, 0.05, (Slowdown(1, throttle_step, 0.1),))
    return train_sharded(rank, world, throttle_step + 3, {"simulated_speed": speed})


def test_a_throttled_rank_is_rebalanced_and_the_sharded_step_stays_exact(tmp_path):
    ranks = values(run_ranks(2, train_throttled, 6, tmp_path=tmp_path))
    splits = ranks[0][2]
    assert splits[-1][1] <= GLOBAL_BATCH // 8
    assert_trains_as_one_process(ranks, len(splits))


def refusals(rank, world, how):
    model = TinyTagger()
    options = {"shard": Shard(memory=[10**6] * world)}
    if how == "tiny rank":
        options = {"shard": Shard(memory=[10**6, 100, 10**6, 10**6])}
    elif how == "too little in all":
        options = {"shard": Shard(memory=[1000] * world)}
    elif how == "differs":
        options = {"shard": Shard(memory=[10**6 + rank] * world)}
    elif how == "ranges":
        options = {"shard": Shard(ranges=[100] * world)}
    elif how == "no memory on CPU":
        options = {"shard": Shard()}
    elif how == "masters":
        options["master_params"] = [p.detach().clone() for p in model.parameters()]
    try:
        BalancedLoop(model, MaskedTokens(), global_batch=GLOBAL_BATCH, wire_dtype=torch.float32, **options)
    except ValueError as error:
        return str(error)
    return "no error"


@pytest.mark.parametrize("how, message", [
    ("tiny rank", r"rank 1 has 100 bytes left for the sharded optimizer state; its smallest range \(16 elements\) "
                  r"needs 192 bytes"),
    # 1000 bytes hold 83 elements of 8 bytes of state and 4 of scratch each; 224 more elements need 1,792 bytes.
    ("too little in all", r"holds the state of 332 of the 556 trained elements; 8 bytes per element are needed, "
                          r"1,792 bytes more"),
    ("differs", r"shard.memory differs between ranks"),
    ("ranges", r"ranges = \[100, 100, 100, 100\]: expected .* adding up to the model's 556 trained elements"),
    ("no memory on CPU", r"shard.memory is needed on cpu ranks"),
    ("masters", r"pass no master_params"),
])
def test_bad_sharding_is_one_clear_error_on_every_rank(tmp_path, how, message):
    errors = values(run_ranks(4, refusals, how, tmp_path=tmp_path))
    for error in errors:
        assert error != "no error"
        assert __import__("re").search(message, error), error


def masters_from(rank, world):
    """A bf16 model's ShardedAdamW started from its fp32 weights, and what it says of
    initial_masters that do not fit."""
    torch.manual_seed(SEED)
    model = TinyTagger()
    fp32 = [p.detach().clone() for p in model.parameters()]
    model.to(torch.bfloat16)
    loop = BalancedLoop(model, MaskedTokens(), global_batch=GLOBAL_BATCH, seed=SEED, wire_dtype=torch.float32,
                        shard=Shard(memory=[10**6] * world))
    optimizer = ShardedAdamW(groups(model), loop.reducer, initial_masters=fp32)
    start, stop = optimizer.range
    exact = torch.equal(optimizer.masters, torch.cat([p.reshape(-1) for p in fp32])[start:stop])
    refusals = []
    for bad in (fp32[:-1], [p.half() for p in fp32]):
        try:
            ShardedAdamW(groups(model), loop.reducer, initial_masters=bad)
        except ValueError as error:
            refusals.append(str(error))
    return exact, refusals


def test_sharded_masters_start_from_the_fp32_weights(tmp_path):
    """As an unsharded optimizer's fp32 masters do: started from the 16-bit weights instead,
    a quarter of the bf16 weights of hetcomm train's tiny GPT differed from the unsharded
    run's after one step."""
    for exact, refusals in values(run_ranks(2, masters_from, tmp_path=tmp_path)):
        assert exact
        assert len(refusals) == 2 and all("initial_masters must be" in r and "fp32 tensors" in r for r in refusals)
