"""WeightedReducer on 4 Gloo ranks with unequal batches: the reduced gradient is the
gradient of the mean loss over the union of all samples; overflows, bad weights,
mismatched layouts and missing ranks give the same answer or error on every rank.

The union's gradient is sum_i (n_i / N) g_i, g_i the mean loss's gradient over rank i's
n_i samples. Each reduced gradient is checked against that sum of the ranks' own local
gradients in float64, element by element, within the reducer's count of roundings
(tolerances.reduction_rtol); the local gradients' own fp32 rounding, torch's, is no
part of what the reducer may add."""

import functools
import math
import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from distributed import run_ranks, values
from tiny_model import COUNTS, LOSS_SCALE, TinyNet, error_of, local_backward
from tolerances import (UNIT_ROUNDOFF, apart, reduction_floor, reduction_rtol, sq_norm_rtol, sqrt_rtol, sum_rtol,
                        weighted_excess)

import hetcomm

def grads_of(model):
    return {name: (None if p.grad is None else p.grad.clone()) for name, p in model.named_parameters()}


def scenarios(rank, world, counts):
    n, total = counts[rank], sum(counts)
    out = {}
    model = TinyNet()

    reducer = hetcomm.WeightedReducer(model.parameters(), wire_dtype=torch.float32, bucket_cap_mb=0.0005)
    out["buckets"] = len(reducer.buckets)
    local_backward(model, rank, counts)
    out["local"] = grads_of(model)
    result = reducer.reduce(weight=n / total)
    out["fp32"] = (grads_of(model), result.found_inf.clone(), result.grad_norm.clone())

    local_backward(model, rank, counts)
    out["local_count"] = grads_of(model)
    total_from_counts = reducer.reduce(count=n).total
    out["count"] = (grads_of(model), total_from_counts)

    # Gradients of the loss summed over the rank's n samples and divided by 5, not by n.
    local_backward(model, rank, counts, scale=n / 5.0)
    out["local_summed"] = grads_of(model)
    reducer.reduce(count=n, grad_divisor=5.0)
    out["count_divisor"] = grads_of(model)
    out["divisor_errors"] = [error_of(lambda: reducer.reduce(weight=n / total, grad_divisor=5.0)),
                             error_of(lambda: reducer.reduce(count=n, grad_divisor=0.0))]

    # One rank set up unlike the others: the same error on every rank before any bucket
    # is sent (a bucket of another size or dtype would fail the all-reduce on one rank
    # and hang the others), and the group stays usable.
    local_backward(model, rank, counts)
    before = grads_of(model)
    out["unlike_settings"] = []
    for setting, value in (("wire_dtype", torch.float32), ("overlap", True), ("bucket_cap_mb", 0.0005)):
        unlike = hetcomm.WeightedReducer(model.parameters(), **({setting: value} if rank == 1 else {}))
        start = unlike.begin if rank == 1 and setting == "overlap" else unlike.reduce
        out["unlike_settings"].append(error_of(lambda: start(weight=n / total)))
    # Another loss scale on one rank would unscale its copy of the sum wrongly, silently.
    scale = LOSS_SCALE * (2 if rank == 3 else 1)
    out["unlike_loss_scale"] = error_of(lambda: reducer.reduce(weight=n / total, loss_scale=scale))
    out["unlike_left_gradients_alone"] = all(torch.equal(g, before[k]) for k, g in grads_of(model).items()
                                             if g is not None)

    reducer16 = hetcomm.WeightedReducer(model.parameters(), wire_dtype=torch.float16)
    local_backward(model, rank, counts, scale=LOSS_SCALE)
    out["local_scaled"] = grads_of(model)
    result = reducer16.reduce(weight=n / total, loss_scale=LOSS_SCALE)
    out["fp16"] = (grads_of(model), result.found_inf.clone(), result.grad_norm.clone())

    local_backward(model, rank, counts, scale=LOSS_SCALE)
    if rank == 2:
        model.fc1.weight.grad[3, 3] = float("nan")
    out["nan_found_inf"] = reducer16.reduce(weight=n / total, loss_scale=LOSS_SCALE).found_inf.item()

    local_backward(model, rank, counts, scale=LOSS_SCALE)
    if rank == 1:
        model.fc2.bias.grad[0] = 1e6  # finite in fp32, overflows the fp16 wire
    out["overflow_found_inf"] = reducer16.reduce(weight=n / total, loss_scale=LOSS_SCALE).found_inf.item()

    # A 16-bit model with fp32 masters: the reduced gradient lands in the masters' grads.
    half = TinyNet().half()
    masters = [p.detach().float() for p in half.parameters()]
    to_masters = hetcomm.WeightedReducer(half.parameters(), wire_dtype=torch.float16, master_params=masters)
    local_backward(half, rank, counts, scale=LOSS_SCALE, use_side=(rank == 0))
    local = grads_of(half)
    to_masters.reduce(weight=n / total, loss_scale=LOSS_SCALE)
    names = [name for name, _ in half.named_parameters()]
    out["masters"] = (local, grads_of(half), {name: None if m.grad is None else m.grad.clone()
                                                for name, m in zip(names, masters)})
    out["bad_masters"] = [error_of(lambda bad=bad: hetcomm.WeightedReducer(half.parameters(), master_params=bad))
                          for bad in (masters[:-1], [m.t() if m.dim() == 2 else m for m in masters],
                                      masters[:2] + [None] + masters[3:])]

    # `side` is used only on rank 0; `never` nowhere.
    local_backward(model, rank, counts, use_side=(rank == 0))
    out["local_partly_used"] = grads_of(model)
    reducer.reduce(weight=n / total)
    out["partly_used"] = grads_of(model)

    # Without `never`: a parameter that gets no gradient holds its bucket until finish().
    used_params = [p for name, p in model.named_parameters() if not name.startswith("never")]
    overlapped = hetcomm.WeightedReducer(used_params, wire_dtype=torch.float32, bucket_cap_mb=0.0005, overlap=True)
    model.zero_grad(set_to_none=True)
    overlapped.begin(weight=n / total)
    local_backward(model, rank, counts)
    out["launched_during_backward"], out["overlap_buckets"] = len(overlapped._step.works), len(overlapped.buckets)
    out["local_overlap"] = grads_of(model)   # sent, not yet unpacked into
    result = overlapped.finish()
    out["overlap"] = (grads_of(model), result.grad_norm.clone())

    # Accumulation: the first micro-batch's backward happens before begin() and is not sent.
    local_backward(model, rank, counts, scale=0.5)
    overlapped.begin(weight=n / total)
    local_backward(model, rank, counts, scale=0.5, zero=False)
    out["local_accumulated"] = grads_of(model)
    overlapped.finish()
    out["overlap_accumulated"] = grads_of(model)
    # Not armed by begin(), the hooks leave the buckets alone: reduce() sends them all.
    local_backward(model, rank, counts)
    out["local_without_begin"] = grads_of(model)
    overlapped.reduce(weight=n / total)
    out["reduce_with_overlap"] = grads_of(model)
    overlapped.remove_hooks()

    # With overlap the unused parameters are agreed on in finish(): `never` stays None.
    holding = hetcomm.WeightedReducer(model.parameters(), wire_dtype=torch.float32, overlap=True)
    model.zero_grad(set_to_none=True)
    holding.begin(weight=n / total)
    local_backward(model, rank, counts, use_side=(rank == 0))
    out["local_overlap_partly_used"] = grads_of(model)
    holding.finish()
    holding.remove_hooks()
    out["overlap_partly_used"] = grads_of(model)

    # Numbers gathered along with the weights: every rank gets every rank's, as sent.
    gathering = hetcomm.WeightedReducer(model.parameters(), wire_dtype=torch.float32, bucket_cap_mb=0.0005,
                                        gather_size=3)
    mine = [rank + 0.1, -1.0 / (rank + 3), float("nan") if rank == 1 else 1e300]
    local_backward(model, rank, counts)
    by_weight = gathering.reduce(weight=n / total, gather=mine)
    out["gathered"] = (grads_of(model), by_weight.gathered)
    local_backward(model, rank, counts)
    out["gathered_by_count"] = gathering.reduce(count=n, gather=mine).gathered

    # Bookkeeping while the buckets travel: it sees the gathered rows, may run a collective
    # of its own, and changes nothing about the result; should it raise, nothing is unpacked.
    def while_in_flight(rows):
        decided = torch.tensor([len(rows) * 10 if rank == 0 else 0])
        dist.broadcast(decided, src=0)
        seen.append((rows, decided.item()))

    for mode in ("weight", "count"):
        seen = []
        local_backward(model, rank, counts)
        by = {"weight": n / total} if mode == "weight" else {"count": n}
        result = gathering.reduce(**by, gather=mine, while_in_flight=while_in_flight)
        out[f"in_flight_{mode}"] = (grads_of(model), result.gathered, seen)

    def failing(rows):
        raise RuntimeError(f"bookkeeping failed on rank {rank}")

    local_backward(model, rank, counts, use_side=False)
    local = grads_of(model)
    for mode in ("weight", "count"):
        by = {"weight": n / total} if mode == "weight" else {"count": n}
        error = error_of(functools.partial(gathering.reduce, **by, gather=mine, while_in_flight=failing))
        out[f"in_flight_raises_{mode}"] = (error, grads_of(model), local)
    out["local_in_flight_then"] = grads_of(model)
    gathering.reduce(weight=n / total, gather=mine)   # the group is still in step
    out["in_flight_then"] = grads_of(model)

    local_backward(model, rank, counts)
    out["gather_short"] = error_of(lambda: gathering.reduce(weight=n / total, gather=mine[:2] if rank == 2 else mine))
    out["gather_not_a_number"] = error_of(lambda: gathering.reduce(
        weight=n / total, gather=[mine[0], "x", 0.0] if rank == 1 else mine))
    out["gather_missing"] = error_of(lambda: gathering.reduce(weight=n / total))
    out["gather_size_differs"] = error_of(lambda: hetcomm.WeightedReducer(
        model.parameters(), gather_size=rank % 2).reduce(weight=n / total, gather=[1.0] * (rank % 2)))
    out["gather_size_bad"] = error_of(lambda: hetcomm.WeightedReducer(model.parameters(), gather_size=-1))

    local_backward(model, rank, counts)
    out["bad_sum"] = error_of(lambda: reducer.reduce(weight=0.3))
    out["negative"] = error_of(lambda: reducer.reduce(weight=-1.0 if rank == 1 else n / total))
    out["mixed"] = error_of(lambda: reducer.reduce(weight=n / total) if rank == 0 else reducer.reduce(count=n))
    out["grads_after_errors"] = grads_of(model)
    out["layout"] = error_of(lambda: hetcomm.WeightedReducer(TinyNet(extra_layer=(rank == 3)).parameters()).reduce(
        weight=1 / world))
    out["bf16_on_gloo"] = error_of(lambda: hetcomm.WeightedReducer(model.parameters(), wire_dtype=torch.bfloat16))
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return values(run_ranks(4, scenarios, COUNTS, tmp_path=tmp_path_factory.mktemp("reducer")))


WEIGHTS = [n / sum(COUNTS) for n in COUNTS]
FP32_RTOL = reduction_rtol(len(COUNTS), torch.float32)
# The fp16 wire under LOSS_SCALE: unpack_'s scale 1 / LOSS_SCALE is a rounding more (none
# for a power of two, counted all the same); the local gradients carry LOSS_SCALE.
FP16_RTOL = reduction_rtol(len(COUNTS), torch.float16, scale_roundings=1)
FP16_FLOOR = reduction_floor(len(COUNTS), torch.float16, 1 / LOSS_SCALE, FP16_RTOL)
SCALED_WEIGHTS = [w / LOSS_SCALE for w in WEIGHTS]


def worst(grads, local, weights=WEIGHTS, rtol=FP32_RTOL, floor=0.0):
    """How far `grads` lands from sum_i w_i local[i] (local: the ranks' local gradients),
    in units of the reducer's bound (<= 1: within it): the worst element of every
    parameter that has a gradient on some rank."""
    return max(weighted_excess(grads[name], [g[name] for g in local], weights, rtol, floor)
               for name in local[0] if any(g[name] is not None for g in local))


def assert_weighted_sum(grads, local, weights=WEIGHTS, rtol=FP32_RTOL, floor=0.0):
    assert worst(grads, local, weights, rtol, floor) <= 1


def of(ranks, key):
    return [r[key] for r in ranks]


def assert_norm_of(norm, grads, buckets):
    """grad_norm against the float64 norm of the reduced gradients themselves: sq_norm's
    float64 sums of exact squares, rounded to fp32 and added up in fp32 once per bucket,
    then an fp32 root."""
    values = [g for g in grads.values() if g is not None]
    n = sum(g.numel() for g in values)
    exact = torch.sqrt(sum((g.double() ** 2).sum() for g in values))
    rtol = apart(sqrt_rtol(sq_norm_rtol(n, additions=buckets)), sum_rtol(n, torch.float64) + UNIT_ROUNDOFF[
        torch.float64])
    torch.testing.assert_close(norm.double(), exact, rtol=rtol, atol=0)   # 0-dim, as torch's clip takes it


def test_fp32_wire_equals_union_gradient(ranks):
    assert ranks[0]["buckets"] >= 3  # a tiny cap: several all-reduces in flight
    for r in ranks:
        grads, found_inf, norm = r["fp32"]
        assert_weighted_sum(grads, of(ranks, "local"))
        assert found_inf.item() == 0
        assert_norm_of(norm, grads, r["buckets"])
    # Identical on every rank, bit for bit.
    for r in ranks[1:]:
        assert all(torch.equal(r["fp32"][0][k], ranks[0]["fp32"][0][k]) for k, g in ranks[0]["fp32"][0].items()
                   if g is not None)
        assert torch.equal(r["fp32"][2], ranks[0]["fp32"][2])
    # The bound separates wrong weightings: DDP's plain average, one sample more on the
    # last rank, and the last rank's weight 1e-5 off (about a hundred fp32 ulps; measured:
    # honest results land within 0.5 of the bound, these 3e6, 1e5 and 28 times it).
    grads, local, total = ranks[0]["fp32"][0], of(ranks, "local"), sum(COUNTS)
    assert worst(grads, local, [1 / len(COUNTS)] * len(COUNTS)) > 1000
    assert worst(grads, local, [n / (total + 1) for n in COUNTS[:-1]] + [(COUNTS[-1] + 1) / (total + 1)]) > 100
    assert worst(grads, local, WEIGHTS[:-1] + [WEIGHTS[-1] * (1 + 1e-5)]) > 10


def test_count_mode_matches_weight_mode(ranks):
    for r in ranks:
        grads, total = r["count"]
        assert total == sum(COUNTS)
        assert_weighted_sum(grads, of(ranks, "local_count"))


def test_count_mode_with_a_gradient_divisor_of_its_own(ranks):
    for r in ranks:
        # The local gradients hold the loss summed over the rank's samples / 5: weights 5 / N.
        assert_weighted_sum(r["count_divisor"], of(ranks, "local_summed"), [5.0 / sum(COUNTS)] * len(COUNTS))
        assert [message for _, message in r["divisor_errors"]] == [
            "hetcomm.WeightedReducer: grad_divisor goes with count=, not weight=",
            "hetcomm.WeightedReducer: grad_divisor = 0.0: expected a finite positive number"]


def test_fp16_wire_within_its_rounding(ranks):
    for r in ranks:
        grads, found_inf, _ = r["fp16"]
        assert_weighted_sum(grads, of(ranks, "local_scaled"), SCALED_WEIGHTS, FP16_RTOL, FP16_FLOOR)
        assert found_inf.item() == 0
    # The last rank's weight 1% off lands outside (5 times the bound, measured); the
    # bound is about four fp16 roundings.
    wrong = SCALED_WEIGHTS[:-1] + [SCALED_WEIGHTS[-1] * 1.01]
    assert worst(ranks[0]["fp16"][0], of(ranks, "local_scaled"), wrong, FP16_RTOL, FP16_FLOOR) > 2


def test_nonfinite_and_wire_overflow_flag_every_rank(ranks):
    assert [r["nan_found_inf"] for r in ranks] == [1.0] * 4
    assert [r["overflow_found_inf"] for r in ranks] == [1.0] * 4


def test_parameters_without_gradients(ranks):
    """`side` has a gradient on rank 0 only: every rank gets rank 0's weighted share;
    `never` has none anywhere and keeps grad None, as under DDP."""
    for r in ranks:
        grads = r["partly_used"]
        assert grads["never.weight"] is None and grads["never.bias"] is None
        assert grads["side.weight"] is not None and grads["side.weight"].abs().sum() > 0
        assert all(g["side.weight"] is None for g in of(ranks, "local_partly_used")[1:])
        assert_weighted_sum(grads, of(ranks, "local_partly_used"))
    for r in ranks[1:]:
        assert torch.equal(r["partly_used"]["side.weight"], ranks[0]["partly_used"]["side.weight"])


def test_sixteen_bit_model_reduced_into_fp32_masters(ranks):
    """The masters' grads hold sum_i w_i g_i / loss scale of the ranks' fp16 gradients
    (`side` has one on rank 0 only), within the fp16 wire's rounding; the fp16 gradients
    stay as backward left them; `never`, used nowhere, keeps grad None in the masters too."""
    local = [r["masters"][0] for r in ranks]
    for r in ranks:
        _, after, master_grads = r["masters"]
        assert master_grads["never.weight"] is None and master_grads["never.bias"] is None
        assert all(g.dtype == torch.float32 for g in master_grads.values() if g is not None)
        assert_weighted_sum(master_grads, local, SCALED_WEIGHTS, FP16_RTOL, FP16_FLOOR)
        assert all(torch.equal(after[k], r["masters"][0][k]) for k, g in r["masters"][0].items() if g is not None)
    for r in ranks[1:]:
        assert all(torch.equal(r["masters"][2][k], ranks[0]["masters"][2][k]) for k, g in local[0].items()
                   if g is not None)


def test_bad_master_params_name_the_argument(ranks):
    count, shape, not_a_tensor = ranks[0]["bad_masters"]
    assert count == ("ValueError", "hetcomm.WeightedReducer: master_params holds 8 tensors for 9 parameters that "
                                   "require grad; expected one per parameter, in the same order")
    assert "master_params[0] is (8, 16) torch.float32 on cpu; expected a contiguous float tensor of its " \
           "parameter's shape (16, 8)" in shape[1]
    assert "master_params[2] is NoneType" in not_a_tensor[1]


def test_bad_weights_raise_the_same_error_on_every_rank(ranks):
    for key, pattern in [("bad_sum", "the weights add up to 1.2 across 4 ranks; expected 1"),
                         ("negative", "ranks [1] passed an invalid weight, count or gather"),
                         ("mixed", "3 of 4 ranks passed count= and the others weight=")]:
        for r in ranks:
            kind, message = r[key]
            assert kind == "ValueError" and pattern in message, (key, message)
    assert "here: weight=-1.0 is negative" in ranks[1]["negative"][1]


def test_settings_unlike_on_one_rank_raise_the_same_error_on_every_rank(ranks):
    for r in ranks:
        messages = [message for _, message in r["unlike_settings"]]
        assert [kind for kind, _ in r["unlike_settings"]] == ["LayoutMismatch"] * 3
        assert "the ranks' wire_dtype differs" in messages[0]
        assert "the ranks' overlap differs" in messages[1]
        assert "the ranks' bucket layout (bucket_cap_mb) differs" in messages[2]
        kind, message = r["unlike_loss_scale"]
        assert kind == "ValueError" and "the ranks' loss scales differ (rank 0: 1024, rank 1: 1024, rank 2: 1024, " \
            "rank 3: 2048)" in message
        assert r["unlike_left_gradients_alone"]
    # The group stayed usable: the reductions after these match the reference (other tests).


def test_gathered_values_reach_every_rank_as_sent(ranks):
    sent = [[r + 0.1, -1.0 / (r + 3), float("nan") if r == 1 else 1e300] for r in range(len(ranks))]
    for r in ranks:
        grads, gathered = r["gathered"]
        for got in (gathered, r["gathered_by_count"]):
            assert len(got) == len(sent)
            for row, expected in zip(got, sent):
                assert row[0] == expected[0] and row[1] == expected[1]   # exact: one value plus zeros
                assert (math.isnan(row[2]) and math.isnan(expected[2])) or row[2] == expected[2]
        # Gathering changes nothing about the gradients.
        assert all(g is None and grads[k] is None or torch.equal(grads[k], g) for k, g in r["fp32"][0].items())


def test_work_while_in_flight_sees_the_gathered_rows_and_changes_nothing(ranks):
    for r in ranks:
        for mode in ("weight", "count"):
            grads, gathered, seen = r[f"in_flight_{mode}"]
            assert seen == [(gathered, 10 * len(ranks))]   # called once, with the rows; its broadcast went through
            assert all(torch.equal(grads[k], g) for k, g in r["gathered"][0].items() if g is not None), mode


def test_work_while_in_flight_that_raises_leaves_gradients_alone(ranks):
    for rank, r in enumerate(ranks):
        for mode in ("weight", "count"):
            error, after, before = r[f"in_flight_raises_{mode}"]
            assert error == ("RuntimeError", f"bookkeeping failed on rank {rank}"), mode
            assert after.keys() == before.keys()
            for name, g in before.items():   # not unpacked into; None given back where it was None
                assert (g is None and after[name] is None) or torch.equal(after[name], g), (mode, name)
        # The group stayed in step: the same local gradients then reduce to the union's.
        assert_weighted_sum(r["in_flight_then"], of(ranks, "local_in_flight_then"))
        assert r["in_flight_then"]["side.weight"] is None


def test_bad_gather_refused_on_every_rank(ranks):
    for r in ranks:
        assert r["gather_short"][0] == "ValueError" and "ranks [2] passed an invalid weight, count or gather" \
            in r["gather_short"][1]
        assert r["gather_not_a_number"][0] == "ValueError" and "ranks [1]" in r["gather_not_a_number"][1]
        assert "ranks [0, 1, 2, 3]" in r["gather_missing"][1] and "gather_size=3" in r["gather_missing"][1]
        kind, message = r["gather_size_differs"]
        assert kind == "LayoutMismatch" and "gather_size differs (between 0 and 1" in message
        assert r["gather_size_bad"] == ("ValueError", "hetcomm.WeightedReducer: gather_size must be a "
                                                      "non-negative integer; got -1")
    assert "here: gather holds 2 values; expected gather_size=3" in ranks[2]["gather_short"][1]
    assert "here: gather[1] = 'x' is not a number" in ranks[1]["gather_not_a_number"][1]


def test_refused_reduce_leaves_gradients_alone(ranks):
    for r in ranks:
        local = r["grads_after_errors"]
        assert local["never.weight"] is None  # the buckets went out with zeros for it; None is given back
        assert local["fc1.weight"] is not None
        assert not torch.equal(local["fc1.weight"], r["fp32"][0]["fc1.weight"])  # still the local gradient


def test_mismatched_layouts_fail_on_every_rank(ranks):
    for r in ranks:
        kind, message = r["layout"]
        assert kind == "LayoutMismatch" and "between 9 and 11 parameters" in message


def test_overlap_launches_during_backward_and_gives_the_same_result(ranks):
    for r in ranks:
        assert r["launched_during_backward"] >= 1
        grads, norm = r["overlap"]
        # Other buckets, so Gloo may add the ranks' values in another order: not bit-exact.
        assert_weighted_sum(grads, of(ranks, "local_overlap"))
        assert_norm_of(norm, grads, r["overlap_buckets"])


def test_overlap_with_gradient_accumulation(ranks):
    """Two half-weighted micro-batches accumulate to the full gradient before the send."""
    for r in ranks:
        assert_weighted_sum(r["overlap_accumulated"], of(ranks, "local_accumulated"))


def test_overlap_keeps_parameters_without_gradients_anywhere_none(ranks):
    for r in ranks:
        grads = r["overlap_partly_used"]
        assert grads["never.weight"] is None and grads["never.bias"] is None
        assert_weighted_sum(grads, of(ranks, "local_overlap_partly_used"))


def test_overlap_without_begin_reduces_after_backward(ranks):
    for r in ranks:
        assert_weighted_sum(r["reduce_with_overlap"], of(ranks, "local_without_begin"))


def test_bf16_wire_refused_on_gloo(ranks):
    kind, message = ranks[0]["bf16_on_gloo"]
    assert kind == "ValueError" and "Gloo backend cannot all-reduce bfloat16" in message


def absent_rank(rank, world, gave_up):
    """Rank 1 never calls reduce: it stays away until rank 0 is done (the file gave_up
    exists), 8 s at most; rank 0 must give up with a clear error."""
    model = TinyNet()
    if rank == 1:
        deadline = time.monotonic() + 8
        while not os.path.exists(gave_up) and time.monotonic() < deadline:
            time.sleep(0.05)
        return "absent"
    reducer = hetcomm.WeightedReducer(model.parameters(), timeout=timedelta(seconds=2))
    local_backward(model, rank, [2, 2])
    start = time.monotonic()
    try:
        reducer.reduce(weight=0.5)
    except hetcomm.comm.CollectiveTimeout as error:
        return "timeout", time.monotonic() - start, str(error)
    finally:
        open(gave_up, "w").close()
    return "returned"


def test_missing_rank_times_out_clearly(tmp_path):
    results = values(run_ranks(2, absent_rank, str(tmp_path / "gave-up"), tmp_path=tmp_path))
    kind, waited, message = results[0]
    assert kind == "timeout" and waited < 6
    assert "not every rank answered within 2 s" in message and "layout check" in message


def test_reducer_needs_an_initialised_group():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="torch.distributed is not initialised"):
        hetcomm.WeightedReducer(TinyNet().parameters())
