"""weighted_hook under DistributedDataParallel on 4 Gloo ranks with unequal batches.

As in test_reducer, each result is checked against sum_i w_i of the ranks' local
gradients (here as DDP hands them to the hook) in float64, within the reducer's count of
roundings."""

import pytest
import torch
from distributed import run_ranks, values
from test_reducer import FP16_FLOOR, FP16_RTOL, SCALED_WEIGHTS, assert_weighted_sum, of, worst
from tiny_model import COUNTS, LOSS_SCALE, TinyNet, error_of, local_backward
from tolerances import gamma
from torch.nn.parallel import DistributedDataParallel

import hetcomm

USED = ["embed.weight", "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias", "side.weight", "side.bias"]


def ddp_backward(ddp, rank, counts, scale=1.0):
    local_backward(ddp, rank, counts, scale)
    return {name: ddp.module.get_parameter(name).grad.clone() for name in USED}


def recording(ddp, local):
    """weighted_hook, keeping in `local` the gradients DDP hands it (name -> tensor)."""
    names = {id(p): name for name, p in ddp.module.named_parameters()}

    def hook(state, bucket):
        for p, g in zip(bucket.parameters(), bucket.gradients()):
            if names[id(p)] in USED:
                local[names[id(p)]] = g.clone()
        return hetcomm.weighted_hook(state, bucket)

    return hook


def hook_scenarios(rank, world, counts):
    n, total = counts[rank], sum(counts)
    out = {}

    # `never` takes no part in the loss, hence find_unused_parameters.
    ddp = DistributedDataParallel(TinyNet(), find_unused_parameters=True, bucket_cap_mb=0.0005)
    state = hetcomm.WeightedHookState(wire_dtype=torch.float32)
    local = {}
    ddp.register_comm_hook(state, recording(ddp, local))
    state.set_weight(n / total)
    out["fp32"] = (ddp_backward(ddp, rank, counts), state.found_inf.clone(), state.grad_norm().clone())
    out["local"] = dict(local)
    state.set_count(n)
    out["count"] = (ddp_backward(ddp, rank, counts), state.total)
    out["local_count"] = dict(local)

    ddp16 = DistributedDataParallel(TinyNet(), find_unused_parameters=True)
    state16 = hetcomm.WeightedHookState(wire_dtype=torch.float16, loss_scale=LOSS_SCALE)
    local16 = {}
    ddp16.register_comm_hook(state16, recording(ddp16, local16))
    state16.set_weight(n / total)
    out["fp16"] = (ddp_backward(ddp16, rank, counts, LOSS_SCALE), state16.found_inf.clone())
    out["local_scaled"] = dict(local16)
    out["nan"] = (ddp_backward(ddp16, rank, counts, float("nan") if rank == 2 else LOSS_SCALE),
                  state16.found_inf.item())
    state16.set_weight(0.2)
    out["bad_sum"] = error_of(lambda: ddp_backward(ddp16, rank, counts, LOSS_SCALE))

    # A loss scale unlike the others' on one rank: refused at the first bucket, everywhere.
    unlike = DistributedDataParallel(TinyNet(), find_unused_parameters=True)
    unlike_state = hetcomm.WeightedHookState(wire_dtype=torch.float16, loss_scale=LOSS_SCALE * (2 if rank == 3 else 1))
    unlike.register_comm_hook(unlike_state, hetcomm.weighted_hook)
    unlike_state.set_weight(n / total)
    out["unlike_scale"] = error_of(lambda: ddp_backward(unlike, rank, counts, LOSS_SCALE))

    equal = [6] * world
    plain = DistributedDataParallel(TinyNet(), find_unused_parameters=True)
    hooked = DistributedDataParallel(TinyNet(), find_unused_parameters=True)
    equal_state = hetcomm.WeightedHookState(wire_dtype=torch.float32)
    equal_local = {}
    hooked.register_comm_hook(equal_state, recording(hooked, equal_local))
    equal_state.set_weight(1 / world)
    out["equal"] = (ddp_backward(plain, rank, equal), ddp_backward(hooked, rank, equal))
    out["local_equal"] = equal_local
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return values(run_ranks(4, hook_scenarios, COUNTS, tmp_path=tmp_path_factory.mktemp("hook")))


def test_hook_fp32_wire_equals_union_gradient(ranks):
    for r in ranks:
        grads, found_inf, norm = r["fp32"]
        assert_weighted_sum(grads, of(ranks, "local"))
        assert found_inf.item() == 0
        assert norm.item() > 0
        torch.testing.assert_close(norm, ranks[0]["fp32"][2], rtol=0, atol=0)
    # DDP's plain average lands far outside.
    assert worst(ranks[0]["fp32"][0], of(ranks, "local"), [1 / len(COUNTS)] * len(COUNTS)) > 1000


def test_hook_count_mode(ranks):
    for r in ranks:
        grads, total = r["count"]
        assert total == sum(COUNTS)
        assert_weighted_sum(grads, of(ranks, "local_count"))


def test_hook_fp16_wire_within_its_rounding(ranks):
    for r in ranks:
        grads, found_inf = r["fp16"]
        assert_weighted_sum(grads, of(ranks, "local_scaled"), SCALED_WEIGHTS, FP16_RTOL, FP16_FLOOR)
        assert found_inf.item() == 0


def test_hook_nonfinite_on_one_rank_flags_all(ranks):
    assert [r["nan"][1] for r in ranks] == [1.0] * 4


def test_hook_bad_weights_fail_every_rank(ranks):
    for r in ranks:
        assert r["bad_sum"] is not None
        assert "the weights add up to 0.8 across 4 ranks; expected 1" in r["bad_sum"][1]
        assert "the ranks' loss scales differ (rank 0: 1024, rank 1: 1024, rank 2: 1024, rank 3: 2048)" \
            in r["unlike_scale"][1]


def test_equal_weights_reproduce_ddp_default_averaging(ranks):
    """Both sum the same four gradients / 4 (exact: a power of two) in fp32: DDP's within
    gamma(3) of their magnitudes, the hook's within the reducer's bound."""
    local, weights = of(ranks, "local_equal"), [1 / len(ranks)] * len(ranks)
    for r in ranks:
        plain, hooked = r["equal"]
        assert_weighted_sum(hooked, local, weights)
        assert_weighted_sum(plain, local, weights, gamma(len(ranks) - 1) + gamma(len(ranks) + 1, torch.float64))
