"""WeightedReducer with an expected total: buckets packed by n_i / C before the ranks
agree on N, unpacked with C / N taken out, on 4 Gloo ranks with unequal batches. The
result is the gradient of the mean loss over the union of all samples, as with the
agreement first; with overlap=True the buckets leave during backward with no round trip
before it; a fault on one rank is refused on every rank, and the group stays usable.

As in test_reducer, each result is checked against sum_i w_i of the ranks' own local
gradients in float64, within the reducer's count of roundings: here two more for the
unpack scale's C / N correction (its rounding to fp32 and its multiply into the scale)."""

import pytest
import torch
import torch.distributed as dist
from distributed import run_ranks, values
from test_reducer import assert_norm_of, assert_weighted_sum, of, worst
from tiny_model import COUNTS, LOSS_SCALE, TinyNet, error_of, local_backward
from tolerances import reduction_floor, reduction_rtol

import hetcomm

DIVISOR = 5.0   # the gradients hold the loss summed over the rank's samples, divided by this


def grads_of(model):
    return {name: (None if p.grad is None else p.grad.clone()) for name, p in model.named_parameters()}


def summed_backward(model, rank, counts, scale=1.0, use_side=True):
    """Gradients of the loss summed over this rank's samples / DIVISOR, times scale."""
    local_backward(model, rank, counts, scale=scale * counts[rank] / DIVISOR, use_side=use_side)


def scenarios(rank, world, counts):
    n, total = counts[rank], sum(counts)
    out = {}
    model = TinyNet()
    used = [p for name, p in model.named_parameters() if not name.startswith("never")]

    # Without overlap: C well off N (an earlier step's total), fp32 wire.
    plain = hetcomm.WeightedReducer(model.parameters(), wire_dtype=torch.float32, bucket_cap_mb=0.0005)
    summed_backward(model, rank, counts)
    out["local_plain"] = grads_of(model)
    result = plain.reduce(count=n, grad_divisor=DIVISOR, expected_total=total * 1.7)
    out["plain"] = (grads_of(model), result.weight, result.total, result.grad_norm.clone())
    out["plain_buckets"] = len(plain.buckets)
    summed_backward(model, rank, counts)
    out["local_agreed"] = grads_of(model)
    plain.reduce(count=n, grad_divisor=DIVISOR)
    out["agreed_first"] = grads_of(model)

    # A 16-bit wire under a loss scale, C a little under N.
    wire16 = hetcomm.WeightedReducer(model.parameters(), wire_dtype=torch.float16)
    summed_backward(model, rank, counts, scale=LOSS_SCALE)
    out["local_fp16"] = grads_of(model)
    result = wire16.reduce(count=n, grad_divisor=DIVISOR, expected_total=total - 2, loss_scale=LOSS_SCALE)
    out["fp16"] = (grads_of(model), result.found_inf.item())

    # With overlap: armed before backward, no collective there; the counts and the
    # gathered numbers after it; bookkeeping while the last buckets travel.
    overlapped = hetcomm.WeightedReducer(used, wire_dtype=torch.float32, bucket_cap_mb=0.0005, overlap=True,
                                         gather_size=2)
    model.zero_grad(set_to_none=True)
    overlapped.begin(grad_divisor=DIVISOR, expected_total=float(total + 3))
    summed_backward(model, rank, counts)
    out["launched_during_backward"] = len(overlapped._step.works)
    out["local_overlap"] = grads_of(model)
    seen = []
    result = overlapped.reduce(count=n, grad_divisor=DIVISOR, expected_total=float(total + 3),
                               gather=[rank, 10.0 * n], while_in_flight=seen.append)
    out["overlap"] = (grads_of(model), result.gathered, seen, result.total)

    # A gate: the final buckets wait until may_send() says yes (here at its fourth asking),
    # or to reduce() when it never does; disarm() undoes a held arming, for a gradient
    # that is to change (a rank handed more samples).
    asked = []
    overlapped.begin(grad_divisor=DIVISOR, expected_total=float(total),
                     may_send=lambda: asked.append(len(overlapped._step.works)) or len(asked) >= 4)
    summed_backward(model, rank, counts)
    out["gate_opened"] = (asked, len(overlapped._step.works), len(overlapped.buckets))
    out["local_gated"] = grads_of(model)
    overlapped.reduce(count=n, grad_divisor=DIVISOR, expected_total=float(total), gather=[0, 0])
    out["gated"] = grads_of(model)
    model.zero_grad(set_to_none=True)
    overlapped.begin(grad_divisor=DIVISOR, expected_total=float(total), may_send=lambda: False)
    local_backward(model, rank, counts, scale=0.5 * n / DIVISOR)
    out["held"] = len(overlapped._step.works)
    overlapped.disarm()
    overlapped.begin(grad_divisor=DIVISOR, expected_total=float(total))
    local_backward(model, rank, counts, scale=0.5 * n / DIVISOR, zero=False)
    out["local_disarmed"] = grads_of(model)
    overlapped.reduce(count=n, grad_divisor=DIVISOR, expected_total=float(total), gather=[0, 0])
    out["disarmed"] = grads_of(model)
    model.zero_grad(set_to_none=True)
    overlapped.begin(grad_divisor=DIVISOR, expected_total=float(total))
    summed_backward(model, rank, counts)
    out["disarm_too_late"] = error_of(overlapped.disarm)
    overlapped.reduce(count=n, grad_divisor=DIVISOR, expected_total=float(total), gather=[0, 0])

    # A parameter used on rank 0 only, and one on none: zeros from the others, None where unused.
    holding = hetcomm.WeightedReducer(model.parameters(), wire_dtype=torch.float32, overlap=True)
    model.zero_grad(set_to_none=True)
    holding.begin(grad_divisor=DIVISOR, expected_total=float(total))
    summed_backward(model, rank, counts, use_side=(rank == 0))
    out["local_partly_used"] = grads_of(model)
    holding.reduce(count=n, grad_divisor=DIVISOR, expected_total=float(total))
    holding.remove_hooks()
    out["partly_used"] = grads_of(model)

    # Faults after the buckets left: refused on every rank, gradients as they were, the
    # group still in step (the next reduce works).
    def refused(reduce_call, arm=None):
        model.zero_grad(set_to_none=True)
        if arm:
            arm()
        summed_backward(model, rank, counts)
        before = grads_of(model)
        error = error_of(reduce_call)
        kept = all(g is None and before[k] is None or torch.equal(g, before[k]) for k, g in grads_of(model).items())
        return error, kept

    arm = lambda: overlapped.begin(grad_divisor=DIVISOR, expected_total=float(total))   # noqa: E731
    out["unlike_begin"] = refused(lambda: overlapped.reduce(
        count=n, grad_divisor=DIVISOR, expected_total=float(total + (1 if rank == 2 else 0)), gather=[0, 0]), arm)
    out["no_count"] = refused(lambda: overlapped.reduce(
        count=None if rank == 1 else n, grad_divisor=DIVISOR, expected_total=float(total), gather=[0, 0]), arm)
    out["unlike_totals"] = refused(lambda: plain.reduce(count=n, grad_divisor=DIVISOR,
                                                        expected_total=float(total + rank)))
    out["mixed"] = refused(lambda: plain.reduce(count=n, grad_divisor=DIVISOR,
                                                expected_total=float(total) if rank == 0 else None))
    summed_backward(model, rank, counts)
    out["local_after_faults"] = grads_of(model)
    plain.reduce(count=n, grad_divisor=DIVISOR, expected_total=float(total))
    out["after_faults"] = grads_of(model)

    # Refused before any collective: the same call on every rank.
    out["bad_total"] = [error_of(lambda c=c: plain.reduce(count=n, expected_total=c))
                        for c in (0.0, float("nan"), -3.0)]
    out["with_weight"] = error_of(lambda: plain.reduce(weight=n / total, expected_total=float(total)))
    out["begin_without_overlap"] = error_of(lambda: plain.begin(grad_divisor=DIVISOR, expected_total=float(total)))
    out["begin_with_count"] = error_of(lambda: overlapped.begin(count=n, grad_divisor=DIVISOR,
                                                                expected_total=float(total)))
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return values(run_ranks(4, scenarios, COUNTS, tmp_path=tmp_path_factory.mktemp("reducer_expected")))


# The local gradients hold the loss summed over the rank's samples / DIVISOR: weights DIVISOR / N.
WEIGHTS = [DIVISOR / sum(COUNTS)] * len(COUNTS)
RTOL = reduction_rtol(len(COUNTS), torch.float32, scale_roundings=2)
# Under LOSS_SCALE, a third: 1 / LOSS_SCALE's.
FP16_RTOL = reduction_rtol(len(COUNTS), torch.float16, scale_roundings=3)
FP16_FLOOR = reduction_floor(len(COUNTS), torch.float16, (sum(COUNTS) - 2) / sum(COUNTS) / LOSS_SCALE, FP16_RTOL)


def assert_union_gradient(grads, ranks, local, rtol=RTOL):
    assert_weighted_sum(grads, of(ranks, local), WEIGHTS, rtol)


def test_packed_by_an_expected_total_the_result_is_the_union_gradient(ranks):
    for rank, r in enumerate(ranks):
        grads, weight, total, norm = r["plain"]
        assert_union_gradient(grads, ranks, "local_plain")
        assert total == sum(COUNTS) and weight == COUNTS[rank] / sum(COUNTS)
        assert_union_gradient(r["agreed_first"], ranks, "local_agreed", reduction_rtol(len(COUNTS), torch.float32))
        assert_norm_of(norm, grads, r["plain_buckets"])
    # Unpacked without the C / N correction, the result lands far outside.
    assert worst(ranks[0]["plain"][0], of(ranks, "local_plain"), [w / 1.7 for w in WEIGHTS], RTOL) > 1000
    for r in ranks[1:]:   # identical on every rank
        assert all(torch.equal(g, ranks[0]["plain"][0][k]) for k, g in r["plain"][0].items() if g is not None)


def test_a_16_bit_wire_under_a_loss_scale(ranks):
    for r in ranks:
        grads, found_inf = r["fp16"]
        assert found_inf == 0
        assert_weighted_sum(grads, of(ranks, "local_fp16"), [w / LOSS_SCALE for w in WEIGHTS], FP16_RTOL, FP16_FLOOR)


def test_with_overlap_the_buckets_leave_during_backward(ranks):
    for rank, r in enumerate(ranks):
        grads, gathered, seen, total = r["overlap"]
        assert r["launched_during_backward"] >= 1
        assert_union_gradient(grads, ranks, "local_overlap")
        assert grads["never.weight"] is None
        assert total == sum(COUNTS)
        assert gathered == [[k, 10.0 * c] for k, c in enumerate(COUNTS)]
        assert seen == [gathered]


def test_a_gate_holds_the_buckets_until_it_opens(ranks):
    for r in ranks:
        asked, sent, buckets = r["gate_opened"]
        assert asked == [0, 0, 0, 0] and sent == buckets   # none before the fourth asking, all in backward
        assert_union_gradient(r["gated"], ranks, "local_gated")
        assert r["held"] == 0
        # Two half micro-batches, the first held then disarmed: the sum of both is sent.
        assert_union_gradient(r["disarmed"], ranks, "local_disarmed")
        kind, message = r["disarm_too_late"]
        assert kind == "RuntimeError" and "buckets have left" in message


def test_parameters_without_gradients(ranks):
    for r in ranks:
        grads = r["partly_used"]
        assert grads["never.weight"] is None and grads["never.bias"] is None
        assert_union_gradient(grads, ranks, "local_partly_used")


@pytest.mark.parametrize("case, message", [
    ("unlike_begin", "ranks [2] passed an invalid weight, count or gather"),
    ("no_count", "ranks [1] passed an invalid weight, count or gather"),
    ("unlike_totals", "the ranks' expected totals differ"),
    ("mixed", "the ranks' expected totals differ"),
])
def test_a_fault_after_the_buckets_left_is_refused_on_every_rank(ranks, case, message):
    for r in ranks:
        error, kept = r[case]
        assert error is not None and error[0] == "ValueError" and message in error[1], error
        assert kept
    assert "does not match begin(grad_divisor=5, expected_total=24)" in ranks[2]["unlike_begin"][0][1]
    for r in ranks:
        assert_union_gradient(r["after_faults"], ranks, "local_after_faults")


def test_bad_expected_totals_are_refused_before_any_collective(ranks):
    r = ranks[0]
    for error in r["bad_total"]:
        assert error[0] == "ValueError" and "expected_total" in error[1] and "finite positive" in error[1]
    assert r["with_weight"][0] == "ValueError" and "not weight=" in r["with_weight"][1]
    assert "arms the gradient hooks of overlap=True" in r["begin_without_overlap"][1]
    assert "takes grad_divisor= alone" in r["begin_with_count"][1]
