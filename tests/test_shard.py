"""Sharded optimizer state on 4 Gloo ranks with an uneven batch split (1/3/5/7 of 16)
and uneven memory (11/11/11/32): 20 steps equal the unsharded WeightedReducer with
hetcomm's fused AdamW on the same batches, each rank keeping only its range's state."""

import pytest
import torch
import torch.distributed as dist
from distributed import run_ranks, values
from tolerances import REORDERINGS, farthest, order_bound

import hetcomm
from hetcomm.optim import AdamW
from hetcomm.shard import FlatParameters, ShardedAdamW, ShardedReducer, layout_by_memory, layout_from_sizes
from hetcomm.shard.layout import ALIGN

SPLIT = (1, 3, 5, 7)
MEMORY = (11, 11, 11, 32)   # GB-like units: scaled to bytes per test
STEPS = 20
MAX_NORM = 0.5
INF_STEP = 7                 # rank 2 injects an inf into its gradient at this step


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(12, 40), torch.nn.Tanh(), torch.nn.Linear(40, 40),
                                        torch.nn.Tanh(), torch.nn.LayerNorm(40), torch.nn.Linear(40, 3))

    def forward(self, x):
        return self.body(x)


def groups(model):
    """Two groups: weight decay on matrices only, another learning rate on the rest."""
    decay = [p for p in model.parameters() if p.dim() == 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0, "lr": 2e-3}]


def batch(step, rank, order=None):
    """This rank's samples of the step: its slice of 16 samples by SPLIT (in order(indices),
    if given)."""
    g = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(16, 12, generator=g), torch.randint(0, 3, (16,), generator=g)
    lo = sum(SPLIT[:rank])
    mine = list(range(lo, lo + SPLIT[rank]))
    mine = order(mine) if order is not None else mine
    return x[mine], y[mine]


def backward(model, step, rank, loss_scale, dtype, order=None):
    x, y = batch(step, rank, order)
    loss = torch.nn.functional.cross_entropy(model(x.to(dtype)).float(), y)
    (loss * loss_scale).backward()
    if step == INF_STEP and rank == 2:
        next(model.parameters()).grad.view(-1)[3] = float("inf")


def train_sharded(rank, dtype, wire, loss_scale, overlap):
    """STEPS of ShardedReducer and ShardedAdamW."""
    torch.manual_seed(0)
    sharded = Net().to(dtype)
    flat = FlatParameters([p for p in sharded.parameters()], "test")
    per_unit = flat.total * 16 // sum(MEMORY)   # memory that holds the state a little more than once
    layout = layout_by_memory([m * per_unit for m in MEMORY], flat.total, dtype, 256, "test")
    reducer = ShardedReducer(flat, layout, wire_dtype=wire, bucket_cap_mb=256 * dtype.itemsize / 2**20,
                             overlap=overlap)
    opt = ShardedAdamW(groups(sharded), reducer, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0)
    initial = [p.detach().float().clone() for p in sharded.parameters()]
    skipped = []
    for step in range(STEPS):
        flat.zero_grads()
        if overlap:
            reducer.begin(count=SPLIT[rank])
        backward(sharded, step, rank, loss_scale, dtype)
        result = reducer.finish() if overlap else reducer.reduce(count=SPLIT[rank], loss_scale=loss_scale)
        skipped.append(result.found_inf.item())
        if not result.found_inf.item():
            opt.step(grad_scale=(MAX_NORM / (result.grad_norm + 1e-6)).clamp(max=1.0))
    return {"sharded": [p.detach().float().clone() for p in sharded.parameters()], "initial": initial,
            "norm": result.grad_norm.item(), "skipped": skipped, "range": reducer.range, "sizes": layout.sizes(),
            "total": flat.total, "state_bytes": opt.state_bytes(), "exp_avg": opt.exp_avg.clone(),
            "scratch_bytes": reducer._scratch.numel() * 4, "buckets": len(reducer.buckets)}


def train_plain(rank, dtype, wire, loss_scale, order=None, equal=False):
    """The same STEPS unsharded: WeightedReducer and hetcomm's fused AdamW (on fp32
    masters for a 16-bit model), each rank's samples in order(indices) if given; with
    equal, every rank weighted alike (DDP's plain average)."""
    torch.manual_seed(0)
    plain = Net().to(dtype)
    masters = None if dtype == torch.float32 else [p.detach().float().clone() for p in plain.parameters()]
    plain_reducer = hetcomm.WeightedReducer(plain.parameters(), wire_dtype=wire, bucket_cap_mb=0.001,
                                            master_params=masters)
    params = list(plain.parameters())
    trained = masters if masters is not None else params
    plain_groups = [{"params": [t for t, p in zip(trained, params) if p.dim() == 2], "weight_decay": 0.1},
                    {"params": [t for t, p in zip(trained, params) if p.dim() < 2], "weight_decay": 0.0, "lr": 2e-3}]
    copies = None if masters is None else [p for p in params if p.dim() == 2] + [p for p in params if p.dim() < 2]
    plain_opt = AdamW(plain_groups, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0, copies=copies)
    skipped = []
    for step in range(STEPS):
        plain.zero_grad(set_to_none=True)
        backward(plain, step, rank, loss_scale, dtype, order)
        plain_result = plain_reducer.reduce(count=1 if equal else SPLIT[rank], loss_scale=loss_scale)
        skipped.append(plain_result.found_inf.item())
        if not plain_result.found_inf.item():
            plain_opt.step(grad_scale=(MAX_NORM / (plain_result.grad_norm + 1e-6)).clamp(max=1.0).reshape(1))
    return [p.detach().float().clone() for p in plain.parameters()], plain_result.grad_norm.item(), skipped


def train_both(rank, world, dtype, wire, loss_scale, overlap):
    """The sharded run and the unsharded one on the same batches, and the unsharded one
    with each rank's samples in the orders of REORDERINGS: the same sums in other orders,
    which is what sets how far the sharded run may land from the unsharded one
    (tolerances.order_bound)."""
    out = train_sharded(rank, dtype, wire, loss_scale, overlap)
    out["plain"], plain_norm, plain_skipped = train_plain(rank, dtype, wire, loss_scale)
    out["norms"] = (out.pop("norm"), plain_norm)
    out["skipped"] = list(zip(out["skipped"], plain_skipped))
    out["reordered"] = [train_plain(rank, dtype, wire, loss_scale, order) for order in REORDERINGS]
    return out


def scenarios(rank, world):
    out = {"fp32": train_both(rank, world, torch.float32, torch.float32, 1.0, False),
           "fp16": train_both(rank, world, torch.float16, torch.float16, 2.0**10, True)}
    out["fp32"]["equal"] = train_plain(rank, torch.float32, torch.float32, 1.0, equal=True)[0]
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return values(run_ranks(4, scenarios, tmp_path=tmp_path_factory.mktemp("shard")))


def bounds(run):
    """How far the sharded run's weights and last gradient norm may land from the
    unsharded run's: order_bound of the unsharded run reordered."""
    return (order_bound(run["plain"], [weights for weights, _, _ in run["reordered"]]),
            order_bound([run["norms"][1]], [[norm] for _, norm, _ in run["reordered"]]))


def test_fp32_wire_equals_the_unsharded_reducer_and_fused_adamw(ranks):
    for rank, out in enumerate(ranks):
        run = out["fp32"]
        assert [s for s, _ in run["skipped"]] == [float(k == INF_STEP) for k in range(STEPS)]
        assert run["skipped"] == [(p, p) for _, p in run["skipped"]]
        weight_bound, norm_bound = bounds(run)
        assert farthest(run["sharded"], run["plain"]) <= weight_bound
        assert abs(run["norms"][0] - run["norms"][1]) <= norm_bound
        # The weights moved, far more than the bound: not two untouched models; and DDP's
        # plain average of the ranks' means lands far outside it.
        assert min((a - b).abs().max().item() for a, b in zip(run["sharded"], run["initial"])) > 50 * weight_bound
        assert farthest(run["sharded"], run["equal"]) > 5 * weight_bound


def test_fp16_wire_with_loss_scale_skips_alike_and_stays_close(ranks):
    for out in ranks:
        run = out["fp16"]
        assert run["skipped"] == [(float(k == INF_STEP),) * 2 for k in range(STEPS)]
        assert farthest(run["sharded"], run["plain"]) <= bounds(run)[0]


def test_every_rank_holds_the_same_weights(ranks):
    for key in ("fp32", "fp16"):
        for out in ranks[1:]:
            for a, b in zip(out[key]["sharded"], ranks[0][key]["sharded"]):
                assert torch.equal(a, b)


def test_each_rank_keeps_only_its_range_of_state(ranks):
    for key, per_element in (("fp32", 8), ("fp16", 12)):
        runs = [out[key] for out in ranks]
        total = runs[0]["total"]
        bounds = [r["range"] for r in runs]
        assert [b[0] for b in bounds[1:]] == [b[1] for b in bounds[:-1]] and bounds[0][0] == 0 \
            and bounds[-1][1] == total
        for run in runs:
            size = run["range"][1] - run["range"][0]
            assert run["state_bytes"] == size * per_element
            assert run["scratch_bytes"] <= 256 * 4
        assert sum(r["state_bytes"] for r in runs) == total * per_element
        # Ranges follow the memory left once each rank's one-bucket scratch is paid, each
        # within ALIGN elements of its share (floored to ALIGN, the rest dealt ALIGN at a time).
        per_unit = total * 16 // sum(MEMORY)
        room = [(m * per_unit - 256 * 4) / per_element for m in MEMORY]
        for size, free in zip(runs[0]["sizes"], room):
            assert size / total == pytest.approx(free / sum(room), abs=ALIGN / total)


def test_layout_follows_memory_and_refuses_what_cannot_fit():
    layout = layout_by_memory([11 * 2**30, 11 * 2**30, 11 * 2**30, 32 * 2**30], 1_000_000, torch.float16, 2**20,
                              "t")
    assert layout.total == 1_000_000 and layout.sizes()[3] > 2.8 * layout.sizes()[0]
    with pytest.raises(ValueError, match=r"rank 2 has 100 bytes left .* needs 256 bytes"):
        layout_by_memory([2**30, 2**30, 100, 2**30], 1_000_000, torch.float16, 2**20, "t")
    with pytest.raises(ValueError, match=r"holds the state of .* of the 1,000,000 trained elements; 12 bytes per"):
        layout_by_memory([2**20] * 4, 1_000_000, torch.float16, 2**10, "t")
    with pytest.raises(ValueError, match=r"ranges = \[10, 10\].*adding up to the model's 30"):
        layout_from_sizes([10, 10], 30, "t")


def test_flat_parameters_keep_views_through_backward_and_zero_grad():
    model = Net()
    flat = FlatParameters(list(model.parameters()), "t")
    model(torch.randn(4, 12)).sum().backward()
    first = flat.grads.clone()
    assert first.abs().sum() > 0
    model.zero_grad(set_to_none=True)   # a user's zero_grad drops the views ...
    model(torch.randn(4, 12)).sum().backward()
    flat.attach_grads()                 # ... which come back with the new values in the buffer
    assert torch.equal(torch.cat([p.grad.reshape(-1) for p in model.parameters()]), flat.grads)
    with pytest.raises(ValueError, match="trained parameter 1 is torch.float16"):
        FlatParameters([torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2, dtype=torch.float16))],
                       "t")


def mismatched(rank, world):
    torch.manual_seed(0)
    model = Net() if rank != 1 else torch.nn.Linear(12, 3)
    flat = FlatParameters(list(model.parameters()), "t")
    layout = layout_from_sizes([flat.total // 4] * 3 + [flat.total - 3 * (flat.total // 4)], flat.total, "t")
    try:
        reducer = ShardedReducer(flat, layout, wire_dtype=torch.float32)
        reducer.reduce(count=1)
    except Exception as error:
        return type(error).__name__, str(error)
    finally:
        dist.barrier()


def test_a_parameter_list_that_differs_between_ranks_fails_on_every_rank(tmp_path):
    outcomes = values(run_ranks(4, mismatched, tmp_path=tmp_path))
    assert all(kind == "LayoutMismatch" for kind, _ in outcomes), outcomes
