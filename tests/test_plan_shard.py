"""hetcomm plan --shard: the optimizer state sharded by each card's memory puts every card
of a mixed cluster in. The bytes per card, the ranges and the step are worked out here
from the runtime's memory model, written out independently of hetcomm.plan.shard:

- one flat weight buffer of one dtype on every card: weights and gradients whole (2 bytes
  an element for 16-bit weights, 4 for fp32), a wire buffer of the whole size only when
  the wire's dtype is not the weights', and 0.5 GiB of CUDA context;
- on the owner of each range only: fp32 masters and two moments, 12 bytes an element (8
  with fp32 weights), and fp32 scratch for one bucket (the 25 MiB cap in the weights'
  dtype) at most;
- ranges proportional to usable memory less all that and the activations of the card's
  micro-batch; a step = slowest compute + reduce-scatter + slowest update (28 bytes an
  element at bandwidth x 0.7) + all-gather, each collective (N-1)/N x P x wire bytes."""

import json

import pytest
from test_plan import plan_for

from hetcomm.plan.cli import main
from hetcomm.plan.cluster import parse_cluster
from hetcomm.plan.cost import DeviceCost
from hetcomm.plan.planner import Member, make_plan
from hetcomm.plan.precision import parse_precision
from hetcomm.shard.layout import layout_by_memory
from hetcomm.train.config import parse_state_memory

LEGACY = "3x1080ti+1xv100-32gb"
TURING = "2x2080ti,2xt4"
GIB = 2**30
CONTEXT = 0.5 * GIB
BUCKET = 25 * 2**20   # bytes of the reducer's bucket cap
ALIGN = 16            # the runtime's range boundaries
P_774M, P_1_5B = 774_030_080, 1_557_611_200


def check_memory(plan, weight_bytes=2, state_per_element=12, wire_bytes=0):
    """Every card's bytes from the model above; the ranges proportional to what each
    card has left beside its micro-batch, adding up to P exactly."""
    parameters = plan.model.parameters(plan.seq)
    shard = plan.shard
    assert sum(card.elements for card in shard.cards) == parameters
    bucket_elements = BUCKET // weight_bytes
    left = []
    for member, card, micro in zip(plan.members, shard.cards, plan.split.micro_batches):
        assert card.micro_batch == max(micro)
        assert card.weights_bytes == card.gradient_bytes == weight_bytes * parameters
        assert card.wire_bytes == wire_bytes * parameters
        assert card.state_bytes == state_per_element * card.elements
        assert card.scratch_bytes == 4 * min(card.elements, bucket_elements)
        activations = member.cost.activation_bytes * card.micro_batch
        assert card.activation_bytes == pytest.approx(activations)
        usable = member.cost.memory_bytes
        replicated = CONTEXT + (2 * weight_bytes + wire_bytes) * parameters
        held = replicated + card.state_bytes + card.scratch_bytes + activations
        assert card.held_bytes == pytest.approx(held)
        assert held <= usable
        left.append(usable - replicated - activations - 4 * bucket_elements)
        assert card.left_for_state == pytest.approx(left[-1], abs=1)
        # The device table's memory column is the same figure.
        assert member.cost.memory_use(card.micro_batch) == pytest.approx(held)
    for card, room in zip(shard.cards, left):
        assert abs(card.elements - parameters * room / sum(left)) <= len(left) * ALIGN + 1
    return left


def check_step(plan):
    """The step: compute + reduce-scatter + the slowest card's update + all-gather."""
    parameters, ranks = plan.model.parameters(plan.seq), len(plan.members)
    wire = {"fp16": 2, "bf16": 2, "fp32": 4}[plan.wire]
    updates = [28 * card.elements / (member.device.bandwidth_gbs * 1e9 * 0.7)
               for member, card in zip(plan.members, plan.shard.cards)]
    assert [card.update_seconds for card in plan.shard.cards] == pytest.approx(updates)
    assert plan.update_s == pytest.approx(max(updates))
    rs, ag = plan.shard.reduce_scatter, plan.shard.all_gather
    assert rs.wire_bytes == ag.wire_bytes == pytest.approx((ranks - 1) / ranks * parameters * wire)
    assert rs.wire_bytes + ag.wire_bytes == pytest.approx(2 * (ranks - 1) / ranks * parameters * wire)
    link = plan.link.bandwidth_gbs * 1e9
    assert rs.seconds == pytest.approx(rs.wire_bytes / link, rel=0.01)   # latencies: under 1%
    assert plan.step_s == pytest.approx(plan.compute_s + rs.seconds + max(updates) + ag.seconds)
    assert plan.compute_s == max(plan.split.rank_times)


def test_a_774m_gpt2_trains_on_every_card_of_three_11gb_and_one_32gb(catalog):
    alone = plan_for(catalog, LEGACY, "gpt2-774m", global_batch=64)
    assert [m.name for m in alone.members] == ["v100-32gb"] and len(alone.left_out) == 3
    assert "16.4 GiB of the 9.9 GiB usable" in alone.left_out[0].reason
    plan = plan_for(catalog, LEGACY, "gpt2-774m", global_batch=64, shard=True)
    assert plan.model.parameters(plan.seq) == P_774M
    assert [m.name for m in plan.members] == ["1080ti"] * 3 + ["v100-32gb"] and not plan.left_out
    assert plan.shard.weight_dtype == "fp16"
    left = check_memory(plan)
    check_step(plan)
    # The memory split follows memory (the V100 owns most), the compute split speed.
    shares = [card.elements / P_774M for card in plan.shard.cards]
    assert shares[0] == shares[1] == shares[2] and shares[3] > 3 * shares[0]
    assert sum(left) >= 12 * P_774M
    assert plan.split.sizes[3] > 5 * plan.split.sizes[0] and sum(plan.split.sizes) == 64
    assert plan.tokens_per_s > 1.3 * alone.tokens_per_s


def test_a_15b_gpt2_fits_three_11gb_and_one_32gb_only_sharded(catalog):
    with pytest.raises(ValueError, match="fits on none of the devices"):
        plan_for(catalog, LEGACY, "gpt2-1.5b", global_batch=64)
    plan = plan_for(catalog, LEGACY, "gpt2-1.5b", global_batch=64, shard=True)
    assert plan.model.parameters(plan.seq) == P_1_5B and len(plan.members) == 4
    check_memory(plan)
    check_step(plan)
    # A 1080 Ti holds 5.8 GiB of weights and gradients, one sample's activations (3.4 GiB)
    # and a sliver of the state; the V100 holds almost all of it.
    assert all(card.micro_batch == 1 for card in plan.shard.cards[:3])
    assert plan.shard.cards[3].elements > 0.95 * P_1_5B


def test_turing_cards_over_10gbe(catalog):
    with pytest.raises(ValueError, match="fits on none of the devices"):
        plan_for(catalog, TURING, "gpt2-774m", global_batch=64)
    plan = plan_for(catalog, TURING, "gpt2-774m", global_batch=64, shard=True)
    assert len(plan.members) == 4 and plan.link.name == "10gbe"
    check_memory(plan)
    check_step(plan)
    # With overlap only the reduce-scatter hides behind backward; the all-gather follows the update.
    overlapped = plan_for(catalog, TURING, "gpt2-774m", global_batch=64, shard=True, overlap=True)
    rs, ag = overlapped.shard.reduce_scatter, overlapped.shard.all_gather
    backward = 2 / 3 * overlapped.compute_s
    assert overlapped.exposed_comm_s == pytest.approx(max(rs.seconds / rs.buckets, rs.seconds - backward) + ag.seconds)
    # gpt2-1.5b: with one sample's activations beside 5.8 GiB of weights and gradients the
    # four cards keep 9.7 GiB for a state of 12 x 1,557,611,200 bytes = 17.41 GiB.
    with pytest.raises(ValueError, match=r"1,557,611,200 elements need 12 bytes each of fp32 masters and moments, "
                                         r"17\.41 GiB, and the 4 cards have 9\.7\d GiB .* It would fit at --seq 256"):
        plan_for(catalog, TURING, "gpt2-1.5b", global_batch=64, shard=True)


def test_one_weight_dtype_for_every_card_and_the_wire_buffer_only_when_it_differs(catalog):
    # fp32 everywhere: fp32 weights are the masters (8 bytes of state an element); an fp16
    # wire needs a buffer of its own.
    plan = plan_for(catalog, "2x1080ti,1xv100", "gpt2-124m", global_batch=32, shard=True, precision="fp32")
    assert plan.shard.weight_dtype == "fp32"
    check_memory(plan, weight_bytes=4, state_per_element=8, wire_bytes=2)
    # One card in fp32, the other in fp16: the flat buffer is 16-bit on both.
    devices = [entry.device for entry in parse_cluster("2x1080ti,1xv100", catalog)]
    mixed = plan_for(catalog, "2x1080ti,1xv100", "gpt2-124m", global_batch=32, shard=True,
                     precision=parse_precision("v100=fp16,1080ti=fp32", catalog, devices))
    assert [m.cost.precision for m in mixed.members] == ["fp32", "fp32", "fp16"]
    assert mixed.shard.weight_dtype == "fp16"
    check_memory(mixed)
    # bf16 only when every card is sm_80+ in bf16; a bf16 wire is then reduced in place,
    # an fp16 one is not.
    assert plan_for(catalog, "2xa100", "gpt2-124m", shard=True, wire="bf16").shard.weight_dtype == "bf16"
    check_memory(plan_for(catalog, "2xa100", "gpt2-124m", shard=True, wire="bf16"))
    check_memory(plan_for(catalog, "2xa100", "gpt2-124m", shard=True, wire="fp16"), wire_bytes=2)
    assert plan_for(catalog, "1xa100,1xv100", "gpt2-124m", shard=True).shard.weight_dtype == "fp16"


def test_a_card_without_room_for_1024_elements_is_left_out_with_the_reason(catalog):
    # A 6 GB GTX 1060: 5.4 GiB usable, less than 0.5 of context, 2.9 of weights and
    # gradients and 2.25 of one sample's activations.
    plan = plan_for(catalog, "1x1060,1xv100-32gb", "gpt2-774m", global_batch=16, shard=True)
    assert [m.name for m in plan.members] == ["v100-32gb"] and plan.shard.cards[0].elements == P_774M
    (out,) = plan.left_out
    assert out.member.name == "1060" and "less than the 16,384 bytes of state of 1024 elements" in out.reason


def test_cards_of_unknown_memory_cannot_be_sharded(catalog):
    model = plan_for(catalog, "1xt4", "gpt2-124m", global_batch=8).model
    cost = DeviceCost("fp32", 0.01, 0.1, None, 1e9, 1e6, None, 0.1, None)
    with pytest.raises(ValueError, match="--shard needs each card's memory"):
        make_plan([Member("rank0", "CPU", 0, cost, "measured")], model, 1024, 8, in_node=catalog.link("pcie3"),
                  between_nodes=catalog.link("10gbe"), shard=True)


def test_the_command_line_shows_both_splits_the_step_and_the_largest_models(catalog, capsys):
    args = ["--cluster", LEGACY, "--model", "gpt2-774m", "--global-batch", "64", "--seq", "1024", "--shard"]
    assert main(args) == 0
    text = capsys.readouterr().out
    for part in ("optimizer state sharded by memory", "masters+moments", "left for state", "range",
                 "reduce-scatter", "update: the slowest owner's, rank 3 (Tesla V100 SXM2 32GB", "all-gather",
                 "28 B an element at 900 GB/s x 0.7",
                 "largest GPT-2 (seq 1024, batch 64) on all 4 cards: gpt2-355m unsharded, gpt2-1.5b sharded",
                 "largest BERT (seq 512, batch 64) on all 4 cards: bert-large unsharded, bert-large sharded"):
        assert part in text, part
    assert main(args + ["--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    shard = record["shard"]
    assert [card["device"] for card in shard["cards"]] == ["1080ti"] * 3 + ["v100-32gb"]
    assert sum(card["elements"] for card in shard["cards"]) == P_774M
    assert shard["state_bytes"] == 12 * P_774M
    assert record["largest"]["GPT-2"] == {"all": "gpt2-355m", "any": "gpt2-774m", "all_sharded": "gpt2-1.5b",
                                          "any_sharded": "gpt2-1.5b"}
    # The runtime, given the bytes the plan says each card has left, makes the same ranges.
    memory = parse_state_memory(shard["state_memory"], 4)
    layout = layout_by_memory(memory, P_774M, __import__("torch").float16, BUCKET // 2, "test")
    assert layout.sizes() == [card["elements"] for card in shard["cards"]]


def test_a_cluster_that_cannot_hold_the_state_is_one_clear_error(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--cluster", "1xt4", "--model", "gpt2-1.5b", "--global-batch", "8", "--shard"])
    assert stop.value.code == 2
    error = capsys.readouterr().err
    assert error.startswith("hetcomm plan: error: gpt2-1.5b at --seq 1024 does not fit even with the optimizer state "
                            "sharded: its 1,557,611,200 elements need 12 bytes each of fp32 masters and moments, "
                            "17.41 GiB, and the card has")
    assert "GiB short" in error and "largest GPT-2 (seq 1024, batch 8) on its card" in error
