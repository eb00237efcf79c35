"""hetcomm plan --shard full [--offload optimizer] [--checkpointing auto|on|off]: weights,
gradients and optimizer state sharded by each card's memory (ZeRO-3 style), activation
checkpointing per card, the state optionally in host memory. The bytes per card, the
ranges and the step are worked out here from the runtime's memory model, written out
independently of hetcomm.plan.full_shard:

- per card, for its own range r: 16-bit weights (2 B), an fp32 gradient accumulator (4 B)
  and, unless offloaded, an fp32 master and two moments (12 B): 18 B an element, 6 offloaded;
- the root (embeddings, an untied head, the final norm) and two blocks gathered, and as
  many gradients: 2 x (root + 2 x block) x 2 B;
- the micro-batch's activations: as the unsharded planner counts them, or checkpointed:
  each block's fp32 input (4 x seq x hidden) and one block's full activations, beside
  what is kept outside the blocks but the vocabulary-wide loss, which checkpointing
  computes a chunk at a time (hetcomm.train.chunked_loss): one chunk's worth of it per
  micro-batch; 0.5 GiB of CUDA context;
- ranges proportional to usable memory less all but the range, adding up to P;
- offload: 18 B an element in the machine's RAM (master, moments, fp32 gradient and 16-bit
  weight staging); PCIe 4 B down and 2 B up an element at
  12 GB/s (Pascal); the CPU AdamW, 28 B an element at 20 GB/s, over the machine's ranges;
- every micro-step gathers every weight twice and reduce-scatters every gradient
  ((N-1)/N x P x 2 B each per rank), every rank running the same micro-steps (lock-step).
No timing assertions: the step is checked against its parts."""

import json
from pathlib import Path

import pytest
from test_plan import plan_for

from hetcomm.plan.cli import main
from hetcomm.plan.cluster import parse_cluster
from hetcomm.plan.hf_config import read_hf_config
from hetcomm.plan.planner import make_plan, spec_members
from hetcomm.train.chunked_loss import loss_chunk_tokens

LEGACY = "3x1080ti+1xv100-32gb"
TURING = "2x2080ti,2xt4"
CEPHALO = "2xl4+1xa6000+1xp40"
GIB = 2**30
CONTEXT = 0.5 * GIB
ALIGN = 16
P_1_5B = 1_557_611_200
CONFIGS = Path(__file__).resolve().parents[1] / "examples" / "configs"
LLAMA_1B, LLAMA_3B = CONFIGS / "llama-3.2-1b.json", CONFIGS / "llama-3.2-3b.json"


def llama_plan(catalog, cluster, config, seq, global_batch=64, **kwargs):
    shape = read_hf_config(str(config))
    members = spec_members(parse_cluster(cluster, catalog), shape, seq)
    return make_plan(members, shape, seq, global_batch, in_node=catalog.link("pcie3"),
                     between_nodes=catalog.link("10gbe"), **kwargs)


def root_and_block(model, seq):
    """The root (everything outside the blocks: embeddings, an untied head, the final
    norm), held throughout, and one block."""
    h = model.n_embd
    if model.kind == "llama":
        block = (h * model.q_width + 2 * h * model.kv_width + model.q_width * h + 3 * h * model.intermediate + 2 * h)
        root = model.vocab_size * h * (1 if model.tied else 2) + h
    else:
        block = 12 * h * h + 13 * h
        root = model.vocab_size * h + seq * h + 2 * h
    return root, block


def transient_elements(model, seq):
    """The root and two blocks."""
    root, block = root_and_block(model, seq)
    return root + 2 * block


def loss_per_token(model):
    """The vocabulary-wide bytes a token's loss holds at its peak (16-bit autocast): the
    fp32 log-softmax and the gradients of it and of the logits, and for Llama the 16-bit
    logits a caller holds."""
    return (4 + 8 + (2 if model.kind == "llama" else 0)) * model.vocab_size


def per_sample(member, model, seq, checkpointed):
    """Activations per sample, without and with checkpointing (16-bit autocast)."""
    full = model.activation_bytes_per_sample(seq, "fp16")
    if not checkpointed:
        return full
    h, layers = model.n_embd, model.n_layer
    block = (model.layer_saved_bytes_per_token("fp16") if model.kind == "llama" else 38 * h) * seq
    return full - loss_per_token(model) * seq - layers * block + layers * 4 * h * seq + block


def activations(member, model, seq, checkpointed, micro_batch):
    """A micro-batch's: checkpointed, one chunk of the loss besides."""
    chunk = loss_per_token(model) * loss_chunk_tokens(model.vocab_size) if checkpointed else 0
    return micro_batch * per_sample(member, model, seq, checkpointed) + chunk


def check_full(plan, offload=False):
    """Every card's bytes from the model above; the ranges; the step's parts."""
    model, seq, full = plan.model, plan.seq, plan.full
    parameters = model.parameters(seq)
    assert sum(card.elements for card in full.cards) == parameters
    per = 6 if offload else 18
    transient = 2 * transient_elements(model, seq) * 2
    rounds = {len(micro) for micro in plan.split.micro_batches}
    assert rounds == {full.micro_steps}, "every rank runs the same micro-steps"
    frees = []
    for member, card, micro in zip(plan.members, full.cards, plan.split.micro_batches):
        r = card.elements
        assert card.micro_batch == max(micro)
        assert (card.weights_bytes, card.gradient_bytes) == (2 * r, 4 * r)
        assert card.state_bytes == (0 if offload else 12 * r)
        assert card.transient_bytes == transient
        kept = activations(member, model, seq, card.checkpointing, card.micro_batch)
        assert card.activation_bytes == pytest.approx(kept)
        held = CONTEXT + per * r + transient + kept
        assert card.held_bytes == pytest.approx(held)
        assert held <= member.cost.memory_bytes
        assert member.cost.memory_use(card.micro_batch) == pytest.approx(held)   # the device table's column
        frees.append(member.cost.memory_bytes - CONTEXT - transient - kept)
    for card, free in zip(full.cards, frees):
        assert abs(card.elements - parameters * free / sum(frees)) <= len(frees) * ALIGN + 1
    # The step: lock-step compute, the collectives' exposed part, the slowest update.
    compute = sum(max(m.cost.fixed + m.cost.per_sample * sorted(micro, reverse=True)[r]
                      for m, micro in zip(plan.members, plan.split.micro_batches))
                  for r in range(full.micro_steps))
    assert plan.compute_s == pytest.approx(compute)
    n = len(plan.members)
    link = plan.link.bandwidth_gbs * 1e9
    sent = (n - 1) / n * parameters * 2
    assert full.all_gather.wire_bytes == full.reduce_scatter.wire_bytes == pytest.approx(sent)
    assert full.all_gather.seconds == pytest.approx(sent / link, rel=0.01)   # latencies: under 1%
    collectives = full.micro_steps * (2 * full.all_gather.seconds + full.reduce_scatter.seconds)
    assert full.collectives_s == pytest.approx(collectives)
    assert plan.exposed_comm_s == pytest.approx(max(full.micro_steps * full.first_unit_s, collectives - compute))
    if offload:
        host = {}
        for member, card in zip(plan.members, full.cards):
            host[member.node] = host.get(member.node, 0) + card.elements
        # The copy down waited for; the host's update and the copy up by unit, each at the
        # unit's next gather: the root's share first, the rest within one micro-step's
        # forward (a third of its compute) or beyond it.
        forward = compute / full.micro_steps / 3
        root = root_and_block(model, seq)[0] / parameters
        for member, card in zip(plan.members, full.cards):
            link = 12e9 if member.device.architecture == "Pascal" else 24e9
            down, up = card.elements * 4 / link, card.elements * 2 / link
            assert card.pcie_seconds == pytest.approx(down + up)
            later = host[member.node] * 28 / 20e9 + up
            assert card.host_seconds == pytest.approx(host[member.node] * 28 / 20e9)
            assert card.update_seconds == pytest.approx(down + root * later + max(0, (1 - root) * later - forward))
            assert card.host_bytes == 18 * card.elements
        assert [h.used_bytes for h in full.host] == [18 * host[node] for node in sorted(host)]
    else:
        for member, card in zip(plan.members, full.cards):
            assert card.update_seconds == pytest.approx(30 * card.elements / (member.device.bandwidth_gbs * 1e9 * 0.7))
    assert plan.update_s == max(card.update_seconds for card in full.cards)
    assert plan.step_s == pytest.approx(compute + plan.exposed_comm_s + plan.update_s)


def check_auto(plan):
    """Checkpointing off where the card's micro-batch fits without it beside its range,
    on only where it does not."""
    for member, card in zip(plan.members, plan.full.cards):
        persistent = card.held_bytes - card.activation_bytes
        fits_without = persistent + card.micro_batch * per_sample(member, plan.model, plan.seq, False) \
            <= member.cost.memory_bytes
        assert fits_without != card.checkpointing


def test_gpt2_15b_fully_sharded_on_three_1080ti_and_a_v100(catalog):
    state = plan_for(catalog, LEGACY, "gpt2-1.5b", global_batch=64, shard=True)
    assert [card.micro_batch for card in state.shard.cards[:3]] == [1, 1, 1]
    plan = plan_for(catalog, LEGACY, "gpt2-1.5b", global_batch=64, shard="full")
    assert plan.model.parameters(1024) == P_1_5B and len(plan.members) == 4 and not plan.left_out
    check_full(plan)
    # Fully sharded, the memory is there for micro-batches of 4 checkpointed samples on
    # each 1080 Ti (with --shard its whole weights and gradients leave room for 1): with 4
    # there and 1 on the V100 the cards' rooms still hold 18 B of every element.
    transient = 2 * transient_elements(plan.model, 1024) * 2
    rooms = [m.cost.memory_bytes - CONTEXT - transient - activations(m, plan.model, 1024, True, micro)
             for m, micro in zip(plan.members, (4, 4, 4, 1))]
    assert min(rooms) > 0 and sum(rooms) >= 18 * P_1_5B
    # The fastest lock-step plan runs them at 1 sample a micro-step without checkpointing
    # (the V100 at 5): a larger micro-batch would need checkpointing (a third more work)
    # and would make the V100 wait in every micro-step.
    assert [card.micro_batch for card in plan.full.cards] == [1, 1, 1, 5]
    assert sum(plan.split.sizes) == 64
    forced = plan_for(catalog, LEGACY, "gpt2-1.5b", global_batch=64, shard="full", checkpointing="on")
    check_full(forced)
    assert all(card.checkpointing for card in forced.full.cards)


def test_gpt2_15b_fits_all_four_turing_cards_over_10gbe(catalog):
    with pytest.raises(ValueError, match="does not fit even with the optimizer state sharded"):
        plan_for(catalog, TURING, "gpt2-1.5b", global_batch=64, shard=True)
    plan = plan_for(catalog, TURING, "gpt2-1.5b", global_batch=64, shard="full")
    assert [m.name for m in plan.members] == ["2080ti", "2080ti", "t4", "t4"] and not plan.left_out
    assert plan.link.name == "10gbe"
    check_full(plan)


def test_llama_32_1b_at_2048_on_four_1080ti(catalog):
    # 18 B an element of 1.24G elements (5.2 GiB a card), the root (the 128256 x 2048 tied
    # embedding) and two blocks gathered, and as many gradients (1.43 GiB): checkpointed,
    # with the loss a chunk at a time, 4 samples of 2048 tokens fit beside them on each
    # 1080 Ti. Without checkpointing one sample's loss alone (3.4 GiB) leaves no room.
    plan = llama_plan(catalog, "4x1080ti", LLAMA_1B, 2048, shard="full")
    assert len(plan.members) == 4 and not plan.left_out
    check_full(plan)
    assert all(card.checkpointing for card in plan.full.cards)
    assert [card.micro_batch for card in plan.full.cards] == [4] * 4
    check_auto(plan)
    with pytest.raises(ValueError, match=r"llama-3.2-1b at --seq 2048 does not fit even fully sharded "
                                         r"\(--shard full\): its 1,235,814,400 elements need 18 bytes each .* "
                                         r"\(18\.47 GiB short\)"):
        llama_plan(catalog, "4x1080ti", LLAMA_1B, 2048, shard="full", checkpointing="off")
    offloaded = llama_plan(catalog, "4x1080ti", LLAMA_1B, 2048, shard="full", offload="optimizer")
    check_full(offloaded, offload=True)
    check_auto(offloaded)
    check_full(llama_plan(catalog, "4x1080ti", LLAMA_1B, 1024, shard="full"))


def test_llama_32_3b_on_four_1080ti_needs_offload(catalog):
    with pytest.raises(ValueError, match=r"3,212,749,824 elements need 18 bytes each .* 53\.86 GiB, .* It would fit "
                                         r"with --offload optimizer"):
        llama_plan(catalog, "4x1080ti", LLAMA_3B, 2048, shard="full")
    with pytest.raises(ValueError, match="does not fit even fully sharded"):
        llama_plan(catalog, "4x1080ti", LLAMA_3B, 512, shard="full")
    plan = llama_plan(catalog, "4x1080ti", LLAMA_3B, 2048, shard="full", offload="optimizer")
    assert len(plan.members) == 4 and not plan.left_out
    check_full(plan, offload=True)
    assert all(card.checkpointing for card in plan.full.cards)
    # 18 B an element of 3.21G elements on one machine: 53.9 GiB of its 64.
    assert plan.full.host[0].used_bytes == 18 * 3_212_749_824
    with pytest.raises(ValueError, match=r"--offload optimizer: machine 0's 4 cards keep 53\.9 GiB .* more than its "
                                         r"32 GiB \(--host-memory\)"):
        llama_plan(catalog, "4x1080ti", LLAMA_3B, 2048, shard="full", offload="optimizer", host_memory=32)


def test_checkpointing_auto_is_on_only_where_a_card_needs_it(catalog):
    # A 1080 Ti beside an A6000: the A6000 checkpoints to take 7 samples a micro-step; the
    # 1080 Ti holds its 1 without. On Cephalo's own cluster every card fits without.
    mixed = plan_for(catalog, "1x1080ti+1xa6000", "gpt2-1.5b", global_batch=64, shard="full")
    check_full(mixed)
    plan = plan_for(catalog, CEPHALO, "gpt2-1.5b", global_batch=64, shard="full")
    check_full(plan)
    assert [card.checkpointing for card in mixed.full.cards] == [False, True]
    assert not any(card.checkpointing for card in plan.full.cards)
    check_auto(mixed)
    check_auto(plan)
    off = plan_for(catalog, CEPHALO, "gpt2-1.5b", global_batch=64, shard="full", checkpointing="off")
    check_full(off)
    assert not any(card.checkpointing for card in off.full.cards)
    # A card that cannot hold one sample without checkpointing is left out under off.
    with pytest.raises(ValueError, match="does not fit even fully sharded"):
        llama_plan(catalog, "4x1080ti", LLAMA_1B, 2048, shard="full", offload="optimizer", checkpointing="off")


def test_l4_a6000_and_p40_from_their_spec_sheets(catalog):
    figures = {name: (d.capability, d.memory_gib, d.bandwidth_gbs, d.fp32_tflops)
               for name in ("l4", "a6000", "p40") for d in [catalog.device(name)]}
    assert figures == {"l4": ((8, 9), 24, 300, 30.3), "a6000": ((8, 6), 48, 768, 38.7),
                       "p40": ((6, 1), 24, 346, 12)}


def test_the_command_line_prints_per_card_fields_and_json(capsys):
    args = ["--cluster", LEGACY, "--model", "gpt2-1.5b", "--global-batch", "64", "--seq", "1024", "--shard", "full"]
    assert main(args) == 0
    text = capsys.readouterr().out
    for part in ("fully sharded by memory", "18 B an element", "ckpt", "held/usable", "range",
                 "lock-step over", "2 all-gathers of the weights", "30 B an element at 900 GB/s x 0.7",
                 "largest GPT-2 (seq 1024, batch 64) on all 4 cards: gpt2-355m unsharded, gpt2-1.5b state sharded, "
                 "gpt2-1.5b fully sharded, gpt2-1.5b with offload", "largest Llama-3.2"):
        assert part in text, part
    assert main(args + ["--offload", "optimizer", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    full = record["full_shard"]
    assert full["offload"] == "optimizer" and full["persistent_bytes_per_element"] == 6
    assert sum(card["elements"] for card in full["cards"]) == P_1_5B
    for card in full["cards"]:
        assert {"micro_batch", "checkpointing", "weights_bytes", "gradient_bytes", "state_bytes", "gathered_bytes",
                "activation_bytes", "held_bytes", "host_bytes", "pcie_s"} <= set(card)
        assert card["state_bytes"] == 0 and card["host_bytes"] == 18 * card["elements"]
    assert full["host"][0]["used_bytes"] == 18 * P_1_5B
    assert set(record["largest"]["GPT-2"]) == {f"{w}{m}" for w in ("all", "any")
                                               for m in ("", "_sharded", "_full", "_offload")}


@pytest.mark.parametrize("extra, message", [
    (["--shard", "--offload", "optimizer"], "--offload optimizer needs --shard full"),
    (["--offload", "optimizer"], "--offload optimizer needs --shard full"),
    (["--shard", "--checkpointing", "on"], "--checkpointing on needs --shard full"),
    (["--shard", "full", "--host-memory", "64"], "--host-memory 64 only counts with --offload optimizer"),
    (["--shard", "full", "--offload", "optimizer", "--host-memory", "64,32"],
     "--host-memory '64,32': 2 figures for 1 machines"),
    (["--shard", "full", "--offload", "optimizer", "--host-memory", "lots"], "--host-memory 'lots': expected GiB"),
    (["--shard", "full", "--simulate", "10"], "--simulate steps the plan with the all-reduce trainer"),
    (["--shard", "zero3"], "argument --shard: invalid choice: 'zero3'"),
    (["--shard", "full", "--offload", "everything"], "argument --offload: invalid choice: 'everything'"),
    (["--shard", "full", "--checkpointing", "maybe"], "argument --checkpointing: invalid choice: 'maybe'"),
])
def test_refusals_name_the_argument(capsys, extra, message):
    with pytest.raises(SystemExit) as stop:
        main(["--cluster", "4x1080ti", "--model", "gpt2-774m", "--global-batch", "64"] + extra)
    assert stop.value.code == 2
    error = capsys.readouterr().err
    last = error.strip().splitlines()[-1]   # argparse's own refusals come after its usage lines
    assert last.startswith("hetcomm plan: error: ") and message in last


def test_a_bare_shard_is_still_the_optimizer_state(catalog, capsys):
    args = ["--cluster", LEGACY, "--model", "gpt2-774m", "--global-batch", "64", "--seq", "1024"]
    assert main(args + ["--shard"]) == 0
    bare = capsys.readouterr().out
    assert main(args + ["--shard", "state"]) == 0
    state = capsys.readouterr().out
    cut = [line for line in bare.splitlines() if "planned in" not in line]
    assert cut == [line for line in state.splitlines() if "planned in" not in line]
    assert "optimizer state sharded by memory" in bare and "fully sharded" not in bare
