"""hetcomm plan --shard: the optimizer state sharded by each card's memory puts every
card of a mixed cluster in, with the bytes per card the runtime keeps (worked here from
the memory model), the step paying the slowest card's update once; the largest models
with and without sharding; a cluster that cannot hold the state is one clear error."""

import json

import pytest
from test_plan import plan_for

from hetcomm.plan.cli import main
from hetcomm.plan.cost import BANDWIDTH_EFFICIENCY, BUCKET_BYTES, CONTEXT_BYTES

LEGACY = "3x1080ti+1xv100-32gb"


def test_a_774m_gpt2_trains_on_every_card_of_three_11gb_and_one_32gb(catalog):
    alone = plan_for(catalog, LEGACY, "gpt2-774m", global_batch=64)
    assert [m.name for m in alone.members] == ["v100-32gb"] and len(alone.left_out) == 3
    plan = plan_for(catalog, LEGACY, "gpt2-774m", global_batch=64, shard=True)
    assert [m.name for m in plan.members] == ["1080ti"] * 3 + ["v100-32gb"] and not plan.left_out
    assert plan.tokens_per_s > 1.3 * alone.tokens_per_s
    parameters = plan.model.parameters(plan.seq)
    assert sum(s.elements for s in plan.shards) == parameters
    for member, shard in zip(plan.members, plan.shards):
        cost = member.cost
        # fp16 weights and gradients, the wire in place (fp16 too); 12 bytes of state an element
        # of its range and one bucket of fp32 scratch.
        assert shard.weights_bytes == shard.gradient_bytes == 2 * parameters
        assert shard.state_bytes == 12 * shard.elements + 4 * min(shard.elements, BUCKET_BYTES // 4)
        assert cost.state_bytes == CONTEXT_BYTES + 4 * parameters + shard.state_bytes
        assert shard.left_for_state == pytest.approx(cost.memory_bytes - CONTEXT_BYTES - 4 * parameters
                                                     - cost.activation_bytes)
        assert cost.memory_use(cost.cap) <= cost.memory_bytes
        assert cost.update_seconds == pytest.approx(28 * shard.elements / (member.device.bandwidth_gbs * 1e9
                                                                           * BANDWIDTH_EFFICIENCY))
    # Ranges follow the memory left for state once the scratch is paid, not equal shares.
    left = [s.left_for_state - BUCKET_BYTES for s in plan.shards]
    for shard, room in zip(plan.shards, left):
        assert shard.elements / parameters == pytest.approx(room / sum(left), abs=1e-6)
    assert plan.update_s == max(m.cost.update_seconds for m in plan.members)
    assert plan.step_s == pytest.approx(plan.compute_s + plan.all_reduce.seconds + plan.update_s)


def test_a_15b_gpt2_fits_only_sharded(catalog):
    with pytest.raises(ValueError, match="fits on none of the devices"):
        plan_for(catalog, LEGACY, "gpt2-1.5b", global_batch=64)
    plan = plan_for(catalog, LEGACY, "gpt2-1.5b", global_batch=64, shard=True)
    assert len(plan.members) == 4


def test_turing_cards_over_10gbe(catalog):
    with pytest.raises(ValueError, match="fits on none of the devices"):
        plan_for(catalog, "2x2080ti,2xt4", "gpt2-774m", global_batch=64)
    plan = plan_for(catalog, "2x2080ti,2xt4", "gpt2-774m", global_batch=64, shard=True)
    assert len(plan.members) == 4 and plan.link.name == "10gbe"
    # The all-gather follows the update: with overlap only the reduce-scatter hides behind backward.
    overlapped = plan_for(catalog, "2x2080ti,2xt4", "gpt2-774m", global_batch=64, shard=True, overlap=True)
    assert overlapped.exposed_comm_s >= overlapped.all_reduce.seconds / 2
    with pytest.raises(ValueError, match=r"holds the state of .* of the 1,557,611,200 trained elements; 12 bytes per "
                                         r"element are needed"):
        plan_for(catalog, "2x2080ti,2xt4", "gpt2-1.5b", global_batch=64, shard=True)


def test_the_command_line_names_the_largest_models(capsys):
    assert main(["--cluster", LEGACY, "--model", "gpt2-774m", "--global-batch", "64", "--shard"]) == 0
    text = capsys.readouterr().out
    assert "optimizer state sharded by memory" in text and "update of the largest range" in text
    assert "largest GPT-2 on all 4 cards: gpt2-355m unsharded, gpt2-1.5b sharded" in text
    assert main(["--cluster", LEGACY, "--model", "gpt2-774m", "--global-batch", "64", "--shard", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert len(record["shard"]) == 4 and record["largest"]["GPT-2"]["any"] == "gpt2-774m"


def test_a_cluster_that_cannot_hold_the_state_is_one_error(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--cluster", "1xt4", "--model", "gpt2-1.5b", "--global-batch", "8", "--shard"])
    assert stop.value.code == 2
    assert "hetcomm plan: error:" in capsys.readouterr().err
